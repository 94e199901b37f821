"""The README lists every deliberate difference from torch as the spec states it (HARN-31)."""

from __future__ import annotations

from pathlib import Path

import pytest

from refdcp.tools.differences import BEGIN, END, differences, main, render

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.spec("HARN-31")
def test_the_readme_lists_every_difference_the_spec_states() -> None:
    items = differences(ROOT / "spec")
    assert len(items) > 40 and len({rid for rid, _, _ in items}) == len(items)
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    block = readme[readme.index(BEGIN) : readme.index(END) + len(END)]
    assert block == render(items), "run python -m refdcp.tools.differences"
    assert main(["--check"]) == 0
    for rid, _, text in items:
        assert f"**{rid}**" in block and text and "(checked:" not in text


@pytest.mark.spec("HARN-31")
def test_a_new_difference_in_the_spec_is_found(tmp_path: Path) -> None:
    spec = tmp_path / "spec"
    spec.mkdir()
    (spec / "x.md").write_text(
        "- **X-1** MUST: do a. Differs from torch: torch does b (checked: tests/t.py::test_b).\n"
        "- **X-2** MUST: do c.\n",
        encoding="utf-8",
    )
    assert differences(spec) == [("X-1", "x.md", "torch does b.")]
