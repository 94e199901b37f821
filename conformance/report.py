"""Reports: a markdown table and a JSON document of check results (CONF-41)."""

from __future__ import annotations

import json
import platform
from collections.abc import Sequence
from typing import Any

import torch

from conformance.registry import Result, plain
from conformance.runner import failed_musts

__all__ = ["to_json", "to_markdown"]


def to_json(backend_name: str, results: Sequence[Result]) -> dict[str, Any]:
    """A JSON-ready report: environment, one entry per check, and a summary."""
    counts = {s: sum(r.status == s for r in results) for s in ("pass", "fail", "n/a")}
    return {
        "backend": backend_name,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "ok": not failed_musts(results),
        "summary": counts,
        "results": [
            {
                "id": r.id,
                "level": r.level,
                "title": r.title,
                "status": r.status,
                "reason": plain(r.reason),
                "seconds": round(r.seconds, 3),
            }
            for r in results
        ],
    }


def dumps(backend_name: str, results: Sequence[Result]) -> str:
    return json.dumps(to_json(backend_name, results), indent=2, ensure_ascii=False) + "\n"


def _cell(text: str) -> str:
    return plain(text).replace("|", "\\|").replace("\n", " ")[:300]


def to_markdown(backend_name: str, results: Sequence[Result]) -> str:
    """A markdown table: requirement, level, status, seconds the check took, title, reason."""
    doc = to_json(backend_name, results)
    lines = [
        f"## Conformance: {backend_name}",
        "",
        f"torch {doc['torch']}; {doc['summary']['pass']} pass, {doc['summary']['fail']} fail, "
        f"{doc['summary']['n/a']} not applicable; "
        + ("**conforms** (no failed MUST)" if doc["ok"] else "**does not conform**"),
        "",
        "| requirement | level | status | seconds | check | reason |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        status = {"pass": "pass", "fail": "**FAIL**", "n/a": "n/a"}[r.status]
        if r.status == "fail" and not r.level.startswith("MUST"):
            status = "fail (warning)"
        lines.append(
            f"| {r.id} | {r.level} | {status} | {r.seconds:.2f} | {_cell(r.title)} "
            f"| {_cell(r.reason)} |"
        )
    return "\n".join(lines) + "\n"
