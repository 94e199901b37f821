"""Filesystem storage paths the first mutation run found untested (STORE-*, INTEG-2)."""

from __future__ import annotations

import os
import random
import warnings
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.distributed.checkpoint.filesystem import _split_by_size_and_type
from torch.distributed.checkpoint.planner import SavePlan, WriteItem

import refdcp
import refdcp.storage.fs.filesystem as fs
from refdcp.errors import RefdcpError
from refdcp.planning import DefaultSavePlanner
from refdcp.planning.local_plan import save_items
from refdcp.storage.errors import CorruptionError
from refdcp.storage.fs.filesystem import FileSystemReader, FileSystemWriter, split_into_buckets
from refdcp.storage.metadata.safe import dump_metadata, load_metadata

DTYPES = [torch.float32, torch.float16, torch.int8, torch.int64, torch.bool, torch.complex64]


@st.composite
def item_lists(draw: st.DrawFn) -> list[WriteItem]:
    rng = random.Random(draw(st.integers(0, 2**31 - 1)))
    sd: dict[str, Any] = {}
    for i in range(draw(st.integers(0, 12))):
        if rng.random() < 0.3:
            sd[f"o{i}"] = {"v": i}
        else:
            shape = tuple(rng.randint(0, 5) for _ in range(rng.randint(0, 2)))
            sd[f"t{i}"] = torch.zeros(shape, dtype=rng.choice(DTYPES))
    return save_items(sd)


@pytest.mark.spec("STORE-8")
@given(item_lists(), st.integers(1, 5))
def test_buckets_are_torchs(items: list[WriteItem], n: int) -> None:
    ours = split_into_buckets(n, items)
    theirs = _split_by_size_and_type(n, list(items))
    assert [[i.index for i in b] for b in ours] == [[i.index for i in b] for b in theirs]


def _round_trip(impl: ModuleType, tmp: Path, sd: dict[str, Any], **writer: Any) -> dict[str, Any]:
    """Save with the fast FileSystemWriter's ``writer`` options, or with ``impl``'s own writer."""
    if writer:
        impl.save(sd, storage_writer=FileSystemWriter(tmp, **writer), no_dist=True)
    else:
        impl.save(sd, checkpoint_id=str(tmp), no_dist=True)
    dest = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else None for k, v in sd.items()}
    impl.load(dest, checkpoint_id=str(tmp), no_dist=True)
    return dest


@pytest.mark.spec("STORE-8", "STORE-2")
def test_more_small_items_in_one_file_than_writev_takes_at_once(tmp_path: Path) -> None:
    # single path: the fast FileSystemWriter's writev batching
    sd = {f"t{i}": torch.tensor([i], dtype=torch.int32) for i in range(2500)}
    back = _round_trip(refdcp, tmp_path, sd, thread_count=1, single_file_per_rank=True)
    assert all(int(back[k].item()) == i for i, k in enumerate(sd))


@pytest.mark.spec("STORE-8", "STORE-2")
def test_short_writes_are_resumed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # single path: the fast FileSystemWriter's writev batching
    real = os.writev

    def short(fd: int, views: list[Any]) -> int:  # the kernel may write less than asked
        return real(fd, [memoryview(views[0]).cast("B")[:3]])

    monkeypatch.setattr(fs.os, "writev", short)
    sd = {f"t{i}": torch.arange(i + 5, dtype=torch.float32) for i in range(6)}
    back = _round_trip(refdcp, tmp_path, sd, thread_count=1)
    assert all(torch.equal(back[k], v) for k, v in sd.items())


@pytest.mark.spec("STORE-2", "STORE-9")
def test_without_collectives_each_rank_names_its_own_files(tmp_path: Path) -> None:
    from torch.distributed.checkpoint.filesystem import _StoragePrefix

    w = FileSystemWriter(tmp_path)
    w.set_up_storage_writer(False, rank=3, use_collectives=False)
    assert w.prepare_local_plan(SavePlan([])).storage_data == _StoragePrefix("__3_")
    w.set_up_storage_writer(False, rank=3, use_collectives=True)
    assert w.prepare_local_plan(SavePlan([])).storage_data is None  # the coordinator assigns it
    w.set_up_storage_writer(False, use_collectives=False)
    assert w.prepare_local_plan(SavePlan([])).storage_data is None


