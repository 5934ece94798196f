"""Every reference resolves: the files, sections and modules that code and docs cite exist.

The scanner reads every tracked `.py` and `.md` file (`git ls-files`) except
this one (whose text states the rules, and so names what they forbid) and
applies these rules; anything they do not describe is prose, not a citation:

1. **Paths.** A token like `a/b.py` or `a/b/` (extensions in `_EXTENSIONS`)
   whose first component is a top-level directory of the repository
   (`mlx_trio/`, `tests/`, `docs/`, ...) must be a tracked file, or for a
   trailing `/` a directory holding one. One whose first component is a
   subpackage of `mlx_trio/` (`engine/batch/solo_row.py`,
   `http/server/errors.py`) resolves under `mlx_trio/`. Any other first
   component names another project's file (`mlx_lm/models/cache.py`) or a
   runtime path (`OUT/x.json`) and is not checked. A path inside a longer
   token (a URL) is part of that token.
2. **Page names.** A bare `name.md` must be the name of a tracked `.md` file.
   Bare `.py` names are not checked: prose names mlx-lm's files that way.
3. **The reference notes** read while designing the engine are not in the
   repository and are never cited: what they say that matters is in
   docs/design.md, in our own words.
4. **Markdown links.** `[text](target)` in a `.md` file, unless the target is
   a URL: the target resolves relative to the page, and a `#anchor` must be
   one of the target's heading anchors (GitHub's slugs).
5. **Sections.** `§N` belongs to a citation `page.md §N` (a list may follow:
   `, §M`, ` and §M`, ` or §M`, `–§M`, across line breaks too), and N must be a numbered heading of
   that page (`## 2. Prefill`, `### 2.4 ...`). In a `.md` file a `§N` with no
   page before it cites the page itself.
6. **Modules.** A dotted name `mlx_trio.a.b` must import, and any names after
   the module must be attributes of it. Logger names (the argument of
   `getLogger(...)`) are a namespace of their own and are not checked.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
import subprocess
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path, PurePosixPath

import attrs
import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = "mlx_trio"
THIS = PurePosixPath(Path(__file__).resolve().relative_to(REPO).as_posix())
# The checkers' own tests: their fixtures are fake trees whose paths exist only in a tmp_path.
CHECKERS = frozenset({THIS, PurePosixPath("tests/test_architecture.py")})

_EXTENSIONS = "py|md|json|txt|toml|sh|png|cfg|ini|yaml|yml"
_PATH_CHAR = r"[\w.-]"
# A path token: components joined by '/', ending in a known extension or in '/'. Not preceded by
# a path character, so a path inside a URL or a longer path never starts a match.
_FILE = rf"{_PATH_CHAR}*\w\.(?:{_EXTENSIONS})(?![\w/])(?:#[\w-]+)?"  # name.ext, perhaps #anchor
_PATH = re.compile(rf"(?<![\w./~-])((?:{_PATH_CHAR}+/)+(?:{_FILE}|(?![\w.-])))")
_BARE_PAGE = re.compile(r"(?<![\w./~-])([\w.-]*\w\.md)\b(?!/)")
# `harnesses.md` is a reference note unless it is our own docs/harnesses.md.
_REFERENCE_NOTES = re.compile(r"batching-design|trio-mlx|mlx-lm-0\.32\.2\.md|(?<!docs/)(?<![\w/(])harnesses\.md")
_LINK = re.compile(r"\[[^\]\n]*\]\(([^)\s]+)\)")
_SECTION = r"§\d+(?:\.\d+)*"
_SECTION_LIST = rf"{_SECTION}(?:(?:,\s*|\s+and\s+|\s+or\s+|\s*[–-]\s*){_SECTION})*"
_CITATION = re.compile(rf"([\w./-]*\w\.md)\)?\s+({_SECTION_LIST})")
_ANY_SECTION = re.compile(_SECTION)
_DOTTED = re.compile(rf"(?<![\w.]){PACKAGE}(?:\.[A-Za-z_]\w*)+")
_LOGGER = re.compile(r"getLogger\(\s*[\"']$")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
_NUMBERED = re.compile(r"(\d+(?:\.\d+)*)\.?\s")


@attrs.frozen
class Problem:
    path: str
    line: int
    text: str
    why: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.text!r}: {self.why}"


class Repo:
    """What citations resolve against: the tracked files, how to read one, whether a module name imports."""

    def __init__(self, files: Iterable[str], read: Callable[[str], str], resolves: Callable[[str], bool]) -> None:
        self.files = frozenset(files)
        self.read = read
        self.resolves = resolves
        self.dirs = frozenset(str(d) for f in self.files for d in PurePosixPath(f).parents if str(d) != ".")
        self.roots = frozenset(d for d in self.dirs if "/" not in d)
        self.subpackages = frozenset(d.split("/")[1] for d in self.dirs
                                     if d.startswith(f"{PACKAGE}/") and d.count("/") == 1)
        self.page_names = frozenset(PurePosixPath(f).name for f in self.files if f.endswith(".md"))
        self._headings: dict[str, tuple[frozenset[str], frozenset[str]]] = {}

    def exists(self, path: str) -> bool:
        return path.rstrip("/") in self.dirs if path.endswith("/") else path in self.files

    def page(self, name: str, citing: str) -> str | None:
        """The tracked page a citation `name` (a path or a bare name) means, from the file `citing`."""
        for candidate in (name, f"{PACKAGE}/{name}", _join(citing, name), f"docs/{name}"):
            if candidate in self.files:
                return candidate
        return None

    def numbers(self, page: str) -> frozenset[str]:
        """The page's section numbers: `## 2. Prefill` is 2, `### 2.4 Cohorts` is 2.4."""
        return self._parsed(page)[0]

    def anchors(self, page: str) -> frozenset[str]:
        return self._parsed(page)[1]

    def _parsed(self, page: str) -> tuple[frozenset[str], frozenset[str]]:
        if page not in self._headings:
            numbers: set[str] = set()
            anchors: set[str] = set()
            fenced = False
            for line in self.read(page).splitlines():
                if line.startswith("```"):
                    fenced = not fenced
                heading = None if fenced else _HEADING.match(line)
                if heading is None:
                    continue
                title = heading.group(2)
                if number := _NUMBERED.match(title + " "):
                    numbers.add(number.group(1))
                slug = anchor = _slug(title)
                n = 0
                while anchor in anchors:  # GitHub numbers repeated headings
                    n += 1
                    anchor = f"{slug}-{n}"
                anchors.add(anchor)
            self._headings[page] = frozenset(numbers), frozenset(anchors)
        return self._headings[page]


