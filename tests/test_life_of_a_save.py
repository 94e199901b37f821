"""docs/life-of-a-save.md is generated from a real run and stays fresh (TOOL-27)."""

from __future__ import annotations

import pytest

from refdcp.planning.flatten import RESERVED_KEY
from refdcp.tools import life_of_a_save as life


@pytest.fixture(scope="module")
def record() -> life.Record:
    return life.run()


@pytest.mark.spec("TOOL-27")
def test_the_page_is_fresh(record: life.Record) -> None:
    committed = life.page_path().read_text(encoding="utf-8")
    assert committed == life.render(record), (
        "docs/life-of-a-save.md is stale: run python -m refdcp.tools.life_of_a_save"
    )


@pytest.mark.spec("TOOL-27")
def test_the_page_is_deterministic(record: life.Record) -> None:
    text = life.render(life.run())
    assert text == life.render(record)
    assert "/tmp" not in text and "refdcp-" not in text  # no temporary paths


@pytest.mark.spec("TOOL-27")
def test_every_field_is_explained_once(record: life.Record) -> None:
    text = life.render(record)
    fields = {k for plan in record.save_local for k in plan.planner_data[RESERVED_KEY]}
    assert fields and fields <= set(life.FIELDS)
    for name in fields:
        assert text.count(life.FIELDS[name]) == 1, name


@pytest.mark.spec("TOOL-27")
def test_a_field_the_table_does_not_explain_stops_the_generator(
    record: life.Record, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delitem(life.FIELDS, "without_chunks")
    with pytest.raises(life.UnexplainedField, match="without_chunks"):
        life.render(record)


@pytest.mark.spec("TOOL-27")
def test_a_new_field_in_a_plan_stops_the_generator(record: life.Record) -> None:
    import copy

    planted = copy.copy(record)
    planted.save_local = copy.deepcopy(record.save_local)
    planted.save_local[2].planner_data[RESERVED_KEY]["shiny_new_field"] = 1
    with pytest.raises(life.UnexplainedField, match="shiny_new_field"):
        life.render(planted)


@pytest.mark.spec("TOOL-27")
def test_plans_are_shown_as_sent_not_as_changed_later(record: life.Record) -> None:
    # the coordinator's planner digests its own plan in create_global_plan; rank 0 never
    # sent a digest, and the page shows the plan as sent
    coord = record.save_local[0].planner_data[RESERVED_KEY]
    assert coord["digest"] is None and coord["blocks"] is None
    assert all(p.planner_data[RESERVED_KEY]["digest"] for p in record.save_local[1:])
    assert len(record.save_local) == 4 and sorted(record.save_final) == [0, 1, 2, 3]
    assert sorted(record.load_final) == [0, 1, 2]
    # dedup: 16 items sent, 7 kept
    assert sum(len(p.items) for p in record.save_local) == 16
    assert sum(len(p.items) for p in record.save_final.values()) == 7
