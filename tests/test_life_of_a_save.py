"""docs/life-of-a-save.md is generated from a real reference run and stays fresh (TOOL-27)."""

from __future__ import annotations

import copy
import re

import pytest

from refdcp.tools import life_of_a_save as life

RESERVED_KEY = life.RESERVED_KEY


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
    for run in (record.reference, record.default):
        assert run.directory not in text and run.token() not in text
    assert "/tmp" not in text and "life-" not in text  # no temporary paths


@pytest.mark.spec("TOOL-27", "REF-1")
def test_the_page_shows_the_reference_writers_real_files(record: life.Record) -> None:
    """Every file the reference save left is on the page, with its real size, under the
    reference's own names (``__{rank}_0.{token}.distcp``, a plain string per rank)."""
    ref = record.reference
    text = life.render(record)
    files_section = text[text.index("## 4. The files on disk") : text.index("## 5.")]
    assert set(ref.files) == {".metadata", *(f"__{r}_0.{ref.token()}.distcp" for r in range(4))}
    for name, data in ref.files.items():
        if name != ".metadata":
            assert f"`{ref.mask(name)}`, {len(data)} B:" in files_section
    assert all(isinstance(p.storage_data, str) for p in ref.save_final.values())
    assert "_StoragePrefix" not in text[: text.index("## 7.")]
    # every stored item's byte range on the page is the range the metadata records
    assert ref.committed is not None
    for idx, info in ref.committed.storage_data.items():
        rng = f"[{info.offset}, {info.offset + info.length}) {info.length} B `{idx.fqn}`"
        assert rng in files_section
        assert ref.files[info.relative_path][info.offset : info.offset + 4] == b"PK\x03\x04"
        if idx.offset is not None:  # a tensor chunk starts on a 64-byte boundary, as it says
            assert info.offset % 64 == 0


@pytest.mark.spec("TOOL-27")
def test_every_field_is_explained_once(record: life.Record) -> None:
    text = life.render(record)
    ref_fields = {k for p in record.reference.save_local for k in p.planner_data[RESERVED_KEY]}
    dft_fields = {k for p in record.default.save_local for k in p.planner_data[RESERVED_KEY]}
    assert ref_fields == set(life.FIELDS)
    assert dft_fields - ref_fields and dft_fields - ref_fields <= set(life.DEFAULT_FIELDS)
    for name in ref_fields:
        assert text.count(life.FIELDS[name]) == 1, name
    for name in dft_fields - ref_fields:
        assert text.count(life.DEFAULT_FIELDS[name]) == 1, name


@pytest.mark.spec("TOOL-27")
def test_a_field_the_table_does_not_explain_stops_the_generator(
    record: life.Record, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delitem(life.FIELDS, "without_chunks")
    with pytest.raises(life.UnexplainedField, match="without_chunks"):
        life.render(record)


@pytest.mark.spec("TOOL-27")
@pytest.mark.parametrize("path", ["reference", "default"])
def test_a_new_field_in_a_plan_stops_the_generator(record: life.Record, path: str) -> None:
    planted = copy.copy(record)
    run = copy.copy(getattr(record, path))
    run.save_local = copy.deepcopy(run.save_local)
    run.save_local[2].planner_data[RESERVED_KEY]["shiny_new_field"] = 1
    setattr(planted, path, run)
    with pytest.raises(life.UnexplainedField, match="shiny_new_field"):
        life.render(planted)


@pytest.mark.spec("TOOL-27")
def test_plans_are_shown_as_sent_and_dedup_keeps_one_writer(record: life.Record) -> None:
    for run in (record.reference, record.default):
        assert len(run.save_local) == 4 and sorted(run.save_final) == [0, 1, 2, 3]
        assert sorted(run.load_final) == [0, 1, 2]
        # dedup: 16 items sent, 7 kept
        assert sum(len(p.items) for p in run.save_local) == 16
        assert sum(len(p.items) for p in run.save_final.values()) == 7
    # the default coordinator digests its own plan later, in create_global_plan: as sent,
    # its digest is None, while every other rank sent one
    coord = record.default.save_local[0].planner_data[RESERVED_KEY]
    assert coord["digest"] is None
    assert all(p.planner_data[RESERVED_KEY]["digest"] for p in record.default.save_local[1:])


@pytest.mark.spec("TOOL-27")
def test_the_differences_section_is_computed_from_both_runs(record: life.Record) -> None:
    """Compared with itself, a run shows no difference: the section's findings come from
    the records, not from prose."""
    same = life.render(life.Record(record.reference, record.reference))
    section = same[same.index("## 7.") :]
    assert "DIFFERENT" not in section and "NO, they differ" not in section
    assert "are the same in both paths." in section
    assert not re.search(r"\| (yes \| no|no \| yes) \|", section)
    real = life.render(record)
    diff = real[real.index("## 7.") :]
    assert "| `digest` | no | yes |" in diff
    assert "`storage_index.index`" in diff
    sizes = [len(d) for n, d in record.default.files.items() if n != ".metadata"]
    assert all(f"| {s} |" in diff for s in sizes)