def _slug(title: str) -> str:
    """GitHub's heading anchor: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"`|\*\*|\[([^\]]*)\]\([^)]*\)", lambda m: m.group(1) or "", title).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _join(citing: str, target: str) -> str:
    parts: list[str] = []
    for part in (*PurePosixPath(citing).parent.parts, *PurePosixPath(target).parts):
        if part == "..":
            if parts:
                parts.pop()
        elif part != ".":
            parts.append(part)
    return "/".join(parts)


Report = Callable[[int, str, str], None]  # (offset in the text, what is cited, why it does not resolve)


def problems_in(path: str, text: str, repo: Repo) -> list[Problem]:
    """Every citation in `text` (the file `path`) that does not resolve."""
    found: list[Problem] = []

    def report(start: int, cited: str, why: str) -> None:
        found.append(Problem(path, text.count("\n", 0, start) + 1, cited, why))

    for m in _REFERENCE_NOTES.finditer(text):
        report(m.start(), m.group(0), "a reference note outside the repository: cite docs/design.md")
    _check_paths(text, repo, report)
    link_targets = _check_links(path, text, repo, report) if path.endswith(".md") else set()
    for m in _BARE_PAGE.finditer(text):
        name = m.group(1)
        if m.start() not in link_targets and not _REFERENCE_NOTES.search(name) and name not in repo.page_names:
            report(m.start(), name, "no tracked page of that name")
    _check_sections(path, text, repo, report)
    for m in _DOTTED.finditer(text):
        if not _LOGGER.search(text, max(m.start() - 40, 0), m.start()) and not repo.resolves(m.group(0)):
            report(m.start(), m.group(0), "does not import (or names no attribute of its module)")
    return found


def _check_paths(text: str, repo: Repo, report: Report) -> None:
    for m in _PATH.finditer(text):
        cited, _, anchor = m.group(1).partition("#")
        first = cited.split("/")[0]
        if first in repo.roots:
            target = cited
        elif first in repo.subpackages:
            target = f"{PACKAGE}/{cited}"
        else:
            continue  # another project's path, or one made at run time
        if not repo.exists(target):
            report(m.start(), m.group(1), f"no tracked {'directory' if target.endswith('/') else 'file'} {target}")
        elif anchor and anchor not in repo.anchors(target):
            report(m.start(), m.group(1), f"{target} has no heading #{anchor}")


def _check_links(path: str, text: str, repo: Repo, report: Report) -> set[int]:
    """Check the page's links; return where their targets start (the link rule covers those names)."""
    starts: set[int] = set()
    for m in _LINK.finditer(text):
        target = m.group(1)
        starts.add(m.start(1))
        if re.match(r"[a-z][a-z+.-]*:", target):
            continue  # a URL (https:, mailto:)
        file, _, anchor = target.partition("#")
        page = _join(path, file) if file else path
        if page not in repo.files:
            report(m.start(1), target, f"link to {page}, which is not tracked")
        elif anchor and page.endswith(".md") and anchor not in repo.anchors(page):
            report(m.start(1), target, f"{page} has no heading #{anchor}")
    return starts


