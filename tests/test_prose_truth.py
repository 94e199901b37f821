"""Prose stays true: cited IDs exist, the spec states behaviour in short numbered bullets,
every guarantee names its tests, the README's matrix says what its reports say, and every
claim about torch names a torch run.

HARN-22, HARN-23, HARN-28, HARN-29 and HARN-30 (spec/harness.md). The checks live in
``refdcp.tools.prose_check``; these tests run them on this checkout and on
planted trees, so each check is shown to fail when it should.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from refdcp.tools.prose_check import (
    MAX_WORDS,
    guarantee_problems,
    matrix_problems,
    spec_problems,
    stale_citations,
    torch_claim_problems,
)
from refdcp.tools.spec_report import repo_root

# The planted trees use an area no real spec file has, so this file never cites a stale ID.
AREA = "ZZQ"


def _plant(tmp_path: Path, bullets: list[str], cites: str = "") -> Path:
    (tmp_path / "spec").mkdir(parents=True)
    (tmp_path / "spec" / "one.md").write_text("# One\n\n" + "\n".join(bullets) + "\n")
    (tmp_path / "refdcp").mkdir()
    (tmp_path / "refdcp" / "mod.py").write_text(f'"""Module ({cites})."""\n')
    return tmp_path


def _req(n: int, words: int = 5, level: str = "MUST") -> str:
    return f"- **{AREA}-{n}** {level}: " + " ".join(["word"] * words)


@pytest.mark.spec("HARN-22")
def test_every_cited_id_exists_in_this_checkout() -> None:
    stale = stale_citations(repo_root())
    assert not stale, [f"{s.file}:{s.line} {s.id}" for s in stale]


@pytest.mark.spec("HARN-23")
def test_this_checkouts_spec_has_no_problem() -> None:
    assert spec_problems(repo_root() / "spec") == []


@pytest.mark.spec("HARN-22")
def test_a_planted_stale_id_is_found_in_code_and_docs(tmp_path: Path) -> None:
    root = _plant(tmp_path, [_req(1), _req(2), f"- **{AREA}-3** WITHDRAWN: merged into {AREA}-2."])
    (root / "docs").mkdir()
    (root / "docs" / "guide.md").write_text(f"See {AREA}-2 and {AREA}-9.\n")
    (root / "refdcp" / "mod.py").write_text(f'"""({AREA}-1..{AREA}-4, {AREA}-3)."""\n')
    found = sorted((s.file, s.line, s.id) for s in stale_citations(root))
    assert found == [("docs/guide.md", 1, f"{AREA}-9"), ("refdcp/mod.py", 1, f"{AREA}-4")]


@pytest.mark.spec("HARN-22")
def test_an_id_of_an_unknown_area_or_inside_a_word_is_no_citation(tmp_path: Path) -> None:
    root = _plant(tmp_path, [_req(1)], cites=f"XYZ-{AREA}-7 utf-8 {AREA}-1 NOT{AREA}-5")
    assert stale_citations(root) == []


@pytest.mark.spec("HARN-23")
@settings(max_examples=30, deadline=None)
@given(words=st.integers(min_value=MAX_WORDS - 3, max_value=MAX_WORDS + 3))
def test_a_requirement_over_the_word_limit_is_refused(
    tmp_path_factory: pytest.TempPathFactory, words: int
) -> None:
    root = _plant(tmp_path_factory.mktemp("spec"), [_req(1, words)])
    problems = spec_problems(root / "spec")
    assert bool(problems) == (words > MAX_WORDS), problems
    if problems:
        assert f"{AREA}-1" in problems[0] and f"{words} words" in problems[0]


@pytest.mark.spec("HARN-23")
def test_a_121_word_requirement_and_a_gap_are_refused(tmp_path: Path) -> None:
    root = _plant(tmp_path, [_req(1, 121), _req(2), _req(5)])
    problems = spec_problems(root / "spec")
    assert any(f"{AREA}-1" in p and "121 words" in p for p in problems), problems
    assert any(f"{AREA}-3, {AREA}-4" in p and "gap" in p for p in problems), problems
    assert len(problems) == 2


@pytest.mark.spec("HARN-23")
def test_a_gap_closed_by_withdrawn_bullets_passes_and_needs_a_reason(tmp_path: Path) -> None:
    ok = [_req(1), f"- **{AREA}-2** WITHDRAWN: never assigned.", _req(3, level="SHOULD NOT")]
    assert spec_problems(_plant(tmp_path / "a", ok) / "spec") == []
    bare = [_req(1), f"- **{AREA}-2** WITHDRAWN", _req(3)]
    [problem] = spec_problems(_plant(tmp_path / "b", bare) / "spec")
    assert "without a reason" in problem


@pytest.mark.spec("HARN-23")
@pytest.mark.parametrize(
    "bullet, why",
    [
        (f"- **{AREA}-1** MAY: do something.", "no keyword"),
        (f"- **{AREA.lower()}-1** MUST: do something.", "AREA-N"),
        (f"- **{AREA}-1** MUST: keep what refdcp 0.x stored.", "history"),
        (f"- **{AREA}-1** MUST: write at 2.72 GiB/s.", "history"),
        (f"- **{AREA}-1** SHOULD: do as it did before.", "history"),
    ],
)
def test_a_bad_marker_or_a_narrated_history_is_refused(
    tmp_path: Path, bullet: str, why: str
) -> None:
    problems = spec_problems(_plant(tmp_path, [bullet]) / "spec")
    assert problems and why in problems[0], problems


@pytest.mark.spec("HARN-23")
def test_every_spec_file_is_checked_alike(tmp_path: Path) -> None:
    """A new spec file is covered without being named anywhere."""
    root = _plant(tmp_path, [_req(1)])
    (root / "spec" / "zz_new_area.md").write_text(f"- **ZZR-2** MUST: {'w ' * 130}\n")
    problems = spec_problems(root / "spec")
    assert any("zz_new_area.md" in p and "words" in p for p in problems)
    assert any("ZZR-1" in p and "gap" in p for p in problems)


# --- HARN-28: every guarantee names the IDs and tests that hold it ---------------------------


def _guarantee_tree(tmp_path: Path, doc: str) -> Path:
    root = _plant(tmp_path, [_req(1), _req(2), _req(3)])
    (root / "tests").mkdir()
    (root / "tests" / "test_a.py").write_text(
        f'import pytest\n\n\n@pytest.mark.spec("{AREA}-1")\ndef test_x() -> None:\n    pass\n'
    )
    (root / "docs").mkdir()
    (root / "docs" / "guarantees.md").write_text(doc)
    return root


_GOOD = f"""# Title

