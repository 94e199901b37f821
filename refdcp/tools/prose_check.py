"""Checks that keep the prose true: spec hygiene and cited IDs (HARN-22, HARN-23).

Two pure checks over a source tree, used by ``tests/test_prose_truth.py``:

* :func:`stale_citations` finds every requirement ID of a known area (an area
  is the prefix of some ID in ``spec/*.md``) written anywhere in the project's
  code, docs, tests and benchmarks that names no requirement of ``spec/``. A
  range ``SAVE-15..SAVE-16`` cites both ends; a withdrawn ID still exists.
* :func:`spec_problems` checks every ``spec/*.md`` file alike (a new file is
  covered without being named): each bullet that starts with a bold ID has a
  valid keyword (``MUST``, ``MUST NOT``, ``SHOULD``, ``SHOULD NOT`` or
  ``WITHDRAWN``), a requirement has at most :data:`MAX_WORDS` words, a
  withdrawn ID says why, no requirement narrates history or benchmark figures,
  and every number from 1 to the highest of an area is present.

* :func:`guarantee_problems` (HARN-28): every section of
  ``docs/guarantees.md`` names the spec IDs and the tests that hold it to its
  promises; every top-level bullet cites an ID; every named test file and
  ``file::test`` exists; and one of the section's named test files cites one of
  its IDs with ``@pytest.mark.spec``.
* :func:`matrix_problems` (HARN-29): every row of a README table whose header
  says "conforms" links the conformance report(s) it summarises, and agrees
  with the JSON beside each: "yes"/"no" with the report's verdict, the failed
  requirements listed exactly, and whether it works after
  ``reset(checkpoint_id)`` (CONF-1 and CONF-27).
* :func:`torch_claim_problems` (HARN-30): every sentence of a ``spec/``
  requirement that says what torch does (:data:`TORCH_CLAIM`) carries a
  ``(checked: tests/...py::test_...)`` marker naming a test that exists and
  whose body runs torch's DCP (:data:`RUNS_TORCH`).

``python -m refdcp.tools.prose_check`` prints the problems of this checkout
and exits 1 when there is any.
"""

from __future__ import annotations

import ast
import functools
import json
import re
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "CHECKED",
    "MAX_WORDS",
    "RUNS_TORCH",
    "TORCH_CLAIM",
    "SCANNED",
    "SpecBullet",
    "Stale",
    "guarantee_problems",
    "main",
    "matrix_problems",
    "spec_bullets",
    "spec_problems",
    "stale_citations",
    "torch_claim_problems",
]

#: The longest requirement, in words of its text (after the ID and keyword).
MAX_WORDS = 120

#: What :func:`stale_citations` reads, relative to the project root.
SCANNED = (
    "refdcp",
    "conformance",
    "tests",
    "docs",
    "benchmarks",
    "spec",
    "mutation",
    "README.md",
    "ARCHITECTURE.md",
)
_SUFFIXES = (".py", ".md", ".json", ".toml", ".txt")

_BULLET = re.compile(r"^- \*\*([A-Za-z0-9_-]+)\*\*(.*)$")
_ID = re.compile(r"^([A-Z][A-Z0-9]*)-(\d+)$")
_LEVEL = re.compile(r"^\s+(MUST NOT|MUST|SHOULD NOT|SHOULD|WITHDRAWN)\b:?\s*(.*)$", re.DOTALL)

#: A marker naming the tests that check a claim about torch (HARN-30).
CHECKED = re.compile(r"\s*\(checked: ([^)]*)\)")

#: A sentence that says what torch does (HARN-30): a ``Differs from torch``
#: sentence, or torch (optionally a version, or one of its named components)
#: as the subject of a verb of behaviour, or "as torch does", "like torch".
TORCH_CLAIM = re.compile(
    r"Differs from torch"
    r"|\btorch(?: 2\.\d+)?(?:'s `[^`]+`)? (?:also |always |never |silently |only )?"
    r"(?:does|do|saves|stores|writes|reads|applies|keeps|uses|has|checks|counts|spreads|casts"
    r"|replaces|unpickles|caches|drops|pickles|plans|lets|opens|truncates|deletes|leaves|waits"
    r"|corrupts|packs|ends|raises|issues|copies|preserves|requires|loads|calls|fails|fsyncs"
    r"|accepts|refuses|records|places|hangs|ignores)\b"
    r"|\bas torch(?: 2\.\d+)?(?:'s \S+)? (?:does|did|calls|saves|writes)\b"
    r"|\b(?:as|like) with torch\b|\blike torch\b"
)

