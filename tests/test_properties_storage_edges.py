"""Storage and staging edge cases found by the seed-2 mutation check (STORE-*, INTEG-*, STAGE-*)."""

from __future__ import annotations

import os
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.planner import WriteItem

import refdcp
import refdcp.storage.fs.filesystem as fs
from refdcp.errors import RefdcpError
from refdcp.planning import DefaultSavePlanner
from refdcp.staging.buffer_pool import BufferPool
from refdcp.staging.tree import layout_of
from refdcp.storage.errors import CorruptionError
from refdcp.storage.fs.filesystem import FileSystemReader, FileSystemWriter


def _data_file(path: Path) -> Path:
    (f,) = [p for p in path.iterdir() if p.name.endswith(".distcp")]
    return f


@pytest.mark.spec("STORE-13", "INTEG-3")
@pytest.mark.parametrize("verify", [False, True])
def test_a_truncated_data_file_names_where_the_data_ends(tmp_path: Path, verify: bool) -> None:
    # single path: the fast reader's own messages and spies (offsets, in-place reads)
    refdcp.save(
        {"w": torch.arange(64, dtype=torch.int64)}, checkpoint_id=str(tmp_path), no_dist=True
    )
    f = _data_file(tmp_path)
    size = f.stat().st_size
    os.truncate(f, size - 100)
    dest = {"w": torch.zeros(64, dtype=torch.int64)}
    with pytest.raises(BaseException) as err:
        refdcp.load(dest, checkpoint_id=str(tmp_path), no_dist=True, verify=verify)
    text = str(err.value)
    assert ("truncated" in text and "'w'" in text) or "w" in text
    if not verify:
        assert f"offset={size - 100}" in text, text  # where the file ends
    causes = [e for e in _chain(err.value) if isinstance(e, CorruptionError)]
    assert causes, text


def _chain(e: BaseException) -> list[BaseException]:
    out = [e]
    for f in getattr(e, "rank_failures", {}).values():
        out.append(f.exception)
    return out


@pytest.mark.spec("STORE-11")
@pytest.mark.parametrize("dtype", [torch.uint8, torch.bool, torch.int8])
def test_one_byte_tensors_are_read(tmp_path: Path, dtype: torch.dtype, impl: ModuleType) -> None:
    src = torch.tensor([1], dtype=dtype)
    impl.save({"b": src, "s": src.reshape(())}, checkpoint_id=str(tmp_path), no_dist=True)
    dest = {"b": torch.zeros(1, dtype=dtype), "s": torch.zeros((), dtype=dtype)}
    impl.load(dest, checkpoint_id=str(tmp_path), no_dist=True)
    assert torch.equal(dest["b"], src) and torch.equal(dest["s"], src.reshape(()))


@pytest.mark.spec("STORE-12", "INTEG-3")
def test_verified_partial_reads_take_only_their_box(tmp_path: Path, impl: ModuleType) -> None:
    full = torch.arange(8.0)
    impl.save({"x": full}, checkpoint_id=str(tmp_path), no_dist=True)
    for off, n in [(0, 4), (4, 4), (2, 3)]:
        part = refdcp.LocalShards((8,), [((off,), torch.zeros(n))])
        impl.load({"x": part}, checkpoint_id=str(tmp_path), no_dist=True, verify=True)
        assert torch.equal(part.chunks[0][1], full[off : off + n])


class _NotATensorPlanner(DefaultSavePlanner):
    def resolve_data(self, write_item: WriteItem) -> Any:
        data = super().resolve_data(write_item)
        return [1, 2] if write_item.index.fqn == "w" else data


@pytest.mark.spec("STORE-12", "STORE-8")
def test_writer_arguments_and_item_kinds_are_checked(tmp_path: Path, impl: ModuleType) -> None:
    with pytest.raises(ValueError, match="thread_count must be >= 1"):
        FileSystemWriter(tmp_path, thread_count=0)
    with pytest.raises((refdcp.CheckpointError, RefdcpError)) as err:
        impl.save(
            {"w": torch.ones(2)},
            checkpoint_id=str(tmp_path / "a"),
            planner=_NotATensorPlanner(),
            no_dist=True,
        )
    assert "w: tensor item resolved to" in str(err.value)


