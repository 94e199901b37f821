"""The mutation runner's speed-ups keep every verdict (HARN-25) and the reference path's mutants
are judged by two suites apart (HARN-26)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import tomllib
from hypothesis import given
from hypothesis import strategies as st

from mutation import run
from mutation.operators import Mutant

ROOT = Path(__file__).resolve().parents[1]

_IDS = ["DEDUP-1", "DEDUP-2", "META-3"]


def _mut(scope: str = "f", file: str = "refdcp/planning/x.py") -> Mutant:
    return Mutant(file, 3, 0, 3, "cmp0", "`<` -> `<=`", 7, scope)


@pytest.mark.spec("HARN-25")
@given(
    st.lists(st.sampled_from(_IDS), min_size=1, max_size=3, unique=True).flatmap(
        lambda own: st.tuples(
            st.just(set(own)),
            st.dictionaries(
                st.text("abcdefgh", min_size=1, max_size=3),
                st.sets(st.sampled_from(_IDS), max_size=2),
                min_size=1,
                max_size=12,
            ),
        )
    ),
    st.lists(st.tuples(st.booleans(), st.integers(0, 30)), max_size=12),
)
def test_killer_first_only_reorders_and_keeps_own_id_tests_first(
    case: tuple[set[str], dict[str, set[str]]], kills: list[tuple[bool, int]]
) -> None:
    own, cited = case
    tests = {t: run.TestInfo(t, ids) for t, ids in cited.items()}
    pool = sorted(tests)
    killers = run.Killers()
    names = [*tests, "elsewhere"]
    for same_scope, k in kills:
        killers.record(_mut("f" if same_scope else "g"), names[k % len(names)])
    out = killers.order(_mut(), pool, own, tests)
    assert sorted(out) == pool  # the same tests: the verdict cannot change
    firsts = [bool(tests[t].ids & own) for t in out]
    assert firsts == sorted(firsts, reverse=True)  # own-ID tests still run first
    recent = killers.recent.get("refdcp/planning/x.py::f", [])
    group = [t for t in out if bool(tests[t].ids & own) == firsts[0]]
    lead = [t for t in recent if t in group]
    assert group[: len(lead)] == lead[: len(group)]  # the latest killer of the function leads


@pytest.mark.spec("HARN-25")
def test_killers_are_kept_per_function_and_per_module_most_recent_first() -> None:
    k = run.Killers()
    for t in ["a", "b", "c", "d", "b"]:
        k.record(_mut(), t)
    k.record(_mut("g"), "e")
    assert k.recent["refdcp/planning/x.py::f"] == ["b", "d", "c"]
    assert k.recent["refdcp/planning/x.py"] == ["e", "b", "d"]
    tests = {t: run.TestInfo(t, {"DEDUP-1"}) for t in "abcdez"}
    assert k.order(_mut(), ["z", "a", "c", "e"], {"DEDUP-1"}, tests) == ["c", "e", "z", "a"]


@pytest.mark.spec("HARN-25")
def test_a_mutant_job_refuses_an_order_that_adds_or_drops_a_test() -> None:
    job = run.mutant_job(_mut(), ["t::a", "t::b"], lambda ts: ts[:1])
    with pytest.raises(AssertionError):
        job()


@pytest.mark.spec("HARN-25")
def test_import_time_uses_parses_each_module_once() -> None:
    cfg = tomllib.loads((ROOT / "mutation" / "config.toml").read_text(encoding="utf-8"))
    targets = list(cfg["modules"])
    m = Mutant("refdcp/protocol/machine.py", 1, 0, 1, "op", "", 0, "Table.__init__")
    first = run.import_time_uses(m, ROOT, targets)
    assert first and run.import_time_uses(m, ROOT, targets) == first
    assert run._parsed(ROOT / targets[0]) is run._parsed(ROOT / targets[0])


@pytest.mark.spec("HARN-1", "HARN-26")
def test_every_reference_module_is_configured_as_package_reference_with_two_suites() -> None:
    cfg = tomllib.loads((ROOT / "mutation" / "config.toml").read_text(encoding="utf-8"))
    ref = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "refdcp" / "reference").glob("*.py"))
    assert ref and set(ref) <= set(cfg["modules"])
    assert {run.package_of(r) for r in ref} == {"reference"}
    suites = run.load_suites()
    assert all(suites.covers(r) for r in ref)
    assert not suites.covers("refdcp/planning/flatten.py")
    for f in suites.run_files + suites.differential_files:
        assert (ROOT / f).is_file(), f
    assert not set(suites.run_files) & set(suites.differential_files)


@pytest.mark.spec("HARN-26")
def test_the_pool_splits_into_the_reference_run_and_the_differential_suite() -> None:
    s = run.Suites(
        "refdcp/reference/",
        ("tests/test_both_paths.py",),
        ("tests/test_reference_differential.py",),
        frozenset({"DEDUP-9"}),
    )
    tests = {
        "tests/test_both_paths.py::a": run.TestInfo("", {"REF-6"}),
        "tests/test_reference_differential.py::b": run.TestInfo("", {"REF-3"}),
        "tests/test_dedup_blocks.py::c": run.TestInfo("", {"DEDUP-9", "DEDUP-12"}),
        "tests/test_api.py::d": run.TestInfo("", {"API-2"}),
    }
    assert [t for t, i in tests.items() if s.member(t, i)] == list(tests)[:3]
    assert s.split(list(tests), tests) == {
        "reference": ["tests/test_both_paths.py::a", "tests/test_api.py::d"],
        "differential": [
            "tests/test_reference_differential.py::b",
            "tests/test_dedup_blocks.py::c",
        ],
    }


@pytest.mark.spec("HARN-26")
@pytest.mark.parametrize(
    ("verdicts", "overall"),
    [
        ({"reference": "killed", "differential": "survived"}, "killed"),
        ({"reference": "survived", "differential": "timeout"}, "timeout"),
        ({"reference": "no test", "differential": "killed"}, "killed"),
        ({"reference": "survived", "differential": "no test"}, "survived"),
        ({"reference": "error", "differential": "survived"}, "error"),
        ({"reference": "error", "differential": "killed"}, "killed"),
    ],
)
def test_a_reference_mutant_is_killed_when_either_suite_kills_it(
    verdicts: dict[str, str], overall: str
) -> None:
    assert run.combine_suites(verdicts) == overall


@pytest.mark.spec("HARN-26")
def test_the_report_counts_what_each_suite_kills(tmp_path: Path) -> None:
    def rec(status: str, suites: dict[str, str], n: int) -> run.Record:
        f = "refdcp/reference/dedup.py"
        return run.Record(f"{f}:{n}:0:x", f, n, "x", "change", "f", [], 2, status, suites=suites)

    recs = [
        rec("killed", {"reference": "killed", "differential": "killed"}, 1),
        rec("killed", {"reference": "survived", "differential": "killed"}, 2),
        rec("timeout", {"reference": "timeout", "differential": "no test"}, 3),
        rec("survived", {"reference": "survived", "differential": "survived"}, 4),
        rec("equivalent", {}, 5),
    ]
    assert run.suite_counts(recs) == {
        "mutants": 4,
        "reference": 2,
        "differential": 2,
        "both": 1,
        "neither": 1,
    }
    out = tmp_path / "r.json"
    run.write_reports(recs, out, 0, 1, 5, 1.0, [])
    md = out.with_suffix(".md").read_text(encoding="utf-8")
    assert "the tests that run the reference kill 2, the differential tests kill 2" in md
    assert "`refdcp/reference/dedup.py:2` (f) change: differential killed, reference survived" in md
    data: dict[str, Any] = json.loads(out.read_text(encoding="utf-8"))
    assert data["reference_suites"]["neither"] == 1
    assert data["mutants"][1]["suites"] == {"reference": "survived", "differential": "killed"}
    assert run.scores(recs)["reference"] == {
        "killed": 3,
        "survived": 1,
        "equivalent": 1,
        "error": 0,
    }


@pytest.mark.spec("HARN-25")
def test_a_mutant_child_does_not_shrink_hypothesis_examples_and_the_parent_is_untouched() -> None:
    from hypothesis import Phase, settings

    def child() -> dict[str, Any]:
        run._no_shrinking()
        assert settings.default is not None
        return {"status": "ok", "phases": [p.name for p in settings.default.phases]}

    got: dict[int, dict[str, Any]] = {}
    run.run_jobs([(child, 60.0)], 1, lambda i, r: got.__setitem__(i, r))
    assert "generate" in got[0]["phases"] and "shrink" not in got[0]["phases"]
    assert settings.default is not None and Phase.shrink in settings.default.phases


@pytest.mark.spec("HARN-8", "HARN-9", "HARN-26")
def test_the_full_run_reports_and_their_document_agree() -> None:
    """Each committed full-run report (every mutant of a package) is stated in tests/MUTATION.md
    with its counts, score and commit, met or not."""
    reports = sorted((ROOT / "mutation" / "full-run").glob("*.json"))
    assert reports, "no full-run report is committed"
    doc = (ROOT / "tests" / "MUTATION.md").read_text(encoding="utf-8")
    for path in reports:
        data = json.loads(path.read_text(encoding="utf-8"))
        assert data["meta"]["sample"] == 0 and data["meta"]["commit"][:7] in doc
        for pkg, s in data["scores"].items():
            pct = run.score_percent(s)
            n = sum(s.values())
            row = f"| {pkg} | {n} | {s['killed']} | {s['survived']} | {s['equivalent']} | {s['error']} | "
            assert row + ("n/a" if pct is None else f"{pct:.0f} %") in doc, (path.name, row)
        if "reference_suites" in data:
            rs = data["reference_suites"]
            assert f"run the reference kill {rs['reference']}," in doc
            assert f"differential tests kill {rs['differential']}," in doc