#: What makes a test "run torch": its own body calls torch's DCP or names its storage,
#: planners, stagers or state-dict helpers, or a helper module it calls does.
RUNS_TORCH = re.compile(
    r"\b(?:dcp|tdcp|torch_dcp)\.\w+|torch\.distributed\.checkpoint|\btorch_\w+\("
    r"|\bTorch\w+\(|\b(?:FileSystemWriter|FileSystemReader|FsspecWriter|StateDictStager"
    r"|BlockingAsyncStager|DefaultSavePlanner|DefaultLoadPlanner|HuggingFaceStorage\w+"
    r"|(?:get|set)_(?:\w+_)?state_dict|run_gloo|fns\.\w+|torch_fs\w*)\b"
)

#: Phrases that narrate history or quote a benchmark instead of stating behaviour.
HISTORY = (
    re.compile(r"\brefdcp \d+\.(?:x|\d+)"),
    re.compile(r"\b[KMG]i?B/s\b"),
    re.compile(r"\bbenchmark VM\b"),
    re.compile(r"\bmeasured \d"),
    re.compile(r"\bas it did before\b"),
    re.compile(r"\bdiffers? from before\b"),
    re.compile(r"\bused to\b"),
    re.compile(r"\bno longer\b"),
)


@dataclass(frozen=True)
class SpecBullet:
    """One bullet of a spec file that starts with a bold ID."""

    file: str
    line: int
    id: str
    level: str | None
    text: str

    @property
    def words(self) -> int:
        """Words of the text, ``(checked: ...)`` markers (HARN-30) left out."""
        return len(CHECKED.sub("", self.text).split())


@dataclass(frozen=True)
class Stale:
    """A citation of a requirement ID that ``spec/`` does not hold."""

    file: str
    line: int
    id: str


def spec_bullets(spec_dir: Path) -> Iterator[SpecBullet]:
    """Every ID bullet of every ``*.md`` of ``spec_dir``, continuation lines joined."""
    for path in sorted(spec_dir.glob("*.md")):
        lines = path.read_text(encoding="utf-8").splitlines()
        i = 0
        while i < len(lines):
            m = _BULLET.match(lines[i])
            if not m:
                i += 1
                continue
            start, body = i + 1, m.group(2)
            i += 1
            while i < len(lines) and lines[i].startswith("  ") and lines[i].strip():
                body += " " + lines[i].strip()
                i += 1
            lm = _LEVEL.match(body)
            level, text = (lm.group(1), lm.group(2)) if lm else (None, body)
            yield SpecBullet(path.name, start, m.group(1), level, text.strip())


def spec_problems(spec_dir: Path, max_words: int = MAX_WORDS) -> list[str]:
    """Everything wrong with the form of ``spec_dir``'s requirements, one line each."""
    problems: list[str] = []
    numbers: dict[str, set[int]] = {}
    for b in spec_bullets(spec_dir):
        where = f"{b.file}:{b.line} {b.id}"
        idm = _ID.match(b.id)
        if idm is None:
            problems.append(f"{where}: not an ID of the form AREA-N")
            continue
        numbers.setdefault(idm.group(1), set()).add(int(idm.group(2)))
        if b.level is None:
            problems.append(f"{where}: no keyword (MUST, MUST NOT, SHOULD, SHOULD NOT, WITHDRAWN)")
            continue
        if b.level == "WITHDRAWN":
            if not b.text:
                problems.append(f"{where}: WITHDRAWN without a reason")
            continue
        if b.words > max_words:
            problems.append(f"{where}: {b.words} words (at most {max_words}); split it")
        for pat in HISTORY:
            hit = pat.search(b.text)
            if hit:
                problems.append(f"{where}: narrates history or figures ({hit.group(0)!r})")
    for area, nums in sorted(numbers.items()):
        missing = [n for n in range(1, max(nums) + 1) if n not in nums]
        if missing:
            ids = ", ".join(f"{area}-{n}" for n in missing)
            problems.append(f"area {area}: gap without a WITHDRAWN bullet: {ids}")
    return problems


def _files(root: Path, scanned: Iterable[str]) -> Iterator[Path]:
    for name in scanned:
        base = root / name
        if base.is_file():
            yield base
        elif base.is_dir():
            for path in sorted(base.rglob("*")):
                parts = set(path.relative_to(root).parts)
                if path.suffix in _SUFFIXES and path.is_file() and "__pycache__" not in parts:
                    yield path


