"""The mutation tool behind ``make mutation`` (spec/harness.md, HARN-1..HARN-9)."""

from __future__ import annotations

import ast
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import tomllib

from mutation import run
from mutation.operators import Mutant, apply_mutant, enumerate_mutants

ROOT = Path(__file__).resolve().parents[1]

SAMPLE = '''
"""Module docstring citing DEDUP-1."""
LIMIT: int = 3
TABLE = [("a", 1), ("b", 2)]


def pick(xs: list[int], n: int = 5) -> int:
    """Pick (DEDUP-2..3)."""
    assert n > 0
    best = min(xs)
    if best < 0 and n != 2:
        raise ValueError(f"negative {best + 1}")
    for x in xs:
        if x == 7:
            break
    return best + 1


class Box:
    def size(self) -> bool:
        return not self.empty()

    def empty(self) -> bool:
        return False
'''


def _ops(ms: list[Mutant]) -> set[tuple[int, str]]:
    return {(m.line, m.description) for m in ms}


@pytest.mark.spec("HARN-1")
def test_config_names_every_module_the_issue_asks_for_and_make_test_does_not_run_it() -> None:
    cfg = tomllib.loads((ROOT / "mutation" / "config.toml").read_text(encoding="utf-8"))
    mods = set(cfg["modules"])
    for path in [
        "planning/dedup/classes.py",
        "planning/resharding.py",
        "planning/metadata/build.py",
        "planning/load_policy.py",
        "planning/flatten.py",
        "storage/format/items.py",
        "storage/fs/filesystem.py",
        "storage/metadata/safe.py",
        "storage/verify.py",
        "protocol/machine.py",
        "protocol/save.py",
        "protocol/load.py",
        "staging/machine.py",
        "staging/buffer_pool.py",
        "staging/tree.py",
    ]:
        assert f"refdcp/{path}" in mods
    assert all((ROOT / m).exists() for m in mods)
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    assert re.search(r"^mutation:", makefile, re.M) and "-m mutation" in makefile
    test_recipe = re.search(r"^test:.*\n((?:\t.*\n)+)", makefile, re.M)
    assert test_recipe and "mutation" not in test_recipe.group(1)


@pytest.mark.spec("HARN-2")
def test_operators_mutate_code_but_not_strings_annotations_docstrings_asserts_or_defaults() -> None:
    ms = enumerate_mutants(SAMPLE, "x.py")
    ops = _ops(ms)
    assert (10, "`min(...)` -> `max(...)`") in ops
    assert (11, "`<` -> `<=`") in ops and (11, "`and` -> `or`") in ops
    assert (11, "negate the `if` condition") in ops and (12, "delete `raise`") in ops
    assert (15, "`break` -> `continue`") in ops and (16, "`return X` -> `return None`") in ops
    assert (
        (16, "`+` -> `-`") in ops and (21, "drop `Not`") in ops and (24, "`False` -> `True`") in ops
    )
    assert (4, "drop list element 0") in ops  # a module-level table row
    lines = {m.line for m in ms}
    assert 9 not in lines  # the assert
    assert (3, "`3` -> `4`") in ops  # a module-level constant: its value, not its annotation
    assert not any(m.line == 7 for m in ms)  # `n: int = 5`: default and annotations
    assert not any(
        "negative" in m.description for m in ms
    )  # f-string untouched (line 12 only raise)
    assert [m.id for m in ms] == [m.id for m in enumerate_mutants(SAMPLE, "x.py")]  # deterministic


@pytest.mark.spec("HARN-2")
def test_apply_mutant_changes_exactly_one_node() -> None:
    base = ast.unparse(ast.parse(SAMPLE))
    for m in enumerate_mutants(SAMPLE, "x.py"):
        changed = ast.unparse(apply_mutant(SAMPLE, m))
        assert changed != base, m
        diff = [a for a, b in zip(base.splitlines(), changed.splitlines()) if a != b]
        assert len(diff) <= 1 or m.op.startswith("drop"), (m, diff)


@pytest.fixture
def tiny_pkg(tmp_path: Path) -> Any:
    pkg = tmp_path / "mutpkg_t"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "core.py").write_text(SAMPLE)
    (pkg / "user.py").write_text(
        "from mutpkg_t.core import TABLE, pick\n\ndef first():\n    return TABLE[0]\n"
    )
    sys.path.insert(0, str(tmp_path))
    yield tmp_path
    sys.path.remove(str(tmp_path))
    for name in [n for n in sys.modules if n.startswith("mutpkg_t")]:
        del sys.modules[name]