def _check_sections(path: str, text: str, repo: Repo, report: Report) -> None:
    cited: set[int] = set()
    for m in _CITATION.finditer(text):
        page = repo.page(m.group(1), path)  # None: the page rules above already reported it
        for section in _ANY_SECTION.finditer(m.group(2)):
            at = m.start(2) + section.start()
            cited.add(at)
            if page is not None and section.group(0)[1:] not in repo.numbers(page):
                report(at, f"{m.group(1)} {section.group(0)}", f"{page} has no section {section.group(0)[1:]}")
    for m in _ANY_SECTION.finditer(text):
        if m.start() in cited:
            continue
        if not path.endswith(".md"):
            report(m.start(), m.group(0), "a section with no page: write `docs/<page>.md §N`")
        elif m.group(0)[1:] not in repo.numbers(path):
            report(m.start(), m.group(0), f"{path} has no section {m.group(0)[1:]}")


def _imports(name: str) -> bool:
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        module_name = ".".join(parts[:cut])
        try:
            found = importlib.util.find_spec(module_name) is not None
        except ImportError:
            found = False
        if not found:
            continue
        obj: object = importlib.import_module(module_name)
        for attribute in parts[cut:]:
            if not hasattr(obj, attribute):
                return False
            obj = getattr(obj, attribute)
        return True
    return False


def _tracked_repo() -> Repo:
    listed = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    return Repo(files=listed.splitlines(), read=lambda f: (REPO / f).read_text(encoding="utf-8"),
                resolves=_imports)


def scan(repo: Repo, files: Iterable[str]) -> list[Problem]:
    return [p for f in files for p in problems_in(f, repo.read(f), repo)]


def test_every_citation_in_the_repository_resolves() -> None:
    repo = _tracked_repo()
    files = sorted(f for f in repo.files if f.endswith((".py", ".md")) and PurePosixPath(f) not in CHECKERS)
    problems = scan(repo, files)
    assert not problems, "citations that do not resolve:\n" + "\n".join(map(str, problems))


