"""Requirement traceability: spec IDs ↔ tests that cite them (spec/README.md).

The spec is parsed from ``spec/*.md`` (bullets ``- **ID** MUST ...``); tests are
found statically by parsing every ``.py`` file under ``tests/`` and
``conformance/`` for calls ``*.spec("ID", ...)`` / ``spec("ID", ...)`` with
literal string arguments. No test is imported or run, so the report is fast
and independent of the test environment.

``python -m refdcp.tools.spec_report`` prints requirement → tests.
"""

from __future__ import annotations

import ast
import re
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["Requirement", "Citation", "load_spec", "find_citations", "report", "main"]

_REQ = re.compile(
    r"^- \*\*([A-Z][A-Z0-9]*-\d+)\*\*\s+(MUST NOT|MUST|SHOULD NOT|SHOULD|WITHDRAWN)\b(.*)$"
)
_ID = re.compile(r"^[A-Z][A-Z0-9]*-\d+$")


@dataclass(frozen=True)
class Requirement:
    id: str
    level: str
    text: str
    file: str
    line: int


@dataclass(frozen=True)
class Citation:
    id: str
    test: str
    file: str
    line: int


@dataclass
class Trace:
    requirements: dict[str, Requirement] = field(default_factory=dict)
    citations: list[Citation] = field(default_factory=list)
    duplicate_ids: list[str] = field(default_factory=list)

    def tests_for(self, req_id: str) -> list[Citation]:
        return [c for c in self.citations if c.id == req_id]

    @property
    def untested(self) -> list[str]:
        cited = {c.id for c in self.citations}
        return [
            r for r, req in self.requirements.items() if r not in cited and req.level != "WITHDRAWN"
        ]

    @property
    def unknown(self) -> list[Citation]:
        return [c for c in self.citations if c.id not in self.requirements]


def repo_root() -> Path:
    return Path(__file__).resolve().parents[2]


def load_spec(spec_dir: Path) -> tuple[dict[str, Requirement], list[str]]:
    reqs: dict[str, Requirement] = {}
    dups: list[str] = []
    for path in sorted(spec_dir.glob("*.md")):
        for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            m = _REQ.match(line)
            if not m:
                continue
            rid, level, text = m.group(1), m.group(2), m.group(3).lstrip(" :")
            if rid in reqs:
                dups.append(rid)
            reqs[rid] = Requirement(rid, level, text, path.name, lineno)
    return reqs, dups


def _spec_args(call: ast.Call) -> list[str] | None:
    func = call.func
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
    if name != "spec":
        return None
    out = []
    for arg in call.args:
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
            out.append(arg.value)
    return out


def _enclosing_names(tree: ast.AST) -> dict[int, str]:
    """Map line numbers of decorator calls to the name of what they decorate."""
    names: dict[int, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            for dec in node.decorator_list:
                for sub in ast.walk(dec):
                    names[getattr(sub, "lineno", -1)] = node.name
    return names


def find_citations(paths: Iterable[Path], root: Path) -> list[Citation]:
    cites: list[Citation] = []
    for base in paths:
        files = [base] if base.is_file() else sorted(base.rglob("*.py"))
        for path in files:
            try:
                tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
            except SyntaxError:
                continue
            names = _enclosing_names(tree)
            rel = str(path.relative_to(root)) if path.is_relative_to(root) else str(path)
            for node in ast.walk(tree):
                if isinstance(node, ast.Call):
                    ids = _spec_args(node)
                    if not ids:
                        continue
                    test = names.get(node.lineno, "<module>")
                    for rid in ids:
                        cites.append(Citation(rid, test, rel, node.lineno))
    return cites


def trace(root: Path | None = None) -> Trace:
    root = root or repo_root()
    reqs, dups = load_spec(root / "spec")
    cites = find_citations([root / "tests", root / "conformance"], root)
    return Trace(reqs, cites, dups)


def report(t: Trace) -> str:
    lines = []
    for rid in sorted(t.requirements, key=_sort_key):
        req = t.requirements[rid]
        tests = sorted({f"{c.file}::{c.test}" for c in t.tests_for(rid)})
        mark = "ok " if tests or req.level == "WITHDRAWN" else "!! "
        lines.append(f"{mark}{rid:<12} {req.level:<10} ({req.file}) {len(tests)} test(s)")
        lines.extend(f"      {name}" for name in tests)
    lines.append("")
    lines.append(
        f"{len(t.requirements)} requirements, {len(t.untested)} without a test, "
        f"{len(t.unknown)} citation(s) of unknown IDs"
    )
    lines.extend(f"  untested: {rid}" for rid in t.untested)
    lines.extend(f"  unknown: {c.id} in {c.file}:{c.line}" for c in t.unknown)
    return "\n".join(lines)


def _sort_key(rid: str) -> tuple[str, int]:
    area, _, num = rid.rpartition("-")
    return (area, int(num))


def main(argv: list[str] | None = None) -> int:
    t = trace()
    print(report(t))
    return 1 if (t.untested or t.unknown or t.duplicate_ids) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