@pytest.mark.spec("HARN-2")
def test_patch_swaps_function_code_and_rebinds_module_tables(tiny_pkg: Path) -> None:
    import mutpkg_t.core as core
    import mutpkg_t.user as user

    ms = enumerate_mutants(SAMPLE, "mutpkg_t/core.py")
    pick = core.pick
    assert pick([3, 4]) == 4
    m = next(m for m in ms if m.description == "`min(...)` -> `max(...)`")
    run.patch(m, root=tiny_pkg, targets=["mutpkg_t/core.py"])
    assert pick([3, 4]) == 5 and user.pick([3, 4]) == 5  # the same function object everywhere
    meth = next(m for m in ms if m.description == "drop `Not`")
    run.patch(meth, root=tiny_pkg, targets=["mutpkg_t/core.py"])
    assert core.Box().size() is False
    row = next(m for m in ms if m.description == "drop list element 0")
    run.patch(row, root=tiny_pkg, targets=["mutpkg_t/core.py"])
    assert core.TABLE == [("b", 2)] and user.TABLE == [("b", 2)] and user.first() == ("b", 2)


@pytest.mark.spec("HARN-3")
def test_spec_ids_and_test_selection() -> None:
    known = {f"DEDUP-{i}" for i in range(1, 9)} | {f"STAGE-{i}" for i in range(1, 12)}
    assert run.cited_ids("(DEDUP-1..3) and STAGE-6..STAGE-8, CRC-32", known) == {
        "DEDUP-1",
        "DEDUP-2",
        "DEDUP-3",
        "STAGE-6",
        "STAGE-7",
        "STAGE-8",
    }
    tree = ast.parse(SAMPLE)
    assert run.scope_ids(SAMPLE, tree, "pick", {"DEDUP-1"}, known) == {"DEDUP-2", "DEDUP-3"}
    assert run.scope_ids(SAMPLE, tree, "Box.size", {"DEDUP-1"}, known) == {"DEDUP-1"}
    m = next(
        m
        for m in enumerate_mutants(SAMPLE, "x.py")
        if m.line == 16 and m.op.startswith("binop-Add")
    )
    tests = {
        "a": run.TestInfo("a", {"DEDUP-1"}),
        "b": run.TestInfo("b", {"DEDUP-2"}),
        "c": run.TestInfo("c", {"DEDUP-2"}),
        "d": run.TestInfo("d", {"DEDUP-3"}),
    }
    hits = {"16": ["a", "b", "c"], "10": ["d"]}
    pool = run.tests_for_mutant(
        m, ["a", "b", "c", "d"], {"DEDUP-2"}, tests, hits, {"b": 2.0, "c": 1.0}
    )
    assert pool == ["c", "b", "a"]  # d never ran line 16; own-ID tests first, fastest first
    row = next(
        m for m in enumerate_mutants(SAMPLE, "x.py") if m.op.startswith("drop") and m.line == 4
    )
    assert set(run.tests_for_mutant(row, ["a", "d"], set(), tests, {}, {})) == {"a", "d"}


@pytest.mark.spec("HARN-4")
def test_sample_is_reproducible_and_proportional() -> None:
    pop = [
        Mutant(f"refdcp/{p}/m.py", i, 0, i, "op", "", i, "f")
        for p in ("a", "b")
        for i in range(100)
    ]
    pop += [Mutant("refdcp/c/m.py", i, 0, i, "op", "", i, "f") for i in range(200)]
    s1 = run.sample_mutants(pop, 40, 3)
    assert [m.id for m in s1] == [m.id for m in run.sample_mutants(list(reversed(pop)), 40, 3)]
    assert [m.id for m in s1] != [m.id for m in run.sample_mutants(pop, 40, 4)]
    per = {p: sum(1 for m in s1 if m.file.split("/")[1] == p) for p in "abc"}
    assert per == {"a": 10, "b": 10, "c": 20}
    assert len(run.sample_mutants(pop, 0, 3)) == 400


def _rec(status: str, file: str = "refdcp/planning/x.py", **kw: Any) -> run.Record:
    return run.Record(
        f"{file}:1:0:{status}", file, 12, "cmp0", "`<` -> `<=`", "f", ["DEDUP-2"], 3, status, **kw
    )


