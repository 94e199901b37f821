"""The reference writer (refdcp/reference/storage.py) on its own: it creates the checkpoint
directory and records the save's id in the metadata (REF-1, SAVE-1)."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

import pytest
import torch

import refdcp.reference
from refdcp.comm import FakeWorld, SingleRank
from refdcp.reference import ReferenceReader, ReferenceWriter
from refdcp.reference.save_planner import ReferenceSavePlanner

SINGLE_PATH = "mutation-kill tests pinning refdcp/reference itself (tests/MUTATION.md); they target the reference module, not an implementation choice"


@pytest.mark.spec("REF-1", "SAVE-1", "STORE-2")
def test_a_save_creates_missing_directories_and_records_its_id(tmp_path: Path) -> None:
    path = tmp_path / "a" / "b"
    FakeWorld(2).run(
        lambda c: refdcp.reference.save({"w": torch.ones(3)}, checkpoint_id=path, comm=c)
    )
    md = ReferenceReader(path).read_metadata()
    assert md.storage_meta is not None and md.storage_meta.checkpoint_id == str(path)
    token = md.storage_meta.save_id
    assert token and sorted(p.name for p in path.glob("*.distcp")) == [
        f"__0_0.{token}.distcp",
        f"__1_0.{token}.distcp",
    ]


def _save(path: Path, sd: dict[str, Any], **kw: Any) -> None:
    refdcp.reference.save(sd, storage_writer=ReferenceWriter(path, **kw), comm=SingleRank())


@pytest.mark.spec("STORE-50", "FMT-3", "REF-1")
def test_tensors_start_on_64_byte_boundaries_after_odd_sized_objects(tmp_path: Path) -> None:
    sd = {"o": "x" * 7, "a": torch.arange(3, dtype=torch.int8), "b": torch.ones(5), "p": [1]}
    _save(tmp_path, sd)
    md = ReferenceReader(tmp_path).read_metadata()
    offsets = {i.fqn: info.offset for i, info in md.storage_data.items()}
    for fqn in ("a", "b"):
        info = next(v for k, v in md.storage_data.items() if k.fqn == fqn)
        assert info.offset % 64 == 0 and (info.offset + info.refdcp_data_offset) % 64 == 0
    assert offsets["o"] < offsets["a"] and offsets["p"] < offsets["a"]  # objects first
    out: dict[str, Any] = {
        "o": "",
        "a": torch.zeros(3, dtype=torch.int8),
        "b": torch.zeros(5),
        "p": [0],
    }
    refdcp.reference.load(out, checkpoint_id=tmp_path, comm=SingleRank())
    assert out["o"] == sd["o"] and torch.equal(out["b"], sd["b"]) and out["p"] == [1]


@pytest.mark.spec("STORE-4", "REF-1")
@pytest.mark.parametrize("sync", [True, False])
def test_files_are_flushed_and_synced_only_when_asked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sync: bool
) -> None:
    synced: list[tuple[str, int]] = []
    real = os.fsync

    def spy(fd: int) -> None:
        st = os.fstat(fd)
        name = "<dir>" if stat.S_ISDIR(st.st_mode) else "file"
        synced.append((name, st.st_size))
        real(fd)

    monkeypatch.setattr(os, "fsync", spy)
    fds = len(os.listdir("/proc/self/fd"))
    _save(tmp_path, {"w": torch.ones(100)}, sync_files=sync)
    assert len(os.listdir("/proc/self/fd")) == fds  # every file and directory closed
    data = next(tmp_path.glob("*.distcp")).stat().st_size
    meta = (tmp_path / ".metadata").stat().st_size
    if sync:  # each file synced whole (flushed first), then the directory after the rename
        assert [s for s in synced if s[0] == "file"] == [("file", data), ("file", meta)]
        assert synced[-1][0] == "<dir>"
    else:
        assert synced == []
    umask = os.umask(0)
    os.umask(umask)
    for f in tmp_path.iterdir():
        assert stat.S_IMODE(f.stat().st_mode) == 0o644 & ~umask, f


class _Failing(ReferenceSavePlanner):
    def resolve_data(self, write_item: Any) -> Any:
        if write_item.index.fqn == "b":
            raise RuntimeError("no data for b")
        return super().resolve_data(write_item)


@pytest.mark.spec("STORE-31", "REF-8")
def test_a_failed_write_removes_the_data_file_it_began(tmp_path: Path) -> None:
    w = ReferenceWriter(tmp_path)
    w.set_up_storage_writer(True, rank=0)
    planner = _Failing(check_replicas=False)  # no checksums: resolve_data runs at write time
    planner.set_up_planner({"a": torch.ones(2), "b": torch.ones(2)}, None, True)
    plan = w.prepare_global_plan([w.prepare_local_plan(planner.create_local_plan())])[0]
    with pytest.raises(RuntimeError, match="no data for b"):
        w.write_data(plan, planner)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.spec("STORE-31", "REF-8")
def test_aborting_tolerates_files_already_gone(tmp_path: Path) -> None:
    w = ReferenceWriter(tmp_path)
    w.set_up_storage_writer(True, rank=0)
    planner = ReferenceSavePlanner()
    planner.set_up_planner({"a": torch.ones(2)}, None, True)
    plan = w.prepare_global_plan([w.prepare_local_plan(planner.create_local_plan())])[0]
    w.write_data(plan, planner)
    (data,) = tmp_path.glob("*.distcp")
    data.unlink()  # removed by someone else before the save failed
    w.abort_save()
    assert list(tmp_path.iterdir()) == [] and w.written == []


@pytest.mark.spec("LOAD-10", "REF-1")
def test_verify_true_refuses_items_without_a_checksum(tmp_path: Path) -> None:
    from refdcp.errors import CheckpointError
    from refdcp.reference import format as fmt

    _save(tmp_path, {"w": torch.arange(4.0)})
    md = ReferenceReader(tmp_path).read_metadata()
    for info in md.storage_data.values():
        del info.refdcp_crc32c
    (tmp_path / ".metadata").write_bytes(fmt.dump_metadata(md))
    out = {"w": torch.zeros(4)}
    with pytest.raises(CheckpointError, match="no checksum"):
        refdcp.reference.load(out, checkpoint_id=tmp_path, comm=SingleRank(), verify=True)
    for verify in (None, False):
        out = {"w": torch.zeros(4)}
        refdcp.reference.load(out, checkpoint_id=tmp_path, comm=SingleRank(), verify=verify)
        assert torch.equal(out["w"], torch.arange(4.0))


@pytest.mark.spec("LOAD-10", "INTEG-3", "REF-1")
def test_a_flipped_byte_is_caught_unless_verify_is_false(tmp_path: Path) -> None:
    from refdcp.errors import CheckpointError

    _save(tmp_path, {"w": torch.zeros(16, dtype=torch.uint8)})
    md = ReferenceReader(tmp_path).read_metadata()
    (info,) = md.storage_data.values()
    data = tmp_path / info.relative_path
    raw = bytearray(data.read_bytes())
    raw[info.offset + info.refdcp_data_offset + 3] ^= 1  # one byte of the tensor's values
    data.write_bytes(bytes(raw))
    for verify in (None, True):
        with pytest.raises(CheckpointError, match="checksum mismatch"):
            refdcp.reference.load(
                {"w": torch.zeros(16, dtype=torch.uint8)},
                checkpoint_id=tmp_path,
                comm=SingleRank(),
                verify=verify,
            )
    out = {"w": torch.zeros(16, dtype=torch.uint8)}
    refdcp.reference.load(out, checkpoint_id=tmp_path, comm=SingleRank(), verify=False)
    assert out["w"].tolist() == [0, 0, 0, 1] + [0] * 12  # read unchecked, as asked


@pytest.mark.spec("STORE-27", "REF-1")
def test_a_symlinked_checkpoint_file_is_refused(tmp_path: Path) -> None:
    from refdcp.storage import UnsafePathError

    ckpt = tmp_path / "c"
    _save(ckpt, {"w": torch.ones(2)})
    real = tmp_path / "elsewhere"
    (ckpt / ".metadata").rename(real)
    (ckpt / ".metadata").symlink_to(real)
    with pytest.raises(UnsafePathError, match="symbolic link"):
        ReferenceReader(ckpt).read_metadata()
