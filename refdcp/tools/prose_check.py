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

``python -m refdcp.tools.prose_check`` prints the problems of this checkout
and exits 1 when there is any.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "MAX_WORDS",
    "SCANNED",
    "SpecBullet",
    "Stale",
    "main",
    "spec_bullets",
    "spec_problems",
    "stale_citations",
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
        return len(self.text.split())


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


def main(argv: list[str] | None = None) -> int:
    from refdcp.tools.spec_report import repo_root

    root = repo_root()
    problems = spec_problems(root / "spec")
    problems += [
        f"{s.file}:{s.line}: cites {s.id}, which spec/ does not hold" for s in stale_citations(root)
    ]
    for p in problems:
        print(p)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