@pytest.mark.spec("STORE-1")
def test_saving_creates_missing_parent_directories_and_plain_file_modes(
    tmp_path: Path, impl: ModuleType
) -> None:
    deep = tmp_path / "a" / "b" / "c"
    back = _round_trip(impl, deep, {"w": torch.ones(3)})
    assert torch.equal(back["w"], torch.ones(3))
    for p in deep.iterdir():
        assert p.stat().st_mode & 0o111 == 0, p  # no file is executable


class _StrBytesPlanner(DefaultSavePlanner):
    def resolve_data(self, write_item: WriteItem) -> Any:
        data = super().resolve_data(write_item)
        return "not bytes" if write_item.index.fqn == "obj" else data


@pytest.mark.spec("STORE-12")
def test_bytes_item_that_is_not_bytes_is_an_error_naming_the_key(
    tmp_path: Path, impl: ModuleType
) -> None:
    with pytest.raises((refdcp.CheckpointError, RefdcpError)) as err:
        impl.save({"obj": 5}, checkpoint_id=str(tmp_path), planner=_StrBytesPlanner(), no_dist=True)
    assert "obj: BYTE_IO data must be io.BytesIO" in str(err.value)


@pytest.mark.spec("STORE-1", "STORE-3")
def test_a_failed_rename_leaves_no_temp_file_and_no_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # single path: monkeypatches the fast FileSystemWriter's rename
    def refuse(a: Any, b: Any, **kw: Any) -> None:
        raise OSError("rename refused")

    monkeypatch.setattr(fs.os, "replace", refuse)
    with pytest.raises(refdcp.CheckpointError):
        refdcp.save({"w": torch.ones(2)}, checkpoint_id=str(tmp_path), no_dist=True)
    names = [p.name for p in tmp_path.iterdir()]
    assert ".metadata" not in names and not any("tmp" in n for n in names), names


@pytest.mark.spec("STORE-4")
def test_sync_files_fsyncs_the_directory_after_the_commit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # single path: the fast FileSystemWriter's fsync order and stale-file removal (REF-8)
    order: list[str] = []
    real_replace, real_sync = fs.os.replace, fs._fsync_dir
    monkeypatch.setattr(
        fs.os, "replace", lambda a, b, **kw: (order.append("replace"), real_replace(a, b, **kw))[1]
    )
    monkeypatch.setattr(fs, "_fsync_dir", lambda p: (order.append("fsync_dir"), real_sync(p))[1])
    refdcp.save(
        {"w": torch.ones(2)},
        storage_writer=FileSystemWriter(tmp_path, sync_files=True),
        no_dist=True,
    )
    # after the data files, before the rename and after it (one rank)
    assert order == ["fsync_dir", "fsync_dir", "replace", "fsync_dir"], order


@pytest.mark.spec("STORE-5")
def test_a_stale_file_that_cannot_be_removed_is_a_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # single path: the fast FileSystemWriter's fsync order and stale-file removal (REF-8)
    refdcp.save({"w": torch.ones(2)}, checkpoint_id=str(tmp_path), no_dist=True)

    real_unlink = fs.os.unlink

    def refuse(path: Any, *args: Any, **kwargs: Any) -> None:
        if str(path).endswith(".distcp"):  # the stale data file; lock files still go
            raise OSError("busy")
        real_unlink(path, *args, **kwargs)

    monkeypatch.setattr(fs.os, "unlink", refuse)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        refdcp.save(
            {"w": torch.zeros(2)},
            storage_writer=FileSystemWriter(tmp_path, overwrite=True),
            no_dist=True,
        )
    assert any("could not remove" in str(w.message) for w in seen)


