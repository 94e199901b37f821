"""Prose stays true: cited IDs exist, the spec states behaviour in short numbered bullets.

HARN-22 and HARN-23 (spec/harness.md). The checks live in
``refdcp.tools.prose_check``; these tests run them on this checkout and on
planted trees, so each check is shown to fail when it should.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from refdcp.tools.prose_check import MAX_WORDS, spec_problems, stale_citations
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
