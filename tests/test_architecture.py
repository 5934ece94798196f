"""The layering rules of docs/architecture.md ("Layers"), checked on the source's import statements.

Layers: `engine/` never imports trio; `actors/`, `supervision/` and `http/`
never import mlx; `supervision/` and `http/` never import `engine/`; `engine/`
imports nothing above it. Rooms: inside `engine/` and `http/`, which room may
import which is the table `ROOM_IMPORTS`; it must match the code exactly (a
new import between rooms is a decision, recorded here) and have no cycle;
the wire APIs never import each other. Also: every directory of the package
is a package with a docstring, production code never imports
`mlx_trio.testing`, and no Python file in the repository edits `sys.path`.
Each rule is a function over a package directory (or a source text), so the
tests at the bottom can show it failing on a synthetic one.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections import defaultdict
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "mlx_trio"

# What every layer may import: plain values, no behaviour (docs/architecture.md, "Layers").
SHARED_VALUES = frozenset({"params", "events", "errors", "config", "logprobs", "output_format"})

# The HTTP app registers every wire API's routes and the server runs that app: these two modules sit above the
# wire rooms, so they are a node of their own, and the rest of http/server/ (the plumbing) stays below them.
APP_MODULES = {"mlx_trio.http.server.app": "http/server/app", "mlx_trio.http.server.http_server": "http/server/app"}
# Not wire rooms: what the wire APIs stand on, and what assembles them. Every other http/ room is a wire API.
HTTP_BELOW_WIRE = frozenset({"http/server", "http/completion"})
HTTP_ABOVE_WIRE = frozenset({"http", "http/server/app"})

# Which room of engine/, http/, link/ and processes/ imports which (a flat module is a room of its own;
# "engine", "http" and "processes" are the packages' own __init__; link/, the engine link's protocol, is one
# room). It matches the import graph exactly and has no cycle. `cli` is a room no other may import.
ROOM_IMPORTS: dict[str, frozenset[str]] = {
    "engine": frozenset(),
    "engine/lease_thread": frozenset({"engine/kv"}),  # prefill-only cuDNN turns decode's KV layout on
    "engine/sampling": frozenset(),
    "engine/prompt_cache": frozenset(),
    "engine/switches": frozenset(),  # the environment's kill switches, read one way
    "engine/spans": frozenset(),  # parts of lease jobs, timed for the server-side profile
    "engine/kv": frozenset({"engine/prompt_cache"}),  # cache_clone copies host entries
    # load measures the KV layout, builds the grammar, loads one rank's shard
    "engine/model": frozenset({"engine/kv", "engine/sampling", "engine/distributed",
                               "engine/attention", "engine/switches"}),  # load wraps attention layers for the ragged kernel
    # The ragged route reads the batch cache's padding, and runs the kernel where the lease thread sees CUDA.
    "engine/attention": frozenset({"engine/kv", "engine/lease_thread", "engine/switches"}),
    "engine/distributed": frozenset({"engine/lease_thread"}),  # a follower's thread is set up as a lease's
    # Each row's forward uses its adapter; a decode step runs the lean forward (engine/model/decode_forward.py);
    # a cohort under prefill-only cuDNN shares its forwards only where the routed attention covers the model.
    "engine/batch": frozenset({"engine/kv", "engine/prompt_cache", "engine/sampling", "engine/speculative",
                               "engine/adapters", "engine/model", "engine/attention", "engine/spans"}),
    "engine/speculative": frozenset({"engine/kv"}),  # a draft model's KV joins, leaves and rolls back by row
    "engine/adapters": frozenset(),
    "http": frozenset({"http/server", "http/server/app"}),
    "http/server/app": frozenset({"http/server", "http/openai", "http/anthropic", "http/responses"}),
    "http/openai": frozenset({"http/server", "http/completion"}),
    "http/anthropic": frozenset({"http/server", "http/completion"}),
    "http/responses": frozenset({"http/server", "http/completion"}),
    "http/server": frozenset(),  # the plumbing: every other http room builds on it
    "http/completion": frozenset({"http/server"}),  # the shared path frames SSE, maps errors, logs requests
    # The protocol: the engine's side keeps the fronts' one /v1/responses store; the front's side is an EngineLike.
    "link": frozenset({"http/responses", "http/server"}),
    # The process layer (mlx_trio/processes/): the launcher keeps the engine (keeper) and the fronts (pool);
    # only a front process's main runs the HTTP app, and the launcher reads only plain values of http/server.
    "processes": frozenset(),
    "processes/launcher": frozenset({"link", "processes/engine_keeper", "processes/front_pool", "http/server"}),
    "processes/engine_keeper": frozenset(),
    "processes/engine_process": frozenset({"link", "processes/orphan"}),
    "processes/front_pool": frozenset({"http/server"}),
    "processes/front_process": frozenset({"link", "processes/orphan", "http/server", "http/server/app"}),
    "processes/orphan": frozenset(),
}
# The layers whose modules are sorted into rooms (the rest of the package stands outside the table).
ROOMED_LAYERS = ("engine", "http", "link", "processes")

# Imports that break a room rule today, each to go (issue #16): (importing module, imported module) -> why.
# An entry whose import is gone fails `test_known_crossings_are_still_there`: delete it then.
KNOWN_CROSSINGS: dict[tuple[str, str], str] = {
}

SYS_PATH_EDITS = frozenset({"insert", "append", "extend", "remove", "pop", "clear", "__setitem__"})


# -- reading the code ------------------------------------------------------------------------------

def _module_name(path: Path, package: Path) -> str:
    parts = [package.name, *path.relative_to(package).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(name: str, package: Path) -> bool:
    parts = name.split(".")
    if parts[0] != package.name:
        return False
    where = package.joinpath(*parts[1:])
    return where.with_suffix(".py").is_file() or (where / "__init__.py").is_file()


def _imported_modules(path: Path, package: Path = PACKAGE) -> set[str]:
    """Every module `path` imports, relative imports resolved, `from pkg import submodule` as the submodule."""
    tree = ast.parse(path.read_text(), filename=str(path))
    here = _module_name(path, package).split(".")
    if path.name != "__init__.py":
        here = here[:-1]  # relative imports start from the module's package
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(here[: len(here) - node.level + 1] if node.level else [])
            module = ".".join(p for p in (base, node.module or "") if p)
            if not module:
                continue
            # `from pkg import sub` depends on the submodule; `from mod import name` on the module.
            names.update(sub if _is_module(sub := f"{module}.{a.name}", package) else module for a in node.names)
    return names


def _files(subpackage: str, package: Path = PACKAGE) -> list[Path]:
    return sorted((package / subpackage).rglob("*.py")) if subpackage else sorted(package.rglob("*.py"))


def _top(name: str) -> str:
    return name.split(".")[0]


def _room(module: str, package: Path = PACKAGE) -> str | None:
    """The room of `ROOMED_LAYERS` that holds `module` ("cli" for the CLI), or None outside them."""
    if module in APP_MODULES:
        return APP_MODULES[module]
    parts = module.split(".")
    if len(parts) < 2 or parts[0] != package.name:
        return None
    if parts[1] in ("cli", "link"):
        return parts[1]
    if parts[1] not in ROOMED_LAYERS:
        return None
    return "/".join(parts[1:3])


def room_imports(package: Path = PACKAGE) -> dict[tuple[str, str], set[tuple[str, str]]]:
    """(room, room it imports) -> the (module, imported module) pairs behind it, known crossings left out."""
    edges: dict[tuple[str, str], set[tuple[str, str]]] = defaultdict(set)
    for layer in ROOMED_LAYERS:
        for path in _files(layer, package):
            module = _module_name(path, package)
            src = _room(module, package)
            for name in _imported_modules(path, package):
                dst = _room(name, package)
                if dst and dst != src and src and (module, name) not in KNOWN_CROSSINGS:
                    edges[src, dst].add((module, name))
    return edges


def rooms(package: Path = PACKAGE) -> set[str]:
    return {room for layer in ROOMED_LAYERS for path in _files(layer, package)
            if (room := _room(_module_name(path, package), package))}


def table_mismatches(package: Path, table: Mapping[str, Iterable[str]]) -> list[str]:
    """How the code's room imports differ from `table`: one line per difference."""
    found = room_imports(package)
    allowed = {(src, dst) for src, dsts in table.items() for dst in dsts}
    out = [f"{src} imports {dst} ({', '.join(f'{m} -> {n}' for m, n in sorted(found[src, dst]))}), "
           f"which ROOM_IMPORTS does not allow" for src, dst in sorted(found.keys() - allowed)]
    out += [f"ROOM_IMPORTS lets {src} import {dst}, but no module does: delete it"
            for src, dst in sorted(allowed - found.keys())]
    out += [f"room {room} has no ROOM_IMPORTS entry" for room in sorted(rooms(package) - table.keys())]
    out += [f"ROOM_IMPORTS names {room}, which has no module" for room in sorted(table.keys() - rooms(package))]
    return out