def stale_citations(root: Path, scanned: Iterable[str] = SCANNED) -> list[Stale]:
    """Every ID of a known area cited under ``root`` that ``root/spec`` does not hold."""
    known = {b.id for b in spec_bullets(root / "spec") if b.level is not None}
    areas = sorted({i.rpartition("-")[0] for i in known if _ID.match(i)}, key=len, reverse=True)
    if not areas:
        return []
    cite = re.compile(r"(?<![A-Za-z0-9_-])(" + "|".join(map(re.escape, areas)) + r")-(\d+)\b")
    out: list[Stale] = []
    for path in _files(root, scanned):
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        rel = str(path.relative_to(root))
        for lineno, line in enumerate(text.splitlines(), 1):
            for m in cite.finditer(line):
                if m.group(0) not in known:
                    out.append(Stale(rel, lineno, m.group(0)))
    return out


_SENTENCE = re.compile(r"(?<!e\.g\.)(?<!i\.e\.)(?<=[.;])\s+(?=[A-Z(])")
# A code span, unless it names a component of torch ("torch's `FileSystemWriter`").
_QUOTED = re.compile(r"(?<!torch's )`[^`]*`")
_TEST_REF = re.compile(r"\btests/[\w/]+\.py(?:::\w+)?")


def _functions(path: Path) -> dict[str, str]:
    """Every function of ``path`` (any depth), by name: its source text, decorators included."""
    st = path.stat()
    return _parsed(str(path), st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=256)
def _parsed(path: str, mtime_ns: int, size: int) -> dict[str, str]:
    """:func:`_functions` of one version of a file (its time and size in the key)."""
    text = Path(path).read_text(encoding="utf-8")
    lines = text.splitlines()
    out: dict[str, str] = {}
    stack: list[ast.stmt] = list(ast.parse(text).body)  # statements only: no expression walk
    while stack:
        node = stack.pop()
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            out.setdefault(node.name, "\n".join(lines[first - 1 : node.end_lineno]))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            stack.extend(node.body)
    return out


def _cited_ids(path: Path) -> set[str]:
    """The IDs ``path`` cites with ``@pytest.mark.spec(...)``."""
    text = path.read_text(encoding="utf-8")
    ids: set[str] = set()
    for m in re.finditer(r"mark\.spec\(([^)]*)\)", text):
        ids.update(re.findall(r"[\"']([A-Z][A-Z0-9]*-\d+)[\"']", m.group(1)))
    return ids


def _missing_tests(root: Path, refs: Iterable[str]) -> list[str]:
    """The references ``tests/x.py`` or ``tests/x.py::test_y`` that name nothing."""
    out = []
    for ref in refs:
        file, _, name = ref.partition("::")
        path = root / file
        if not path.is_file():
            out.append(f"{ref}: no such file")
        elif name and name not in _functions(path):
            out.append(f"{ref}: no such test in {file}")
    return out


def guarantee_problems(root: Path, doc: str = "docs/guarantees.md") -> list[str]:
    """Every guarantee of ``doc`` that names no ID or test, or a test that does not exist.

    A section (a ``##``/``###`` heading and the text up to the next heading) that
    holds text is a guarantee: it cites at least one spec ID and names at least
    one test (``tests/x.py`` or ``tests/x.py::test_y``), each of which exists,
    and one of its named test files cites one of its IDs (HARN-28). Every
    top-level bullet of it cites an ID.
    """
    known = {b.id for b in spec_bullets(root / "spec") if b.level is not None}
    areas = sorted({i.rpartition("-")[0] for i in known}, key=len, reverse=True)
    cite = re.compile(r"(?<![A-Za-z0-9_-])(?:" + "|".join(map(re.escape, areas)) + r")-\d+\b")
    problems: list[str] = []
    sections: list[tuple[int, str, list[str]]] = []
    for lineno, line in enumerate((root / doc).read_text(encoding="utf-8").splitlines(), 1):
        if line.startswith("##"):
            sections.append((lineno, line.lstrip("#").strip(), []))
        elif line.startswith("# "):
            sections.append((lineno, "", []))  # the page's title: its text is the introduction
        elif sections:
            sections[-1][2].append(line)
    for lineno, title, lines in sections:
        if not title:
            continue
        body = "\n".join(lines)
        if not body.strip():
            continue
        where = f"{doc}:{lineno} {title!r}"
        ids = set(cite.findall(body))
        refs = sorted(set(_TEST_REF.findall(body)))
        if not ids:
            problems.append(f"{where}: names no spec ID")
        if not refs:
            problems.append(f"{where}: names no test (tests/...py)")
        problems += [f"{where}: {m}" for m in _missing_tests(root, refs)]
        files = {r.partition("::")[0] for r in refs if (root / r.partition("::")[0]).is_file()}
        if ids and files and not any(ids & _cited_ids(root / f) for f in files):
            problems.append(f"{where}: no named test file cites any of {sorted(ids)}")
        problems += [f"{where}: {p}" for p in _bullets_without_ids(lines, cite)]
    return problems


