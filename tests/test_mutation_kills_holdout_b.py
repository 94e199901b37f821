"""Storage behaviours the hold-out mutation sample (seed 3) found unchecked (issue 13).

A short ``writev`` of a data file is resumed exactly where it stopped; the
error for a truncated data file names the offset of the cut; a writer that
prepares its plan twice in one save does not refuse itself its own lock;
``locate_tensor_data`` reads an archive of any name in place and refuses a
stored member too short for the tensor it describes.
"""

from __future__ import annotations

import io
import os
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.planner import SavePlan

import refdcp
import refdcp.storage.fs.filesystem as fs
from refdcp.errors import CheckpointError
from refdcp.storage import FileSystemReader, FileSystemWriter
from refdcp.storage.errors import CorruptionError
from refdcp.storage.fs.inplace import locate_tensor_data

SINGLE_PATH = "mutation-kill tests pinning one module of the default path (tests/MUTATION.md); the behaviour runs on both in the shared suites"

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

PAD = 4096 + 17  # the item starts this far into its file


def _put(tmp_path: Path, item: bytes) -> int:
    p = tmp_path / "item.bin"
    p.write_bytes(b"\xab" * PAD + item + b"trailing junk")
    return os.open(p, os.O_RDONLY)


# -- a short writev is resumed at the byte where it stopped (_FileOut._write_all) -----------


@pytest.mark.spec("STORE-1")
def test_a_short_writev_of_queued_parts_is_resumed_where_it_stopped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = os.writev
    cut: list[int] = []

    def short_writev(fd: int, parts: Any) -> int:
        views = [memoryview(p).cast("B") for p in parts]
        if len(views) < 2:
            return real(fd, views)
        # write the first part whole and one byte of the second, as a disk nearly full may
        cut.append(len(views[0]) + 1)
        return real(fd, [views[0], views[1][:1]])

    monkeypatch.setattr(fs.os, "writev", short_writev)
    state = {
        "a": torch.arange(7, dtype=torch.float32),
        "b": torch.arange(100, 113, dtype=torch.int64),
        "c": torch.tensor([True, False, True]),
        "obj": {"lr": 0.25, "name": "x" * 40},
    }
    refdcp.save(state, checkpoint_id=str(tmp_path), no_dist=True)
    monkeypatch.undo()
    assert cut, "the fake writev was never given two parts: the test checks nothing"
    out: dict[str, Any] = {
        "a": torch.zeros(7),
        "b": torch.zeros(13, dtype=torch.int64),
        "c": torch.zeros(3, dtype=torch.bool),
        "obj": {"lr": 0.0, "name": ""},
    }
    refdcp.load(out, checkpoint_id=str(tmp_path), no_dist=True, verify=True)
    for k in ("a", "b", "c"):
        assert torch.equal(out[k], state[k]), k
    assert out["obj"] == state["obj"]


# -- a truncated data file is named at the offset of the cut (FileSystemReader._read_item) --


@pytest.mark.spec("LOAD-10")
def test_a_short_read_of_an_object_names_the_offset_where_it_stopped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    refdcp.save({"a": {"x": list(range(50))}}, checkpoint_id=str(tmp_path), no_dist=True)
    md = FileSystemReader(str(tmp_path)).read_metadata()
    assert md.storage_data is not None
    ((index, info),) = md.storage_data.items()
    real = fs._pread_into
    monkeypatch.setattr(fs, "_pread_into", lambda fd, view, off: real(fd, view[:-1], off))
    with pytest.raises(CheckpointError) as err:
        refdcp.load({"a": {"x": None}}, checkpoint_id=str(tmp_path), no_dist=True)
    causes = [e for e, _ in err.value.failures.values()]
    assert len(causes) == 1 and isinstance(causes[0], CorruptionError)
    e = causes[0]
    assert (e.fqn, e.file) == (index.fqn, info.relative_path)
    assert e.offset == info.offset + info.length - 1


# -- the writer's lock: preparing the plan again in one save keeps the lock (STORE-29) ----


@pytest.mark.spec("STORE-29")
@pytest.mark.parametrize("rank_local", [False, True])
def test_preparing_the_plan_twice_in_one_save_does_not_refuse_its_own_lock(
    tmp_path: Path, rank_local: bool
) -> None:
    writer = FileSystemWriter(tmp_path)
    if rank_local:
        writer.set_up_storage_writer(False, rank=2, use_collectives=False)
        lock = tmp_path / "__2.metadata.lock"
    else:
        writer.set_up_storage_writer(True)
        lock = tmp_path / ".metadata.lock"
    writer.prepare_local_plan(SavePlan([]))
    assert lock.exists()
    writer.prepare_local_plan(SavePlan([]))  # not a ConcurrentSaveError against itself
    assert lock.exists()
    writer.abort_save()
    assert not lock.exists()  # the one lock it holds is freed
    other = FileSystemWriter(tmp_path)
    other.set_up_storage_writer(not rank_local, rank=2, use_collectives=not rank_local)
    other.prepare_local_plan(SavePlan([]))  # the directory is free for the next save
    other.abort_save()


# -- locate_tensor_data (STORE-40) --------------------------------------------------------


@pytest.mark.spec("STORE-40")
@pytest.mark.parametrize("stem", ["w", "weights_of_layer_one", "archive"])
def test_an_archive_of_any_name_is_read_in_place(tmp_path: Path, stem: str) -> None:
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    p = tmp_path / f"{stem}.pt"
    torch.save(t, p)  # torch names the archive's records after the file: "{stem}/data.pkl"
    item = p.read_bytes()
    assert f"{stem}/data.pkl" in zipfile.ZipFile(io.BytesIO(item)).namelist()
    fd = _put(tmp_path, item)
    try:
        at = locate_tensor_data(fd, PAD, len(item), t.dtype, t.shape)
        assert at is not None
        assert os.pread(fd, t.nbytes, PAD + at) == t.numpy().tobytes()
    finally:
        os.close(fd)


def _short_member(item: bytes, keep: int) -> bytes:
    """The archive with its storage member cut to its first ``keep`` bytes, still stored."""
    src = zipfile.ZipFile(io.BytesIO(item))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as dst:
        for info in src.infolist():
            data = src.read(info)
            if "/data/" in info.filename and not info.filename.endswith(".pkl"):
                data = data[:keep]
            dst.writestr(info.filename, data, compress_type=zipfile.ZIP_STORED)
    return out.getvalue()


@pytest.mark.spec("STORE-40")
@pytest.mark.parametrize("keep", [0, 4, 47])
def test_a_storage_member_shorter_than_its_tensor_is_not_read_in_place(
    tmp_path: Path, keep: int
) -> None:
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)  # 48 bytes
    buf = io.BytesIO()
    torch.save(t, buf)
    whole = _short_member(buf.getvalue(), 48)
    fd = _put(tmp_path, whole)
    try:  # the rewritten archive itself is read in place: only the cut below matters
        assert locate_tensor_data(fd, PAD, len(whole), t.dtype, t.shape) is not None
    finally:
        os.close(fd)
    item = _short_member(buf.getvalue(), keep)
    fd = _put(tmp_path, item)
    try:  # elements past the member's end would be the next records' bytes
        assert locate_tensor_data(fd, PAD, len(item), t.dtype, t.shape) is None
    finally:
        os.close(fd)