@pytest.mark.spec("HARN-5", "HARN-6", "HARN-9")
def test_reports_scores_survivors_and_equivalents(tmp_path: Path) -> None:
    recs = [
        _rec("killed", killed_by="t::a", killed_by_ids=["DEDUP-2"]),
        _rec("timeout"),
        _rec("survived"),
        _rec("equivalent", note="same result"),
        _rec("error", note="not patchable"),
        _rec("killed", file="refdcp/staging/y.py"),
    ]
    sc = run.scores(recs)
    assert sc["planning"] == {"killed": 2, "survived": 1, "equivalent": 1, "error": 1}
    assert run.score_percent(sc["planning"]) == pytest.approx(200 / 3)
    out = tmp_path / "r.json"
    run.write_reports(recs, out, 200, 7, 1266, 12.0, [])
    md = out.with_suffix(".md").read_text(encoding="utf-8")
    assert "`refdcp/planning/x.py:12` (f) `<` -> `<=` [DEDUP-2]" in md
    assert "MUTATION_SAMPLE=200, MUTATION_SEED=7" in md and "of 1266 mutants" in md
    assert (
        "| planning | 2 | 1 | 1 | 1 | 67 % |" in md and "| staging | 1 | 0 | 0 | 0 | 100 % |" in md
    )
    assert "not patchable" in md and "same result" in md
    data = json.loads(out.read_text(encoding="utf-8"))
    assert data["meta"]["seed"] == 7 and len(data["mutants"]) == 6


@pytest.mark.spec("HARN-6")
def test_equivalent_list_is_well_formed() -> None:
    eq = run.load_equivalent()
    for mid, reason in eq.items():
        assert re.fullmatch(r"refdcp/\S+\.py:\d+:\d+:[\w.-]+", mid) and len(reason) > 10


@pytest.mark.spec("HARN-7")
def test_a_child_past_its_limit_is_killed_and_counted_as_killed() -> None:
    results: dict[int, dict[str, Any]] = {}

    def slow() -> dict[str, Any]:
        time.sleep(60)
        return {"status": "survived"}

    def quick() -> dict[str, Any]:
        return {"status": "survived", "pid": os.getpid()}

    t0 = time.monotonic()
    run.run_jobs([(slow, 0.5), (quick, 30.0)], 2, lambda i, r: results.__setitem__(i, r))
    assert time.monotonic() - t0 < 30
    assert results[0]["status"] == "timeout" and results[1]["status"] == "survived"
    assert results[1]["pid"] != os.getpid()  # it ran in a forked child
    assert run.scores([_rec("timeout")])["planning"]["killed"] == 1


@pytest.mark.spec("HARN-27", "HARN-7")
def test_a_timeout_counts_only_when_a_run_with_four_times_the_limit_times_out_too() -> None:
    order: list[str] = []
    results: dict[int, dict[str, Any]] = {}

    def slowish() -> dict[str, Any]:  # past 0.3 s, well within 4 x 0.3 s
        time.sleep(0.6)
        return {"status": "survived"}

    def failing_slowly() -> dict[str, Any]:
        time.sleep(0.6)
        return {"status": "killed", "killed_by": "t"}

    def hang() -> dict[str, Any]:
        time.sleep(60)
        return {"status": "survived"}

    def quick() -> dict[str, Any]:
        return {"status": "survived"}

    def done(i: int, r: dict[str, Any]) -> None:
        order.append(["slowish", "failing", "hang", "quick"][i])
        results[i] = r

    t0 = time.monotonic()
    jobs = [(slowish, 0.3), (failing_slowly, 0.3), (hang, 0.3), (quick, 30.0)]
    run.run_jobs(jobs, 1, done)
    assert time.monotonic() - t0 < 20
    assert [results[i]["status"] for i in range(4)] == ["survived", "killed", "timeout", "survived"]
    assert order[0] == "quick"  # the confirming runs come after every other job
    assert results[0]["seconds"] >= 0.9 and results[2]["seconds"] >= 1.5  # both runs counted


@pytest.mark.spec("HARN-8", "HARN-9")
def test_committed_report_and_its_document_agree() -> None:
    """The scores tests/MUTATION.md states are those of the committed report, targets met or not."""
    data = json.loads((ROOT / "mutation" / "last-run.json").read_text(encoding="utf-8"))
    assert data["meta"]["sample"] == 200 and data["meta"]["commit"]
    doc = (ROOT / "tests" / "MUTATION.md").read_text(encoding="utf-8")
    for pkg in ("planning", "storage", "protocol", "staging"):
        pct = run.score_percent(data["scores"][pkg])
        assert pct is not None
        assert f"{pkg} {round(pct)} %" in doc, (pkg, pct)
    assert data["meta"]["commit"][:7] in doc