def find_cycle(table: Mapping[str, Iterable[str]]) -> list[str] | None:
    """A cycle of `table` as [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(table.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(table):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def sys_path_edits(source: str) -> list[int]:
    """Lines of `source` that change `sys.path` (the package is installed: nothing needs to)."""
    def is_sys_path(node: ast.AST) -> bool:
        return (isinstance(node, ast.Attribute) and node.attr == "path" and isinstance(node.value, ast.Name)
                and node.value.id == "sys")

    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in SYS_PATH_EDITS and is_sys_path(node.value):
            lines.append(node.lineno)
        elif isinstance(node, (ast.Assign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(is_sys_path(t.value if isinstance(t, ast.Subscript) else t) for t in targets):
                lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.module == "sys" and any(a.name == "path" for a in node.names):
            lines.append(node.lineno)
    return sorted(lines)


def packages_without_docstring(package: Path) -> list[str]:
    """Directories of `package` holding Python code that are not packages with a docstring."""
    out = []
    holding = {parent for p in package.rglob("*.py") for parent in p.parents if parent.is_relative_to(package)}
    for directory in sorted(holding):
        init = directory / "__init__.py"
        if not init.is_file() or not ast.get_docstring(ast.parse(init.read_text())):
            out.append(str(directory.relative_to(package.parent)))
    return out


def modules_importing_testing(package: Path) -> list[str]:
    """Production modules (outside testing/ and bench/) that import `<package>.testing`."""
    helpers = f"{package.name}.testing"
    return [_module_name(path, package) for path in _files("", package)
            if path.relative_to(package).parts[0] not in ("testing", "bench")
            and any(n == helpers or n.startswith(helpers + ".") for n in _imported_modules(path, package))]


def python_files(repo: Path) -> list[Path]:
    """The repository's .py files: tracked and untracked-but-not-ignored, as git sees them."""
    try:
        listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "--", "*.py"], cwd=repo,
                                check=True, capture_output=True, text=True).stdout.splitlines()
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return [repo / name for name in listed if (repo / name).is_file()]


