"""FileSystemWriter driven through faults and by hand: what each step leaves on disk
(STORE-4, STORE-29, STORE-31, STORE-50, STORE-57, STORE-60, SAVE-16, API-10; issue 28).

Each test drives refdcp's writer through ``refdcp.save``, torch's ``dcp.save`` (which
calls no ``abort_save``) or the StorageWriter protocol by hand, injects a fault at one
step (a short ``writev``, a failing rename, unlink or metadata dump, a failing data
write), and checks the files, locks, descriptors and commit status left behind.
"""

from __future__ import annotations

import contextlib
import gc
import io
import os
import random
import stat
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

import refdcp
from refdcp.errors import CheckpointError
from refdcp.planning import DefaultSavePlanner
from refdcp.storage import FileSystemReader, FileSystemWriter
from refdcp.storage.errors import CheckpointMovedError
from refdcp.storage.format import layout
from refdcp.storage.format.items import INPLACE_MIN_BYTES
from refdcp.storage.fs import filesystem as fs_module
from refdcp.storage.fs.commit_mark import declared
from refdcp.storage.metadata.safe import load_metadata

SINGLE_PATH = "mutation-kill tests pinning one module of the default path (tests/MUTATION.md); the behaviour runs on both in the shared suites"

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

MIB = 1 << 20


def _load(root: Path, like: dict[str, Any]) -> dict[str, Any]:
    out = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else None for k, v in like.items()}
    refdcp.load(out, storage_reader=FileSystemReader(root), no_dist=True)
    return out


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[k], b[k]) if isinstance(b[k], torch.Tensor) else a[k] == b[k] for k in b
    )


def _data_files(root: Path) -> list[str]:
    return sorted(n for n in os.listdir(root) if n.endswith(".distcp"))


def _by_hand(
    writer: FileSystemWriter,
    sd: dict[str, Any],
    *,
    coordinator: bool = True,
    finish: bool = True,
    **set_up: Any,
) -> tuple[list[WriteResult], Metadata]:
    """One save through the StorageWriter protocol, as one rank that is also its own
    coordinator for the global plan (its token and rank prefix)."""
    planner = DefaultSavePlanner()
    planner.set_up_planner(sd, is_coordinator=coordinator)
    writer.set_up_storage_writer(coordinator, **set_up)
    local = writer.prepare_local_plan(planner.create_local_plan())
    plans, metadata = planner.create_global_plan([local])
    plan = planner.finish_plan(writer.prepare_global_plan(plans)[0])
    results = writer.write_data(plan, planner).wait()
    if finish:
        writer.finish(metadata, [results])
    return results, metadata


# -- STORE-60: writeback of each batch of at least 4 MiB, never beyond what was written ----


def _writeback_log(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int, int, int]]:
    """(file name, offset, nbytes, the file's size at the call) of each writeback hint."""
    calls: list[tuple[str, int, int, int]] = []

    def record(fd: int, offset: int, nbytes: int) -> None:
        name = os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))
        calls.append((name, offset, nbytes, os.fstat(fd).st_size))

    monkeypatch.setattr(fs_module, "start_writeback", record)
    return calls


class _RawBytes(DefaultSavePlanner):
    """Hands the writer each BYTE_IO value's own bytes (not torch.save of the object), so
    an item's stored length is exactly the length chosen."""

    def __init__(self, sd: dict[str, Any]) -> None:
        super().__init__()
        self._raw = sd

    def resolve_data(self, write_item: Any) -> Any:
        if write_item.type == WriteItemType.BYTE_IO:
            return self._raw[write_item.index.fqn]
        return super().resolve_data(write_item)


