"""Requirement traceability: spec IDs ↔ tests that cite them (spec/README.md).

The spec is parsed from ``spec/*.md`` (bullets ``- **ID** MUST ...``); tests are
found statically by parsing every ``.py`` file under ``tests/`` and
``conformance/`` for calls ``*.spec("ID", ...)`` / ``spec("ID", ...)`` with
literal string arguments. No test is imported or run, so the report is fast
and independent of the test environment.

``python -m refdcp.tools.spec_report`` prints requirement → tests and, from the
last ``make mutation`` report (``mutation/last-run.json``) when there is one,
how many mutants of each requirement's code were killed or survived and whether
the requirement is *covered*: a test citing it killed a mutant of its code
(HARN-12, HARN-13).
"""

from __future__ import annotations

import ast
import json
import re
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "Requirement",
    "Citation",
    "MutationCoverage",
    "load_spec",
    "find_citations",
    "load_mutation_report",
    "mutation_coverage",
    "report",
    "main",
]

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


@dataclass
class MutationCoverage:
    """Mutants of one requirement's code in the last mutation run (HARN-12)."""

    killed: int = 0
    survived: int = 0
    #: a test citing the requirement killed one of them (HARN-13)
    covered: bool = False


def load_mutation_report(root: Path) -> dict[str, Any] | None:
    """The last ``make mutation`` report, or None when there is none (or it is unreadable)."""
    path = root / "mutation" / "last-run.json"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and isinstance(data.get("mutants"), list) else None


def mutation_coverage(run: dict[str, Any]) -> dict[str, MutationCoverage]:
    """Per requirement ID: mutants of its code killed / survived, and whether covered."""
    out: dict[str, MutationCoverage] = {}
    for m in run.get("mutants", []):
        status = m.get("status")
        if status not in ("killed", "timeout", "survived"):
            continue  # equivalent or unjudged mutants say nothing about the tests
        killer_ids = set(m.get("killed_by_ids", []))
        for rid in m.get("ids", []):
            cov = out.setdefault(rid, MutationCoverage())
            if status == "survived":
                cov.survived += 1
            else:
                cov.killed += 1
                if rid in killer_ids:
                    cov.covered = True
    return out


def _coverage_note(rid: str, level: str, cov: dict[str, MutationCoverage] | None) -> str:
    if level == "WITHDRAWN":
        return ""
    c = None if cov is None else cov.get(rid)
    if c is None:
        return "; mutants: not measured"
    verdict = "covered" if c.covered else "NOT covered (no citing test killed a mutant)"
    return f"; mutants: {c.killed} killed, {c.survived} survived; {verdict}"


def report(t: Trace, run: dict[str, Any] | None = None) -> str:
    cov = None if run is None else mutation_coverage(run)
    lines = []
    for rid in sorted(t.requirements, key=_sort_key):
        req = t.requirements[rid]
        tests = sorted({f"{c.file}::{c.test}" for c in t.tests_for(rid)})
        mark = "ok " if tests or req.level == "WITHDRAWN" else "!! "
        lines.append(
            f"{mark}{rid:<12} {req.level:<10} ({req.file}) {len(tests)} test(s)"
            + _coverage_note(rid, req.level, cov)
        )
        lines.extend(f"      {name}" for name in tests)
    lines.append("")
    lines.append(
        f"{len(t.requirements)} requirements, {len(t.untested)} without a test, "
        f"{len(t.unknown)} citation(s) of unknown IDs"
    )
    live = [r for r, q in t.requirements.items() if q.level != "WITHDRAWN"]
    if cov is None:
        lines.append(
            "mutation coverage: not measured (no mutation/last-run.json; run make mutation)"
        )
    else:
        meta = run.get("meta", {}) if run else {}
        covered = sum(1 for r in live if r in cov and cov[r].covered)
        measured = sum(1 for r in live if r in cov)
        lines.append(
            f"mutation coverage (run of {meta.get('date', '?')} at {meta.get('commit', '?')}): "
            f"{covered} requirement(s) covered, {measured - covered} measured but not covered, "
            f"{len(live) - measured} not measured"
        )
    lines.extend(f"  untested: {rid}" for rid in t.untested)
    lines.extend(f"  unknown: {c.id} in {c.file}:{c.line}" for c in t.unknown)
    return "\n".join(lines)


def _sort_key(rid: str) -> tuple[str, int]:
    area, _, num = rid.rpartition("-")
    return (area, int(num))


def main(argv: list[str] | None = None) -> int:
    t = trace()
    print(report(t, load_mutation_report(repo_root())))
    return 1 if (t.untested or t.unknown or t.duplicate_ids) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