@pytest.mark.spec("HARN-2", "HARN-5")
def test_mutant_ids_are_unique_in_every_target_module() -> None:
    cfg = tomllib.loads((ROOT / "mutation" / "config.toml").read_text(encoding="utf-8"))
    for rel in cfg["modules"]:
        ids = [m.id for m in enumerate_mutants((ROOT / rel).read_text(encoding="utf-8"), rel)]
        assert len(ids) == len(set(ids)), rel
    nested = enumerate_mutants(
        "def f(a, b, c):\n    return a + b - c if a and b or c else 0\n", "y.py"
    )
    assert len({m.id for m in nested}) == len(nested)


@pytest.mark.spec("HARN-6")
def test_a_mutant_that_breaks_import_counts_as_killed(tmp_path: Path) -> None:
    pkg = tmp_path / "mutpkg_imp"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    src = "A = 1\nB = [0, 1][A]\n"
    (pkg / "m.py").write_text(src)
    sys.path.insert(0, str(tmp_path))
    try:
        m = next(m for m in enumerate_mutants(src, "mutpkg_imp/m.py") if m.line == 1)
        with pytest.raises(run.ImportTimeFailure, match="IndexError"):
            run.patch(m, root=tmp_path, targets=["mutpkg_imp/m.py"])
    finally:
        sys.path.remove(str(tmp_path))
        for name in [n for n in sys.modules if n.startswith("mutpkg_imp")]:
            del sys.modules[name]


@pytest.mark.spec("HARN-27", "HARN-26")
def test_a_rerun_takes_survivors_and_unconfirmed_timeouts() -> None:
    confirmed = "ran past its time limit, then past 4 times it"
    report = {
        "mutants": [
            {"id": "s", "status": "survived"},
            {"id": "k", "status": "killed"},
            {"id": "e", "status": "equivalent"},
            {"id": "t-old", "status": "timeout", "note": "ran past its time limit"},
            {"id": "t-new", "status": "timeout", "note": confirmed},
            {"id": "r", "status": "killed", "suites": {"run": "killed", "diff": "survived"}},
        ]
    }
    assert run.rerun_ids(report) == {"s", "t-old"}
    assert run.rerun_ids(report, suites_too=True) == {"s", "t-old", "r"}
    assert run.rerun_ids(report, timeouts=False) == {"s"}


@pytest.mark.spec("HARN-27")
def test_a_report_states_its_unconfirmed_timeouts(tmp_path: Path) -> None:
    recs = [_rec("timeout"), _rec("timeout"), _rec("killed")]
    recs[0].note = "ran past its time limit, then past 4 times it"
    recs[1].note = "ran past its time limit"
    out = tmp_path / "r.json"
    run.write_reports(recs, out, 0, 1, 3, 1.0, [], commit="abc")
    md = out.with_suffix(".md").read_text(encoding="utf-8")
    assert "Timeouts, counted as killed: 2; 1 of them unconfirmed" in md


@pytest.mark.spec("HARN-3")
def test_the_baseline_records_lines_run_after_a_test_that_switched_tracing_off(
    tmp_path: Path,
) -> None:
    """A test that turns tracing off (as ``learner_path`` traced a save of its own) must not
    hide the lines every later test runs: each test starts with the baseline's tracer."""
    target = tmp_path / "target_mod.py"
    target.write_text("def f(x):\n    y = x + 1\n    return y\n")
    (tmp_path / "test_pair.py").write_text(
        "import sys, threading\n"
        "import target_mod\n\n"
        "def test_a_off():\n"
        "    sys.settrace(None)\n"
        "    threading.settrace(None)\n\n"
        "def test_b_runs():\n"
        "    assert target_mod.f(1) == 2\n"
    )
    sys.path.insert(0, str(tmp_path))
    outer = sys.gettrace()
    try:
        res = run.baseline_job(
            [f"{tmp_path}/test_pair.py::test_a_off", f"{tmp_path}/test_pair.py::test_b_runs"],
            {str(target)},
        )()
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("target_mod", None)
        sys.settrace(outer)
    assert res["rc"] == 0, res
    hits = res["hits"][str(target)]
    assert [t.rsplit("/", 1)[-1] for t in hits["2"]] == ["test_pair.py::test_b_runs"], hits