#: A bullet that states a limit, not a promise, needs no ID of its own (HARN-28).
LIMIT = ("Not covered", "**can**")


def _bullets_without_ids(lines: list[str], cite: re.Pattern[str]) -> list[str]:
    """The top-level bullets of ``lines`` that cite no ID, neither themselves nor
    through the paragraph, ending in ``:``, that introduces their list."""
    blocks: list[list[str]] = []  # a paragraph or a bullet with its continuation lines
    for line in lines:
        if not line.strip():
            blocks.append([])
        elif line.startswith("* ") or not blocks or not blocks[-1]:
            blocks.append([line])
        else:
            blocks[-1].append(line.strip())
    out, intro = [], ""
    for block in filter(None, blocks):
        text = " ".join(block)
        if not text.startswith("* "):
            intro = text
            continue
        covered = intro.rstrip().endswith(":") and cite.search(intro)
        if not (cite.search(text) or covered or text[2:].startswith(LIMIT)):
            out.append(f"a guarantee cites no spec ID: {text[:60]!r}")
    return out


def _conf_ids(text: str) -> set[str]:
    return set(re.findall(r"\bCONF-\d+\b", text))


def _failed(report: dict[str, object]) -> set[str]:
    results = report.get("results", [])
    assert isinstance(results, list)
    return {r["id"] for r in results if r.get("status") not in ("pass", "n/a")}


def _resets(report: dict[str, object]) -> bool:
    results = report.get("results", [])
    assert isinstance(results, list)
    status = {r["id"]: r.get("status") for r in results}
    return all(status.get(i) == "pass" for i in ("CONF-1", "CONF-27"))


def matrix_problems(root: Path, doc: str = "README.md") -> list[str]:
    """Every row of ``doc``'s conformance tables that disagrees with its report (HARN-29).

    A table whose header has a cell saying "conforms" summarises conformance
    reports: each row links one or more ``*.md`` reports with a ``.json``
    beside them, the first being the row's backend and the others variants of
    its configuration. The "conforms" cell starts with "yes" exactly when the
    first report has no failed MUST (``ok``) and lists exactly its failed
    requirements (any level); a "reset" cell starts with "yes" when every
    linked report passes CONF-1 and CONF-27, "only" when the first does and a
    variant does not (listing exactly the variants' failed requirements), and
    "no" when the first does not.
    """
    problems: list[str] = []
    header: list[str] | None = None
    base = (root / doc).parent
    for lineno, line in enumerate((root / doc).read_text(encoding="utf-8").splitlines(), 1):
        if not line.startswith("|"):
            header = None
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if header is None:
            header = [c.lower() for c in cells]
            continue
        if set(line) <= set("|-: ") or not any("conforms" in h for h in header):
            continue
        where = f"{doc}:{lineno}"
        links = re.findall(r"\]\(([^)]+\.md)\)", cells[0])
        if not links:
            problems.append(f"{where}: the row links no report")
            continue
        reports = []
        for link in links:
            path = (base / link).with_suffix(".json")
            if not path.is_file():
                problems.append(f"{where}: no report {path.relative_to(root)}")
                break
            reports.append(json.loads(path.read_text(encoding="utf-8")))
        else:
            for h, cell in zip(header, cells, strict=False):
                if "conforms" in h:
                    problems += _conforms_cell(where, cell, reports[0])
                elif "reset" in h:
                    problems += _reset_cell(where, cell, reports)
    return problems