@pytest.mark.spec("STORE-60")
@pytest.mark.parametrize("kind", ["tensors", "bytes"])
@pytest.mark.parametrize("item_bytes", [1 << 18, 1 << 17, 300_001, 100_003])
def test_writeback_starts_after_each_4_mib_batch_and_only_on_written_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str, item_bytes: int
) -> None:
    """Small items (write_small for tensors, the gathered writes of BYTE_IO items) totalling
    9 MiB: each hint covers the bytes after the previous one, at least 4 MiB and less than
    4 MiB plus one item, none past what the file holds at the call, and under 4 MiB are
    left unhanded at the end. Item sizes that divide 4 MiB put a batch exactly at 4 MiB."""
    calls = _writeback_log(monkeypatch)
    n = 9 * MIB // item_bytes + 1
    planner = DefaultSavePlanner()
    if kind == "tensors":
        sd: dict[str, Any] = {
            f"t{i}": torch.full((item_bytes,), i % 251, dtype=torch.uint8) for i in range(n)
        }
    else:
        sd = {f"b{i}": io.BytesIO(bytes([i % 251]) * item_bytes) for i in range(n)}
        planner = _RawBytes(sd)
    refdcp.save(sd, storage_writer=FileSystemWriter(tmp_path), planner=planner, no_dist=True)
    (name,) = _data_files(tmp_path)
    size = (tmp_path / name).stat().st_size
    info = load_metadata((tmp_path / ".metadata").read_bytes()).storage_data
    assert info is not None
    longest = max(i.length for i in info.values())  # one item's stored bytes, framing included
    handed = 0
    for file, offset, nbytes, at_call in calls:
        assert file == name
        assert offset == handed  # contiguous, from the start of the file
        assert 4 * MIB <= nbytes < 4 * MIB + longest
        assert offset + nbytes <= at_call  # only bytes already written
        handed += nbytes
    assert size - handed < 4 * MIB
    assert len(calls) >= 2


# -- a short writev anywhere: the file still holds every byte, in order ---------------------