Introduction without IDs.

## Kept

* A promise ({AREA}-1).
* Not covered: what it does not promise.

A list ({AREA}-2):

* an item;
* another item.

Tested by `tests/test_a.py::test_x`.
"""


@pytest.mark.spec("HARN-28")
def test_this_checkouts_guarantees_name_their_ids_and_tests() -> None:
    assert guarantee_problems(repo_root()) == []


@pytest.mark.spec("HARN-28")
def test_a_guarantee_with_ids_and_an_existing_citing_test_passes(tmp_path: Path) -> None:
    assert guarantee_problems(_guarantee_tree(tmp_path, _GOOD)) == []


@pytest.mark.spec("HARN-28")
@pytest.mark.parametrize(
    "section, why",
    [
        ("A promise.\n\nTested by `tests/test_a.py`.\n", "names no spec ID"),
        (f"A promise ({AREA}-1).\n", "names no test"),
        (f"A promise ({AREA}-1), `tests/test_a.py::test_gone`.\n", "no such test"),
        (f"A promise ({AREA}-1), `tests/test_b.py`.\n", "no such file"),
        (f"A promise ({AREA}-3), `tests/test_a.py`.\n", "cites any of"),
        (f"* a bullet alone.\n\n({AREA}-1) `tests/test_a.py`.\n", "cites no spec ID"),
        (f"A list:\n\n* a bullet.\n\n({AREA}-1) `tests/test_a.py`.\n", "cites no spec ID"),
    ],
)
def test_a_planted_bad_guarantee_is_named(tmp_path: Path, section: str, why: str) -> None:
    root = _guarantee_tree(tmp_path, _GOOD + "\n## Planted\n\n" + section)
    problems = guarantee_problems(root)
    assert len(problems) == 1 and "'Planted'" in problems[0] and why in problems[0], problems


# --- HARN-29: the README's matrix agrees with its reports ------------------------------------

_IDS = [f"CONF-{n}" for n in (1, 10, 25, 27, 30, 58, 61)]
_MUST = {i for i in _IDS if i != "CONF-25"}


def _report(failed: set[str]) -> dict[str, object]:
    results = [
        {"id": i, "level": "SHOULD" if i == "CONF-25" else "MUST", "status": "fail"}
        if i in failed
        else {"id": i, "level": "MUST", "status": "pass"}
        for i in _IDS
    ]
    return {"ok": not (failed & _MUST), "results": results}


def _matrix_tree(tmp_path: Path, failed: list[set[str]], row: str) -> Path:
    root = tmp_path
    (root / "r").mkdir(parents=True, exist_ok=True)
    for n, f in enumerate(failed):
        (root / "r" / f"b{n}.json").write_text(json.dumps(_report(f)))
    table = (
        "| backend | conforms; failed | works after `reset(checkpoint_id)` |\n| --- | --- | --- |\n"
    )
    (root / "README.md").write_text("Intro.\n\n" + table + row + "\n\nAfter.\n")
    return root


def _row(failed: list[set[str]]) -> str:
    """The row the rule says for these reports."""
    first = failed[0]
    links = ", ".join(f"[b{n}](r/b{n}.md)" for n in range(len(failed)))
    conforms = ("no" if first & _MUST else "yes") + ": " + ", ".join(sorted(first))
    resets = [not ({"CONF-1", "CONF-27"} & f) for f in failed]
    variants = set().union(*failed[1:]) if len(failed) > 1 else set()
    reset = (
        "yes" if all(resets) else "no" if not resets[0] else "only: " + ", ".join(sorted(variants))
    )
    return f"| {links} | {conforms} | {reset} |"


_failed_sets = st.sets(st.sampled_from(_IDS))


@pytest.mark.spec("HARN-29")
def test_this_checkouts_readme_matrix_agrees_with_its_reports() -> None:
    assert matrix_problems(repo_root()) == []


@pytest.mark.spec("HARN-29")
@settings(max_examples=60, deadline=None)
@given(failed=st.lists(_failed_sets, min_size=1, max_size=3), data=st.data())
def test_a_row_agrees_exactly_when_it_says_what_its_reports_say(
    tmp_path_factory: pytest.TempPathFactory, failed: list[set[str]], data: st.DataObject
) -> None:
    root = _matrix_tree(tmp_path_factory.mktemp("m"), failed, _row(failed))
    assert matrix_problems(root) == []
    # any other claimed failure set for the first report is caught
    claimed = data.draw(_failed_sets.filter(lambda s: s != failed[0]))
    wrong = _row([claimed, *failed[1:]])
    root = _matrix_tree(tmp_path_factory.mktemp("m"), failed, wrong)
    assert any("its report" in p for p in matrix_problems(root))


@pytest.mark.spec("HARN-29")
def test_a_flipped_verdict_and_a_row_without_report_are_caught(tmp_path: Path) -> None:
    row = _row([{"CONF-30"}]).replace("| no:", "| yes:")
    [problem] = matrix_problems(_matrix_tree(tmp_path / "a", [{"CONF-30"}], row))
    assert "says 'yes: CONF-30'" in problem and "'no'" in problem
    problems = matrix_problems(_matrix_tree(tmp_path / "b", [set()], "| b0 | yes | yes |"))
    assert problems == ["README.md:5: the row links no report"]
    missing = _row([set()]).replace("b0.md", "gone.md")
    [problem] = matrix_problems(_matrix_tree(tmp_path / "c", [set()], missing))
    assert "no report r/gone.json" in problem


# --- HARN-30: every claim about torch names a torch run ---------------------------------------


def _claims_tree(tmp_path: Path, bullets: list[str], unchecked: str = "") -> Path:
    root = _plant(tmp_path, bullets)
    (root / "tests").mkdir()
    (root / "tests" / "test_t.py").write_text(
        "import torch.distributed.checkpoint as dcp\n\n\n"
        "def test_runs() -> None:\n    dcp.save({}, checkpoint_id='x')\n\n\n"
        "def test_idle() -> None:\n    assert 1\n\n\n"
        "def torch_run() -> int:\n    dcp.save({}, checkpoint_id='x')\n    return 1\n\n\n"
        "def test_by_fixture(torch_run: int) -> None:\n    assert torch_run\n"
    )
    (root / "tests" / "torch_claims_unchecked.txt").write_text(unchecked)
    return root


@pytest.mark.spec("HARN-30")
def test_every_claim_about_torch_in_this_checkout_names_a_torch_run() -> None:
    assert torch_claim_problems(repo_root()) == []


@pytest.mark.spec("HARN-30")
@pytest.mark.parametrize(
    "claim, why",
    [
        ("Differs from torch: torch keeps it.", "without (checked"),
        ("torch 2.13 writes it as well.", "without (checked"),
        ("Differs from torch: x (checked: tests/test_t.py::test_gone).", "no such test"),
        ("Differs from torch: x (checked: tests/test_u.py::test_runs).", "no such file"),
        ("Differs from torch: x (checked: tests/test_t.py::test_idle).", "does not run torch"),
        ("Differs from torch: x (checked: tests/test_t.py).", "is not tests/x.py::test_y"),
    ],
)
def test_a_claim_about_torch_without_a_torch_run_is_named(
    tmp_path: Path, claim: str, why: str
) -> None:
    root = _claims_tree(tmp_path, [_req(1, 3) + ". " + claim])
    problems = torch_claim_problems(root)
    assert len(problems) == 1 and f"{AREA}-1" in problems[0] and why in problems[0], problems


@pytest.mark.spec("HARN-30", "HARN-23")
def test_a_marked_claim_passes_and_its_marker_is_not_counted_as_words(tmp_path: Path) -> None:
    claim = "Differs from torch: torch keeps it (checked: tests/test_t.py::test_runs)."
    quoted = "Names `Differs from torch: torch keeps it` only as code."
    root = _claims_tree(tmp_path, [_req(1, MAX_WORDS - 16) + ". " + claim + " " + quoted])
    assert torch_claim_problems(root) == []
    assert spec_problems(root / "spec") == []  # 120 words without the marker's two
    root = _claims_tree(tmp_path / "over", [_req(1, MAX_WORDS - 15) + ". " + claim + " " + quoted])
    [problem] = spec_problems(root / "spec")
    assert "121 words" in problem


@pytest.mark.spec("HARN-30")
def test_a_test_runs_torch_through_a_fixture_or_helper_of_its_module(tmp_path: Path) -> None:
    claim = "Differs from torch: torch keeps it (checked: tests/test_t.py::test_by_fixture)."
    assert torch_claim_problems(_claims_tree(tmp_path, [_req(1, 3) + ". " + claim])) == []


@pytest.mark.spec("HARN-30")
def test_the_unchecked_list_only_shrinks(tmp_path: Path) -> None:
    listed = f"{AREA}-1: Differs from torch: torch keeps it.\n"
    root = _claims_tree(
        tmp_path / "a", [_req(1, 3) + ". Differs from torch: torch keeps it."], listed
    )
    assert torch_claim_problems(root) == []
    marked = (
        _req(1, 3) + ". Differs from torch: torch keeps it (checked: tests/test_t.py::test_runs)."
    )
    [problem] = torch_claim_problems(_claims_tree(tmp_path / "b", [marked], listed))
    assert "remove it from" in problem
    [problem] = torch_claim_problems(_claims_tree(tmp_path / "c", [_req(1, 3)], listed))
    assert "is no claim of spec/ any more" in problem


@pytest.mark.spec("HARN-28", "HARN-29", "HARN-30")
def test_the_prose_checks_are_fast() -> None:
    start = time.perf_counter()
    root = repo_root()
    guarantee_problems(root), matrix_problems(root), torch_claim_problems(root)
    assert time.perf_counter() - start < 2.0