@pytest.mark.spec("STORE-4")
def test_the_metadata_temp_file_is_fsynced_before_the_rename(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # single path: the fast FileSystemWriter's fsync before its rename
    events: list[str] = []
    real_fsync, real_replace = fs.os.fsync, fs.os.replace

    def fsync(fd: int) -> None:
        events.append("fsync " + os.path.basename(os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    monkeypatch.setattr(fs.os, "fsync", fsync)
    monkeypatch.setattr(
        fs.os,
        "replace",
        lambda a, b, **kw: (events.append("replace"), real_replace(a, b, **kw))[1],
    )
    refdcp.save(
        {"w": torch.ones(2)},
        storage_writer=FileSystemWriter(tmp_path, sync_files=True),
        no_dist=True,
    )
    tmp_syncs = [
        i for i, e in enumerate(events) if e.startswith("fsync .metadata.") and e.endswith(".tmp")
    ]
    assert tmp_syncs and tmp_syncs[-1] < events.index("replace"), events


@pytest.mark.spec("STAGE-5", "STAGE-11")
def test_pool_arguments_and_failed_copies(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="max_sets must be at least 1"):
        BufferPool(max_sets=0)
    pool = BufferPool(max_sets=1, wait_timeout=0.0)
    layout = layout_of({"w": torch.zeros(3)})
    lease = pool.acquire(layout)
    pool.copy_failed(lease)  # the buffers return to the pool at once
    again = pool.acquire(layout)  # no timeout: the set is free again, and reused
    assert again.bset is lease.bset and pool.allocations == 1
    pool.copy_done(again)
    again.release()
    pool.close()


@pytest.mark.spec("INTEG-2")
def test_a_key_that_looks_like_the_trailer_does_not_confuse_the_metadata_check(
    tmp_path: Path,
    impl: ModuleType,
) -> None:
    key = "#refdcp-crc32c:00000000\n"
    impl.save({key: torch.ones(2), "x": 1}, checkpoint_id=str(tmp_path), no_dist=True)
    md = FileSystemReader(tmp_path).read_metadata()
    assert key in md.state_dict_metadata


@pytest.mark.spec("STORE-13")
def test_a_file_shrinking_under_a_read_is_named_not_delivered(tmp_path: Path) -> None:
    """The size pre-check can race with a writer truncating the file: the read checks again."""
    f = tmp_path / "d"
    f.write_bytes(b"12345678")
    fd = os.open(f, os.O_RDONLY)
    try:
        with pytest.raises(CorruptionError) as err:
            fs._read_exact(fd, memoryview(bytearray(10)), 5, "w", "d")
    finally:
        os.close(fd)
    assert err.value.offset == 8 and "truncated" in str(err.value)


@pytest.mark.spec("INTEG-3")
def test_verifying_a_short_blob_says_truncated(tmp_path: Path) -> None:
    # single path: the fast FileSystemReader and verify_blob; the save is a fixture
    from refdcp.storage.format.items import verify_blob

    refdcp.save({"w": torch.arange(16.0)}, checkpoint_id=str(tmp_path), no_dist=True)
    md = FileSystemReader(tmp_path).read_metadata()
    assert md.storage_data is not None
    (info,) = md.storage_data.values()
    blob = _data_file(tmp_path).read_bytes()[info.offset : info.offset + info.length]
    verify_blob(blob, info, "w", "f")  # intact
    with pytest.raises(CorruptionError, match="item truncated") as err:
        verify_blob(blob[:-1], info, "w", "f")
    assert err.value.offset == info.offset


@pytest.mark.spec("STORE-1", "STORE-2")
def test_save_and_load_leave_no_file_descriptor_open(tmp_path: Path, impl: ModuleType) -> None:
    def open_fds() -> set[str]:
        return set(os.listdir("/proc/self/fd"))

    sd = {f"t{i}": torch.arange(4.0) + i for i in range(5)}
    impl.save(sd, checkpoint_id=str(tmp_path / "warm"), no_dist=True)  # pools and threads start
    before = open_fds()
    impl.save(sd, checkpoint_id=str(tmp_path / "c"), no_dist=True)
    impl.load({k: torch.zeros(4) for k in sd}, checkpoint_id=str(tmp_path / "c"), no_dist=True)
    assert open_fds() <= before


@pytest.mark.spec("STORE-12")
def test_a_read_of_a_chunk_missing_from_the_metadata_is_an_error(tmp_path: Path) -> None:
    # single path: the fast FileSystemReader and verify_blob; the save is a fixture
    from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

    refdcp.save({"w": torch.arange(4.0)}, checkpoint_id=str(tmp_path), no_dist=True)
    reader = FileSystemReader(tmp_path)
    md = reader.read_metadata()
    assert md.storage_data is not None
    (key,) = md.storage_data
    md.state_dict_metadata["w"].chunks.clear()  # storage says the chunk exists, tensors do not
    reader.set_up_storage_reader(md, True)
    req = ReadItem(
        type=LoadItemType.TENSOR,
        dest_index=key,
        dest_offsets=torch.Size([0]),
        storage_index=key,
        storage_offsets=torch.Size([0]),
        lengths=torch.Size([4]),
    )
    with pytest.raises(RefdcpError, match="is not in the metadata"):
        reader.read_data(LoadPlan([req]), None)  # type: ignore[arg-type]


@pytest.mark.spec("STORE-13")
def test_a_short_read_of_an_object_is_named_not_delivered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # single path: the fast reader's own messages and spies (offsets, in-place reads)
    refdcp.save({"obj": {"lr": 0.5}}, checkpoint_id=str(tmp_path), no_dist=True)
    real = fs._pread_into
    monkeypatch.setattr(fs, "_pread_into", lambda fd, view, off: real(fd, view[:-1], off))
    dest: dict[str, Any] = {"obj": {"lr": 0.0}}
    with pytest.raises(BaseException, match="data file truncated"):
        refdcp.load(dest, checkpoint_id=str(tmp_path), no_dist=True)
    assert dest == {"obj": {"lr": 0.0}}