# The scanner itself, on a repository of a few files (this module is not scanned, so its examples
# may cite what does not exist).

FAKE: Mapping[str, str] = {
    "docs/design.md": "# Design\n\n## 1. Scheduling\n\n### 1.2 The row cap\n\n## 2. Prefill\n\nSee §1.2.\n",
    "docs/other.md": "# Other\n\n## Where things live\n",
    "mlx_trio/engine/batch/solo_row.py": '"""Solo rows."""\n',
    "mlx_trio/http/server/errors.py": "",
    "tests/test_x.py": "",
    "README.md": "",
}


def _fake_problems(text: str, path: str = "mlx_trio/engine/kv/layout.py") -> list[str]:
    repo = Repo(files={*FAKE, path}, read=lambda f: FAKE.get(f, text),
                resolves=lambda name: name in {"mlx_trio.engine", "mlx_trio.engine.batch.solo_row.SoloRow"})
    return [p.why for p in problems_in(path, text, repo)]


@pytest.mark.parametrize("text", [
    "see docs/design.md and mlx_trio/engine/batch/solo_row.py",
    "module-relative: engine/batch/solo_row.py, http/server/errors.py, tests/test_x.py",
    "a folder: mlx_trio/engine/batch/ and engine/",
    "sections: docs/design.md §1, §1.2 and §2; design.md §1–§2, docs/design.md §1\n    or §2",
    "another project's files: mlx_lm/models/cache.py, OUT/h200.json, server.py, bench-results/x/",
    "a URL: https://github.com/x/y/blob/main/docs/nope.md",
    "modules: mlx_trio.engine, mlx_trio.engine.batch.solo_row.SoloRow",
    'log = logging.getLogger("mlx_trio.admission")',
    "an anchor: docs/other.md#where-things-live",
])
def test_good_citations_pass(text: str) -> None:
    assert _fake_problems(text) == []


@pytest.mark.parametrize(("text", "why"), [
    ("see docs/nope.md", "no tracked file docs/nope.md"),
    ("see engine/batch/serial.py", "no tracked file mlx_trio/engine/batch/serial.py"),
    ("tests/test_y.py pins it", "no tracked file tests/test_y.py"),
    ("the room mlx_trio/engine/lanes/", "no tracked directory mlx_trio/engine/lanes/"),
    ("docs/other.md#nowhere", "docs/other.md has no heading #nowhere"),
    ("as batching-design.md says", "a reference note outside the repository: cite docs/design.md"),
    ("as trio-mlx says", "a reference note outside the repository: cite docs/design.md"),
    ("see nowhere.md", "no tracked page of that name"),
    ("docs/design.md §3", "docs/design.md has no section 3"),
    ("docs/design.md §1 and §1.3", "docs/design.md has no section 1.3"),
    ("a bare §4.1 in code", "a section with no page: write `docs/<page>.md §N`"),
    ("mlx_trio.engine.serial", "does not import (or names no attribute of its module)"),
])
def test_bad_citations_fail(text: str, why: str) -> None:
    assert _fake_problems(text) == [why]


@pytest.mark.parametrize(("text", "why"), [
    ("[a](other.md#where-things-live) [b](design.md#12-the-row-cap) [c](https://x.org/y.md)", None),
    ("[a](missing.md)", "link to docs/missing.md, which is not tracked"),
    ("[a](other.md#nowhere)", "docs/other.md has no heading #nowhere"),
    ("[a](../README.md)", None),
    ("## 1.2 Ours\n\nour own §1.2, [design.md §2](design.md), [§1.2](#12-ours)", None),
    ("our own §9", "docs/page.md has no section 9"),
])
def test_links_and_a_pages_own_sections(text: str, why: str | None) -> None:
    assert _fake_problems(text, path="docs/page.md") == ([why] if why else [])