def _conforms_cell(where: str, cell: str, report: dict[str, object]) -> list[str]:
    out = []
    word = "yes" if report.get("ok") else "no"
    if not cell.lower().startswith(word):
        out.append(f"{where}: says {cell.split(';')[0]!r}, its report says {word!r}")
    failed, listed = _failed(report), _conf_ids(cell)
    if failed != listed:
        out.append(f"{where}: lists failed {sorted(listed)}, its report failed {sorted(failed)}")
    return out


def _reset_cell(where: str, cell: str, reports: list[dict[str, object]]) -> list[str]:
    main_ok = _resets(reports[0])
    variants_failed = set().union(*(_failed(r) for r in reports[1:]))
    word = "no" if not main_ok else "yes" if all(map(_resets, reports)) else "only"
    out = []
    if not cell.lower().startswith(word):
        out.append(f"{where}: says {cell[:20]!r} after reset, the reports say {word!r}")
    if word == "only" and _conf_ids(cell) != variants_failed:
        out.append(
            f"{where}: lists {sorted(_conf_ids(cell))} for reset, "
            f"the variants failed {sorted(variants_failed)}"
        )
    return out


#: Claims about torch not yet tied to a torch run, one ``ID: sentence start`` a line
#: (HARN-30): the list may only shrink; a claim in it that gains a marker or is
#: gone from ``spec/`` is a problem too, so the list stays exact.
UNCHECKED = "tests/torch_claims_unchecked.txt"


def _claim_key(bullet_id: str, sentence: str) -> str:
    return f"{bullet_id}: {' '.join(sentence.split())[:60]}"


def torch_claim_problems(root: Path) -> list[str]:
    """Every claim about torch in ``spec/`` without a marker naming a test that runs torch.

    A claim is a sentence of a requirement matching :data:`TORCH_CLAIM`; its
    ``(checked: tests/x.py::test_y, ...)`` marker (in the sentence) names tests
    that exist and whose source, or that of a module-level helper they call,
    matches :data:`RUNS_TORCH` (HARN-30).
    """
    problems: list[str] = []
    listed = root / UNCHECKED
    unchecked = set(listed.read_text(encoding="utf-8").splitlines()) if listed.is_file() else set()
    unchecked.discard("")
    seen: set[str] = set()
    for b in spec_bullets(root / "spec"):
        if b.level in (None, "WITHDRAWN"):
            continue
        for sentence in _SENTENCE.split(b.text):
            plain = _QUOTED.sub("``", sentence)  # code quoted, not a claim or marker
            bare = CHECKED.sub("", plain)
            if not TORCH_CLAIM.search(bare):
                continue
            where = f"spec/{b.file}:{b.line} {b.id}: {bare.strip()[:70]!r}"
            marks = CHECKED.findall(plain)
            key = _claim_key(b.id, bare)
            if key in unchecked:
                seen.add(key)
                if marks:
                    problems.append(f"{where}: has a marker: remove it from {UNCHECKED}")
                continue
            if not marks:
                problems.append(f"{where}: a claim about torch without (checked: tests/...)")
                continue
            refs = [r.strip() for m in marks for r in m.split(",") if r.strip()]
            for ref in refs:
                file, _, name = ref.partition("::")
                if not name or not _TEST_REF.fullmatch(ref):
                    problems.append(f"{where}: {ref!r} is not tests/x.py::test_y")
                    continue
                missing = _missing_tests(root, [ref])
                if missing:
                    problems += [f"{where}: {m}" for m in missing]
                elif not _runs_torch(root / file, name):
                    problems.append(f"{where}: {ref} does not run torch's DCP")
    problems += [f"{UNCHECKED}: {k!r} is no claim of spec/ any more" for k in unchecked - seen]
    return problems


def _runs_torch(path: Path, name: str) -> bool:
    """Whether test ``name`` of ``path``, or a function of its module it names (a helper it
    calls, a fixture it takes), runs torch."""
    functions = _functions(path)
    body = functions[name]
    if RUNS_TORCH.search(body):
        return True
    named = set(re.findall(r"\b(\w+)\b", body)) - {name}
    return any(RUNS_TORCH.search(functions[c]) for c in named if c in functions)


def main(argv: list[str] | None = None) -> int:
    from refdcp.tools.spec_report import repo_root

    root = repo_root()
    problems = spec_problems(root / "spec")
    problems += [
        f"{s.file}:{s.line}: cites {s.id}, which spec/ does not hold" for s in stale_citations(root)
    ]
    problems += guarantee_problems(root) + matrix_problems(root) + torch_claim_problems(root)
    for p in problems:
        print(p)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