@pytest.mark.spec("STORE-11", "STORE-12")
def test_reads_into_destinations_the_fast_path_cannot_take(
    tmp_path: Path, impl: ModuleType
) -> None:
    """torch's planner resolves to the destination itself: non-contiguous, or another dtype."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner as TorchLoadPlanner

    src = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    impl.save({"a": src, "b": src, "c": src}, checkpoint_id=str(tmp_path), no_dist=True)
    noncontig = torch.zeros(6, 4).t()  # a non-contiguous view of the right shape
    cast = torch.zeros(4, 6, dtype=torch.float64)  # another dtype
    plain = torch.zeros(4, 6)  # the fast path
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(
            {"a": noncontig, "b": cast, "c": plain},
            storage_reader=FileSystemReader(tmp_path),
            planner=TorchLoadPlanner(),
            no_dist=True,
        )
    assert (
        torch.equal(noncontig, src) and torch.equal(cast, src.double()) and torch.equal(plain, src)
    )


@pytest.mark.spec("INTEG-2")
def test_a_metadata_checksum_mismatch_names_offset_zero(tmp_path: Path, impl: ModuleType) -> None:
    impl.save({"w": torch.ones(2)}, checkpoint_id=str(tmp_path), no_dist=True)
    md = FileSystemReader(tmp_path).read_metadata()
    data = bytearray(dump_metadata(md))
    data[5] ^= 0xFF
    with pytest.raises(CorruptionError) as err:
        load_metadata(bytes(data))
    assert err.value.offset == 0 and "checksum" in str(err.value)


@pytest.mark.spec("STORE-6")
def test_without_collectives_rank_zeros_metadata_marks_a_committed_checkpoint(
    tmp_path: Path,
) -> None:
    """Without collectives each rank commits ``__{rank}.metadata``: rank 1 is refused by its own
    committed file, not by rank 0's (the round-1 code checked ``__0.metadata`` on every rank)."""
    from refdcp.storage.errors import CheckpointExistsError
    from refdcp.storage.format import layout

    (tmp_path / layout.rank_metadata_name(0)).write_bytes(b"x")
    w = FileSystemWriter(tmp_path, overwrite=False)
    w.set_up_storage_writer(False, rank=1, use_collectives=False)
    w.prepare_local_plan(SavePlan([]))  # rank 0's file does not block rank 1
    (tmp_path / layout.rank_metadata_name(1)).write_bytes(b"x")
    w = FileSystemWriter(tmp_path, overwrite=False)
    w.set_up_storage_writer(False, rank=1, use_collectives=False)
    with pytest.raises(CheckpointExistsError):
        w.prepare_local_plan(SavePlan([]))
    w = FileSystemWriter(tmp_path, overwrite=False)
    w.set_up_storage_writer(False, rank=1, use_collectives=True)  # only .metadata counts then
    w.prepare_local_plan(SavePlan([]))


@pytest.mark.spec("STORE-7", "SAVE-1")
def test_storage_meta_names_the_path_and_this_saves_id(tmp_path: Path) -> None:
    w = FileSystemWriter(tmp_path)
    meta = w.storage_meta()
    assert (
        meta is not None and str(meta.checkpoint_id) == str(tmp_path) and meta.save_id == w.save_id
    )
    w.set_up_storage_writer(True)
    again = w.storage_meta()
    assert again is not None and again.save_id == w.save_id != meta.save_id


@pytest.mark.spec("STORE-8", "STORE-2")
def test_more_object_items_in_one_file_than_writev_takes_at_once(tmp_path: Path) -> None:
    """Objects (BYTE_IO items) go through the general write path: its parts are flushed before
    the iovec count exceeds what one writev takes."""
    # single path: the fast FileSystemWriter's writev batching
    sd: dict[str, Any] = {f"o{i}": i for i in range(2500)}
    back = _round_trip(refdcp, tmp_path, sd, thread_count=1, single_file_per_rank=True)
    assert [back[k] for k in sd] == list(range(2500))
