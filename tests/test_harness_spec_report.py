"""Traceability that counts mutants (HARN-12, HARN-13)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from refdcp.tools import spec_report
from refdcp.tools.spec_report import Citation, Requirement, Trace


def _trace() -> Trace:
    reqs = {
        rid: Requirement(rid, "MUST", "text", "x.md", i)
        for i, rid in enumerate(["DEDUP-1", "DEDUP-2", "DEDUP-3", "FMT-1"], 1)
    }
    reqs["FMT-2"] = Requirement("FMT-2", "WITHDRAWN", "", "x.md", 9)
    cites = [
        Citation(r, f"test_{r}", "tests/t.py", 1)
        for r in ["DEDUP-1", "DEDUP-2", "DEDUP-3", "FMT-1"]
    ]
    return Trace(reqs, cites, [])


RUN: dict[str, Any] = {
    "meta": {"date": "2026-11-24 09:00 UTC", "commit": "abc1234"},
    "mutants": [
        # killed by a test citing DEDUP-2: DEDUP-2 covered; DEDUP-1 is not cited by the killer
        {"ids": ["DEDUP-1", "DEDUP-2"], "status": "killed", "killed_by_ids": ["DEDUP-2"]},
        {"ids": ["DEDUP-1"], "status": "survived", "killed_by_ids": []},
        # DEDUP-3's only mutant was killed by an unrelated test: measured, not covered
        {"ids": ["DEDUP-3"], "status": "timeout", "killed_by_ids": []},
        {"ids": ["DEDUP-3"], "status": "equivalent", "killed_by_ids": []},
        {"ids": ["DEDUP-3"], "status": "error", "killed_by_ids": []},
    ],
}


@pytest.mark.spec("HARN-12", "HARN-13")
def test_coverage_counts_kills_by_citing_tests_only() -> None:
    cov = spec_report.mutation_coverage(RUN)
    assert (cov["DEDUP-2"].killed, cov["DEDUP-2"].survived, cov["DEDUP-2"].covered) == (1, 0, True)
    assert (cov["DEDUP-1"].killed, cov["DEDUP-1"].survived, cov["DEDUP-1"].covered) == (1, 1, False)
    assert (cov["DEDUP-3"].killed, cov["DEDUP-3"].survived, cov["DEDUP-3"].covered) == (1, 0, False)
    assert "FMT-1" not in cov


@pytest.mark.spec("HARN-12", "HARN-13")
def test_report_lines_say_covered_not_covered_or_not_measured() -> None:
    text = spec_report.report(_trace(), RUN)
    line = {ln.split()[1]: ln for ln in text.splitlines() if ln.startswith(("ok ", "!! "))}
    assert line["DEDUP-2"].endswith("mutants: 1 killed, 0 survived; covered")
    assert "1 killed, 1 survived; NOT covered" in line["DEDUP-1"]
    assert line["FMT-1"].endswith("mutants: not measured")
    assert "mutants" not in line["FMT-2"]
    assert "1 requirement(s) covered, 2 measured but not covered, 1 not measured" in text
    bare = spec_report.report(_trace(), None)
    assert "covered" not in bare.replace("not measured", "")
    assert "mutation coverage: not measured" in bare


@pytest.mark.spec("HARN-13")
def test_missing_or_broken_report_reads_as_not_measured(tmp_path: Path) -> None:
    assert spec_report.load_mutation_report(tmp_path) is None
    (tmp_path / "mutation").mkdir()
    (tmp_path / "mutation" / "last-run.json").write_text("{not json", encoding="utf-8")
    assert spec_report.load_mutation_report(tmp_path) is None
    (tmp_path / "mutation" / "last-run.json").write_text(json.dumps(RUN), encoding="utf-8")
    assert spec_report.load_mutation_report(tmp_path) == RUN