# -- the rules on mlx_trio -------------------------------------------------------------------------

@pytest.mark.parametrize("path", _files("engine"), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_engine_never_imports_trio(path: Path) -> None:
    """engine/ is synchronous MLX mechanics: no module there imports trio."""
    assert not {n for n in _imported_modules(path) if _top(n) in {"trio", "quart_trio", "hypercorn"}}


@pytest.mark.parametrize(
    "path", _files("actors") + _files("http") + _files("supervision"), ids=lambda p: str(p.relative_to(PACKAGE))
)
def test_actors_http_supervision_never_import_mlx(path: Path) -> None:
    """Every MLX call goes through the GPU lease, so these layers never import mlx or mlx_lm."""
    assert not {n for n in _imported_modules(path) if _top(n) in {"mlx", "mlx_lm"}}


@pytest.mark.parametrize("path", _files("supervision") + _files("http"), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_supervision_and_http_never_import_engine(path: Path) -> None:
    """Supervision is generic and HTTP is a client of the embeddable API: neither reaches into engine/."""
    assert not {n for n in _imported_modules(path) if n.startswith("mlx_trio.engine")}


# What runs in a front process or the launcher (the front's side of the link, and the process layer but for the
# engine's process): they hold no MLX and no engine.
FRONT_SIDE = [p for p in _files("link") if p.name in ("__init__.py", "wire.py", "remote_engine.py", "remote_store.py")]
FRONT_SIDE += [p for p in _files("processes") if p.name != "engine_process.py"]


@pytest.mark.parametrize("path", FRONT_SIDE, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_the_front_side_and_the_launcher_import_no_mlx_no_engine_no_api(path: Path) -> None:
    """A front process serves HTTP over the link, the launcher keeps processes: no MLX, no engine/, no actors,
    no api.py (the engine's process alone holds them)."""
    assert not {n for n in _imported_modules(path)
                if _top(n) in {"mlx", "mlx_lm"} or n.startswith(("mlx_trio.engine", "mlx_trio.actors", "mlx_trio.api"))}


# What of the HTTP stack the launcher's own modules may read: the server's settings and the drain's report.
LAUNCHER_READS_OF_HTTP = frozenset({"mlx_trio.http.server.config", "mlx_trio.http.server.drain"})


@pytest.mark.parametrize("path", [p for p in _files("processes") if p.name not in ("front_process.py",)],
                         ids=lambda p: str(p.relative_to(PACKAGE)))
def test_the_launcher_side_reads_only_plain_values_of_the_http_stack(path: Path) -> None:
    """Only a front process's main runs the HTTP app; the launcher, keeper and pool read its settings only."""
    assert {n for n in _imported_modules(path) if n.startswith("mlx_trio.http")} <= LAUNCHER_READS_OF_HTTP


def test_a_front_process_and_the_launcher_load_no_mlx() -> None:
    """Importing what a front process or the launcher runs pulls no MLX in (the engine's output format may, once unpickled)."""
    code = ("import sys, mlx_trio.processes.front_process, mlx_trio.processes.launcher, mlx_trio.cli; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('mlx', 'mlx_lm')))")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    assert out.strip() == "[]"


@pytest.mark.parametrize("path", _files("profiling"), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_profiling_imports_no_mlx_no_trio_and_nothing_else_of_the_package(path: Path) -> None:
    """The lease (actors/) calls into profiling/, and the profiler thread runs beside MLX: it stands alone."""
    assert not {n for n in _imported_modules(path) if _top(n) in {"mlx", "mlx_lm", "trio"}
                or (n.startswith("mlx_trio") and not n.startswith("mlx_trio.profiling"))}


@pytest.mark.parametrize("path", _files("engine"), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_engine_imports_nothing_above_it(path: Path) -> None:
    """engine/ is the bottom layer: of mlx_trio it imports only itself and the shared values."""
    allowed = SHARED_VALUES | {"engine"}
    above = {n for n in _imported_modules(path) if (parts := n.split("."))[0] == "mlx_trio"
             and (len(parts) == 1 or parts[1] not in allowed)}
    assert not above


def test_room_imports_match_the_table() -> None:
    assert table_mismatches(PACKAGE, ROOM_IMPORTS) == []


def test_the_room_table_has_no_cycle() -> None:
    assert find_cycle(ROOM_IMPORTS) is None


def test_the_wire_apis_stand_apart() -> None:
    """A wire API (openai, anthropic, ...) imports no other, and the server plumbing below them imports none.

    What they share lives in http/completion/ or http/server/; only the app registering routes sees them all.
    """
    wire = {room for room in ROOM_IMPORTS if room.startswith("http/")} - HTTP_BELOW_WIRE - HTTP_ABOVE_WIRE
    assert {"http/openai", "http/anthropic"} <= wire
    assert {(a, b) for a in wire | HTTP_BELOW_WIRE for b in ROOM_IMPORTS[a] & wire} == set()


def test_known_crossings_are_still_there() -> None:
    """Each entry of KNOWN_CROSSINGS is a real import today (else delete it), and is one across rooms."""
    for (module, name), why in KNOWN_CROSSINGS.items():
        path = PACKAGE.parent.joinpath(*module.split(".")).with_suffix(".py")
        assert path.is_file() and name in _imported_modules(path), f"{module} no longer imports {name} ({why})"
        assert _room(module) != _room(name)


def test_no_python_file_edits_sys_path() -> None:
    """The package is installed (`make setup`): scripts, benchmarks and tests import it, never a path."""
    edits = {str(p.relative_to(REPO)): lines for p in python_files(REPO) if (lines := sys_path_edits(p.read_text()))}
    assert edits == {}


def test_every_directory_is_a_package_with_a_docstring() -> None:
    """Each room says what it holds in its __init__ docstring."""
    assert packages_without_docstring(PACKAGE) == []


def test_production_never_imports_testing() -> None:
    """mlx_trio.testing builds models for tests and benchmarks; the server must not depend on it."""
    assert modules_importing_testing(PACKAGE) == []


def test_the_architecture_checks_see_files() -> None:
    """Guard against the parametrized checks silently running over nothing."""
    assert len(_files("engine")) >= 5 and len(_files("actors")) >= 3 and len(_files("http")) >= 5
    assert {"engine/model", "engine/batch", "http/openai", "http/server/app"} <= rooms()


# -- the checkers fail where they should ------------------------------------------------------------

def _write(root: Path, files: Mapping[str, str], *, packages: bool = True) -> Path:
    """`files` under `root`; with `packages`, every directory they are in gets an `__init__.py` with a docstring."""
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    if packages:
        for directory in {parent for name in files for parent in (root / name).parents if parent != root
                          and parent.is_relative_to(root)}:
            if not (directory / "__init__.py").exists():
                (directory / "__init__.py").write_text(f'"""The {directory.name} room."""\n')
    return root / "mlx_trio"


def test_the_room_check_sees_absolute_relative_and_submodule_imports(tmp_path: Path) -> None:
    package = _write(tmp_path, {
        "mlx_trio/engine/batch/step.py": "X = 1\n",
        "mlx_trio/engine/kv/a.py": "from mlx_trio.engine.batch.step import X\n",
        "mlx_trio/engine/kv/b.py": "from ..batch import step\nfrom . import a\n",  # a: the same room, no edge
        "mlx_trio/engine/model/c.py": "from mlx_trio.engine import kv\n",
    })
    assert packages_without_docstring(package) == []
    table = {"engine": set(), "engine/batch": set(), "engine/kv": set(), "engine/model": {"engine/batch"}}
    assert room_imports(package) == {
        ("engine/kv", "engine/batch"): {("mlx_trio.engine.kv.a", "mlx_trio.engine.batch.step"),
                                        ("mlx_trio.engine.kv.b", "mlx_trio.engine.batch.step")},
        ("engine/model", "engine/kv"): {("mlx_trio.engine.model.c", "mlx_trio.engine.kv")},
    }
    assert table_mismatches(package, table) == [
        "engine/kv imports engine/batch (mlx_trio.engine.kv.a -> mlx_trio.engine.batch.step, "
        "mlx_trio.engine.kv.b -> mlx_trio.engine.batch.step), "
        "which ROOM_IMPORTS does not allow",
        "engine/model imports engine/kv (mlx_trio.engine.model.c -> mlx_trio.engine.kv), "
        "which ROOM_IMPORTS does not allow",
        "ROOM_IMPORTS lets engine/model import engine/batch, but no module does: delete it",
    ]
    assert table_mismatches(package, {"engine/kv": {"engine/batch"}, "engine/model": {"engine/kv"}}) == [
        "room engine has no ROOM_IMPORTS entry", "room engine/batch has no ROOM_IMPORTS entry"]


def test_find_cycle_names_the_cycle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "d": {"a", "c"}}) is None


def test_sys_path_edits_are_found_but_reads_are_not() -> None:
    source = ("import sys\nsys.path.insert(0, 'x')\nsys.path.append('y')\nsys.path = []\nsys.path[0] = 'z'\n"
              "sys.path += ['w']\nfrom sys import path\nprint(sys.path)\n# sys.path.insert(0, 'comment')\n")
    assert sys_path_edits(source) == [2, 3, 4, 5, 6, 7]


def test_the_package_checks_see_a_missing_docstring_and_a_testing_import(tmp_path: Path) -> None:
    """http/ has no __init__.py and http/room/ an empty one; bench/ may import testing, http/room/ may not."""
    package = _write(tmp_path, {
        "mlx_trio/__init__.py": '"""p"""',
        "mlx_trio/http/room/__init__.py": "",
        "mlx_trio/http/room/a.py": "from mlx_trio.testing import tiny_models\n",
        "mlx_trio/bench/__init__.py": '"""b"""\nfrom mlx_trio.testing.tiny_models import LLAMA\n',
    }, packages=False)
    assert packages_without_docstring(package) == ["mlx_trio/http", "mlx_trio/http/room"]
    assert modules_importing_testing(package) == ["mlx_trio.http.room.a"]


def test_an_import_of_the_cli_from_the_link_or_of_the_launcher_from_http_is_flagged(tmp_path: Path) -> None:
    """The process layer's rules: nothing below the CLI imports it, and the HTTP stack and the launcher stay apart."""
    package = _write(tmp_path, {
        "mlx_trio/cli.py": "X = 1\n",
        "mlx_trio/link/wire.py": "from mlx_trio.cli import X\n",
        "mlx_trio/processes/launcher.py": "Y = 1\n",
        "mlx_trio/http/server/state.py": "from mlx_trio.processes.launcher import Y\n",
    })
    table = {"link": set(), "processes": set(), "processes/launcher": set(), "http": set(), "http/server": set()}
    assert table_mismatches(package, table) == [
        "http/server imports processes/launcher (mlx_trio.http.server.state -> mlx_trio.processes.launcher), "
        "which ROOM_IMPORTS does not allow",
        "link imports cli (mlx_trio.link.wire -> mlx_trio.cli), which ROOM_IMPORTS does not allow",
    ]
