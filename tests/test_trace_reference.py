"""``refdcp trace --reference``: the reference's save and load on a real directory (TRACE-14)."""

from __future__ import annotations

import io
import os
import re
from pathlib import Path

import crc32c
import pytest

from refdcp.tools.cli import main as cli_main
from refdcp.tools.trace import (
    TraceResult,
    render_mermaid,
    render_text,
    run_trace,
    step_label,
    trace_command,
)
from tests.test_trace import mermaid_problems


def _labels(res: TraceResult, which: str) -> dict[int, list[str]]:
    out: dict[int, list[str]] = {}
    for rec in getattr(res, which):
        out.setdefault(rec.rank, []).append(f"{step_label(rec)}:{rec.outcome.value}")
    return out


@pytest.mark.spec("TRACE-14", "REF-1")
@pytest.mark.parametrize(
    ("sharding", "save", "load"), [("rows", 4, 3), ("cols", 2, 3), ("replicated", 3, 1)]
)
def test_the_reference_trace_shows_the_files_it_wrote(
    tmp_path: Path, sharding: str, save: int, load: int
) -> None:
    directory = tmp_path / "ckpt"
    res = run_trace(save, load, sharding, reference=True, directory=directory)
    assert res.verified and res.metadata is not None and not res.temporary
    on_disk = {p.name: p.read_bytes() for p in directory.iterdir()}
    assert on_disk == res.files  # every file the save left, kept, byte for byte
    token = res.metadata.storage_meta.save_id  # type: ignore[union-attr]
    writers = sorted({r for r, results in enumerate(res.writes) if results})
    assert set(on_disk) == {".metadata", *(f"__{r}_0.{token}.distcp" for r in writers)}
    text = render_text(res)
    assert str(directory) in text.splitlines()[1] and "MemoryStorage" not in text
    for name, data in on_disk.items():
        assert f"  {name}  {len(data)} B" in text
    # the .metadata's trailer is the CRC-32C of its pickle (INTEG-2), shown as written
    pickle, _, trailer = on_disk[".metadata"].rpartition(b"#refdcp-crc32c:")
    assert trailer == b"%08x\n" % crc32c.crc32c(pickle) and repr(trailer)[2:-3] in text
    # every item: its byte range on the page, a torch.save zip archive at that offset
    for idx, info in res.metadata.storage_data.items():
        blob = on_disk[info.relative_path][info.offset : info.offset + info.length]
        assert blob[:4] == b"PK\x03\x04" and len(blob) == info.length
        rng = f"[{info.offset}, {info.offset + info.length}) {info.length} B {idx.fqn}"
        assert rng in text
        assert f"{info.relative_path} @ {info.offset} +{info.length} B" in text
    # the bytes between items are zero padding, and the page says so
    assert "unexplained bytes" not in text and "not a zip archive" not in text


@pytest.mark.spec("TRACE-14")
def test_a_temporary_directory_is_removed_after_the_trace() -> None:
    res = run_trace(2, 2, "rows", reference=True)
    assert res.temporary and res.directory is not None and res.files
    assert not os.path.exists(res.directory)
    assert "a temporary directory, removed" in render_text(res).splitlines()[1]


@pytest.mark.spec("TRACE-14", "REF-3")
@pytest.mark.parametrize("sharding", ["rows", "cols", "replicated"])
@pytest.mark.parametrize(("save", "load"), [(4, 2), (3, 3), (1, 4)])
def test_the_reference_makes_the_default_traces_plans(sharding: str, save: int, load: int) -> None:
    """The same protocol steps, local plans, dedup decisions, metadata and read plans as the
    default trace (REF-3)."""
    ref = run_trace(save, load, sharding, reference=True)
    fast = run_trace(save, load, sharding)
    assert ref.verified and fast.verified
    assert [p.items for p in ref.local_plans] == [p.items for p in fast.local_plans]
    assert ref.decisions == fast.decisions
    assert [p.items for p in ref.final_plans] == [p.items for p in fast.final_plans]
    assert ref.metadata is not None and fast.metadata is not None
    assert dict(ref.metadata.state_dict_metadata) == dict(fast.metadata.state_dict_metadata)
    # (torch's MetadataIndex leaves the chunk's lookup hint, ``index``, out of equality)
    assert [p.items for p in ref.read_plans] == [p.items for p in fast.read_plans]
    # the reference's own drive loop (reference/run.py) reports the steps of the same table
    assert _labels(ref, "save_steps") == _labels(fast, "save_steps")
    assert _labels(ref, "load_steps") == _labels(fast, "load_steps")
    src = render_mermaid(ref)
    assert mermaid_problems(src) == []
    assert sorted(src.splitlines()) == sorted(render_mermaid(fast).splitlines())


@pytest.mark.spec("TRACE-14")
def test_without_dedup_the_reference_planner_refuses_the_overlap() -> None:
    res = run_trace(2, 2, "replicated", dedup=False, reference=True)
    assert res.save_error is not None and res.metadata is None
    assert re.search(r"chunks overlap|several ranks", res.save_error)
    assert ".metadata" not in res.files  # nothing was committed
    assert "REFUSED by the coordinator" in render_text(res)


@pytest.mark.spec("TRACE-14", "TOOL-23")
def test_the_cli_keeps_the_files_in_dir_and_refuses_a_used_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    directory = tmp_path / "kept"
    assert cli_main(["trace", "--reference", "--dir", str(directory)]) == 0
    out = capsys.readouterr().out
    assert "the files stay there" in out
    names = sorted(p.name for p in directory.iterdir())
    assert names[0] == ".metadata" and len(names) == 5
    assert all(f"  {n}  " in out for n in names)
    # a directory that already holds files, or --dir without --reference: refused
    assert cli_main(["trace", "--reference", "--dir", str(directory)]) == 2
    assert "not a new or empty directory" in capsys.readouterr().err
    assert cli_main(["trace", "--dir", str(tmp_path / "other")]) == 2
    assert not (tmp_path / "other").exists()


@pytest.mark.spec("TRACE-14")
def test_trace_command_reference_exit_status() -> None:
    out = io.StringIO()
    assert trace_command(save_world=2, load_world=3, reference=True, out=out) == 0
    assert "loaded values equal the saved ones: yes" in out.getvalue()
