"""`python -m mlx_trio.bench ...`: the same as `mlx-trio bench ...`."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from mlx_trio.bench.cli import DESCRIPTION, EPILOG, add_arguments, run


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mlx-trio bench", description=DESCRIPTION, epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