@pytest.mark.spec("STORE-1", "STORE-51")
@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), big=st.sampled_from([0, 2 * MIB + 3, 5 * MIB]))
def test_short_writes_at_any_point_lose_no_byte(
    tmp_path_factory: pytest.TempPathFactory, seed: int, big: int
) -> None:
    """``os.writev`` writes a random prefix (at least one byte) of what it is given: the
    writer goes on from where each write stopped, in the gathered batches, the large
    parts written straight out and the checksummed pieces of a large item."""
    root = tmp_path_factory.mktemp("short")
    rnd = random.Random(seed)
    sd: dict[str, Any] = {
        f"s{i}": torch.arange(rnd.randint(1, 300), dtype=torch.float32) + i for i in range(12)
    }
    sd["blob"] = io.BytesIO(bytes(range(256)) * rnd.randint(1, 40))
    sd["odd"] = torch.arange(7, dtype=torch.int16)[::2]  # framed by torch.save, not write_small
    if big:
        sd["big"] = torch.arange(big // 4, dtype=torch.float32)
    real = os.writev

    def short(fd: int, buffers: Any) -> int:
        data = b"".join(bytes(memoryview(b).cast("B")) for b in buffers)
        if not data:
            return real(fd, buffers)
        return os.write(fd, data[: rnd.randint(1, len(data))])

    mp = pytest.MonkeyPatch()
    mp.setattr(os, "writev", short)
    try:
        refdcp.save(sd, storage_writer=FileSystemWriter(root), no_dist=True)
    finally:
        mp.undo()
    tensors = {k: v for k, v in sd.items() if isinstance(v, torch.Tensor)}
    assert _same(_load(root, tensors), tensors)


# -- STORE-4: the directory fsyncs, by descriptor and by path --------------------------------


@pytest.mark.spec("STORE-4", "STORE-57")
def test_every_created_directory_and_the_checkpoint_directory_are_fsynced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A save into ``a/b/c`` (none exists): the parent of each created directory is
    fsynced, and the checkpoint directory after the data files are written, before the
    rename and after it."""
    events: list[tuple[str, Any]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        st_ = os.fstat(fd)
        events.append(("dir" if stat.S_ISDIR(st_.st_mode) else "file", st_.st_ino))
        real_fsync(fd)

    def replace(*args: Any, **kwargs: Any) -> None:
        events.append(("replace", None))
        real_replace(*args, **kwargs)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    root = tmp_path / "a" / "b" / "c"
    refdcp.save({"w": torch.ones(3)}, storage_writer=FileSystemWriter(root), no_dist=True)
    ino = {p: p.stat().st_ino for p in (tmp_path, tmp_path / "a", tmp_path / "a" / "b", root)}
    dirs = [i for kind, i in events if kind == "dir"]
    for parent in (tmp_path, tmp_path / "a", tmp_path / "a" / "b"):
        assert ino[parent] in dirs, parent  # the new name in it survives a power loss
    at = events.index(("replace", None))
    before, after = events[:at], events[at + 1 :]
    assert ("dir", ino[root]) in after
    last_file = max(i for i, (kind, _) in enumerate(before) if kind == "file")  # the temp file
    first_file = min(i for i, (kind, _) in enumerate(before) if kind == "file")  # a data file
    assert ("dir", ino[root]) in before[last_file + 1 :]
    assert ("dir", ino[root]) in before[first_file + 1 : last_file]


# -- STORE-57: one descriptor of the directory per writer, closed when it is done with -----


def _descriptors_of(path: Path) -> int:
    real = os.path.realpath(path)
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # a descriptor closed while listing
            n += os.readlink(f"/proc/self/fd/{fd}") == real
    return n


@pytest.mark.spec("STORE-57")
def test_a_reused_writer_holds_one_descriptor_and_reset_closes_it(tmp_path: Path) -> None:
    gc.collect()
    writer = FileSystemWriter(tmp_path)
    for k in range(3):
        refdcp.save({"w": torch.full((3,), float(k))}, storage_writer=writer, no_dist=True)
        assert _descriptors_of(tmp_path) == 1  # the save's, not one per save
    writer.reset(tmp_path / "elsewhere")
    assert _descriptors_of(tmp_path) == 0
    assert torch.equal(_load(tmp_path, {"w": torch.ones(3)})["w"], torch.full((3,), 2.0))


# -- STORE-29 / STORE-31 under torch's dcp.save, which never calls abort_save --------------


class _FailingPlanner(DefaultSavePlanner):
    """Fails on resolving the item named ``bad``, after earlier items were written."""

    def resolve_data(self, write_item: Any) -> Any:
        if write_item.index.fqn == "bad":
            raise OSError(28, "injected: no space left")
        return super().resolve_data(write_item)


@pytest.mark.spec("STORE-29", "STORE-31")
@pytest.mark.parametrize("where", ["write", "commit"])
def test_a_failed_save_under_torch_leaves_no_files_and_frees_the_lock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """torch's dcp.save calls no abort_save: a coordinator whose data write fails, or whose
    commit rename fails, removes this save's files and frees the lock itself, while the
    failed writer is still alive; the earlier checkpoint stays loadable."""
    old = {"a": torch.arange(3.0)}
    refdcp.save(old, checkpoint_id=tmp_path, no_dist=True)
    kept = set(os.listdir(tmp_path))
    writer = FileSystemWriter(tmp_path, single_file_per_rank=False)
    sd = {"a": torch.ones(3), "z": torch.ones(5), "bad": torch.ones(2)}
    planner: DefaultSavePlanner = DefaultSavePlanner()
    if where == "write":
        planner = _FailingPlanner()
    else:

        def refuse(*args: Any, **kwargs: Any) -> None:
            raise OSError(5, "injected: rename failed")

        monkeypatch.setattr(os, "replace", refuse)
    with pytest.raises(BaseException, match="injected"):
        dcp.save(sd, storage_writer=writer, planner=planner, no_dist=True)
    monkeypatch.undo()
    assert set(os.listdir(tmp_path)) == kept  # no data, temp or lock file of the failed save
    assert _same(_load(tmp_path, old), old)
    refdcp.save(sd | {"bad": torch.zeros(2)}, checkpoint_id=tmp_path, no_dist=True)  # lock free
    del writer


@pytest.mark.spec("STORE-29")
def test_a_writer_dropped_while_holding_the_lock_frees_it(tmp_path: Path) -> None:
    writer = FileSystemWriter(tmp_path)
    writer.set_up_storage_writer(True)
    writer.prepare_local_plan(SavePlan([]))  # takes the lock; the save goes no further
    assert (tmp_path / ".metadata.lock").exists()
    del writer
    gc.collect()
    assert not (tmp_path / ".metadata.lock").exists()
    refdcp.save({"w": torch.ones(2)}, checkpoint_id=tmp_path, no_dist=True)


@pytest.mark.spec("STORE-31")
@pytest.mark.parametrize("committed_before", [False, True])
def test_a_non_coordinator_abort_removes_its_own_files_only(
    tmp_path: Path, committed_before: bool
) -> None:
    """A rank that is not the coordinator holds no lock: its abort_save removes the files it
    wrote once no live lock names the save, and never a file a committed .metadata names."""
    if committed_before:
        refdcp.save({"k": torch.arange(4.0)}, checkpoint_id=tmp_path, no_dist=True)
    kept = set(os.listdir(tmp_path))
    writer = FileSystemWriter(tmp_path, single_file_per_rank=False)
    _by_hand(
        writer, {"p": torch.ones(3), "q": torch.ones(2)}, coordinator=False, finish=False, rank=1
    )
    assert len(set(os.listdir(tmp_path)) - kept) == 2
    writer.abort_save()
    assert set(os.listdir(tmp_path)) == kept
    if committed_before:
        assert torch.equal(_load(tmp_path, {"k": torch.zeros(4)})["k"], torch.arange(4.0))


# -- SAVE-16: the commit status a failing finish declares ------------------------------------


class _Injected(Exception):
    pass


@pytest.mark.spec("SAVE-16", "STORE-1", "STORE-31")
@pytest.mark.parametrize("step", ["dump", "rename", "rename+unlink"])
def test_a_finish_failing_before_the_rename_declares_not_committed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, step: str
) -> None:
    """The metadata dump, the rename, or the rename and then the temp file's removal fail:
    the error raised is the injected one (the first that happened, or the removal's), marked
    committed=False; the earlier checkpoint is intact and the save left no file behind."""
    old = {"a": torch.arange(3.0)}
    refdcp.save(old, checkpoint_id=tmp_path, no_dist=True)
    kept = set(os.listdir(tmp_path))
    if step == "dump":

        def dump(md: Any) -> bytes:
            raise _Injected("dump")

        monkeypatch.setattr(fs_module, "dump_metadata", dump)
    else:

        def refuse(*args: Any, **kwargs: Any) -> None:
            raise _Injected("rename")

        monkeypatch.setattr(os, "replace", refuse)
    if step == "rename+unlink":
        real_unlink = os.unlink

        def unlink(path: Any, *args: Any, **kwargs: Any) -> None:
            if str(path).endswith(".tmp"):
                monkeypatch.setattr(os, "unlink", real_unlink)  # once: the abort then succeeds
                raise _Injected("unlink")
            real_unlink(path, *args, **kwargs)

        monkeypatch.setattr(os, "unlink", unlink)
    writer = FileSystemWriter(tmp_path)
    with pytest.raises(CheckpointError) as info:
        refdcp.save({"a": torch.ones(3)}, storage_writer=writer, no_dist=True)
    monkeypatch.undo()
    (failure,) = info.value.rank_failures.values()
    exc = failure.exception
    assert isinstance(exc, _Injected), exc
    assert str(exc) == {"dump": "dump", "rename": "rename", "rename+unlink": "unlink"}[step]
    assert declared(exc) is False
    assert info.value.committed is False
    assert set(os.listdir(tmp_path)) == kept
    assert _same(_load(tmp_path, old), old)


# -- API-10: torch's default for use_collectives --------------------------------------------


@pytest.mark.spec("API-10", "STORE-2")
def test_a_writer_set_up_with_a_rank_but_no_use_collectives_commits_the_global_metadata(
    tmp_path: Path,
) -> None:
    """torch 2.13's set_up_storage_writer defaults use_collectives to True: a writer told only
    its rank commits ``.metadata``, not a rank-local ``__{rank}.metadata``."""
    _by_hand(FileSystemWriter(tmp_path), {"w": torch.ones(2)}, rank=0)
    assert (tmp_path / ".metadata").exists()
    assert not (tmp_path / "__0.metadata").exists()


# -- STORE-50: only large framed tensors are padded; everything else is packed --------------


@pytest.mark.spec("STORE-50")
@pytest.mark.parametrize("order", [0, 1])
def test_only_large_framed_tensors_start_after_padding(tmp_path: Path, order: int) -> None:
    """Byte items of any size (a large one included) and small tensors follow the item before
    them with no gap; each framed tensor of at least 1 MiB starts 64-byte aligned."""
    sd: dict[str, Any] = {
        "b_odd": io.BytesIO(b"x" * 1001),
        "b_large": io.BytesIO(bytes(range(256)) * (INPLACE_MIN_BYTES // 256 + 3)),
        "t_small": torch.arange(5, dtype=torch.int16),
        "t_large": torch.arange(INPLACE_MIN_BYTES // 4 + 1, dtype=torch.float32),
        "t_odd": torch.arange(33, dtype=torch.int8)[::2],
    }
    if order:
        sd = dict(reversed(list(sd.items())))
    refdcp.save(sd, storage_writer=FileSystemWriter(tmp_path), no_dist=True)
    md = load_metadata((tmp_path / ".metadata").read_bytes())
    assert md.storage_data is not None
    items = sorted((i.offset, i.length, k.fqn) for k, i in md.storage_data.items())
    end = 0
    for offset, length, fqn in items:
        if fqn == "t_large":
            assert offset % 64 == 0 and 0 <= offset - end < 64
        else:
            assert offset == end, fqn
        end = offset + length


# -- STORE-57 / STORE-58: a path re-pointed after the directory was opened -------------------


@pytest.mark.spec("STORE-57", "STORE-58")
def test_a_path_re_pointed_after_prepare_leaves_the_new_target_untouched(tmp_path: Path) -> None:
    """The path is a symbolic link re-pointed between ``prepare_local_plan`` and
    ``write_data``: every file goes to the directory the save opened, which then loads,
    and the link's new target holds nothing."""
    first, second, link = tmp_path / "first", tmp_path / "second", tmp_path / "link"
    first.mkdir()
    second.mkdir()
    link.symlink_to(first)

    class Repointing(DefaultSavePlanner):
        def create_global_plan(self, plans: Any) -> Any:
            link.unlink()
            link.symlink_to(second)
            return super().create_global_plan(plans)

    sd = {"w": torch.arange(6.0)}
    with pytest.raises(CheckpointError) as info:
        refdcp.save(sd, storage_writer=FileSystemWriter(link), planner=Repointing(), no_dist=True)
    (failure,) = info.value.rank_failures.values()
    assert isinstance(failure.exception, CheckpointMovedError)
    assert os.listdir(second) == []
    assert _same(_load(first, sd), sd)


# -- STORE-32: a rank-local save reclaims its own rank's orphans, and only those ------------


@pytest.mark.spec("STORE-32", "API-9")
def test_a_rank_local_save_reclaims_only_its_own_ranks_orphans(tmp_path: Path) -> None:
    """Orphans of killed rank-local saves of ranks 0 and 1 (a data file and a metadata temp
    file each): rank 0's rank-local save removes its own two and leaves rank 1's."""
    token = layout.new_save_token()
    mine = [layout.data_file_name("__0_", 0, token), layout.metadata_temp_name(0, token)]
    theirs = [layout.data_file_name("__1_", 0, token), layout.metadata_temp_name(1, token)]
    for name in mine + theirs:
        (tmp_path / name).write_bytes(b"orphan")
    refdcp.save({"a": torch.ones(2)}, checkpoint_id=tmp_path, no_dist=True, use_collectives=False)
    left = set(os.listdir(tmp_path))
    assert left.isdisjoint(mine)
    assert set(theirs) <= left
    assert "__0.metadata" in left
