"""FileSystemWriter's steps around the writes, driven by hand: an abort while the save is
still live, ``reset`` of a writer holding the lock, a plan that names no directory, a
``finish`` with no opened directory, the words of ``CheckpointMovedError``, and the
``.metadata`` stamp a reader puts in its load plan (STORE-29, STORE-31, STORE-57,
STORE-58, LOAD-23, INTEG-2; issue 28).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.planner import SavePlan

import refdcp
from refdcp.crc.kernel import crc32c
from refdcp.errors import CheckpointError
from refdcp.planning import DefaultLoadPlanner, DefaultSavePlanner
from refdcp.storage import FileSystemReader, FileSystemWriter
from refdcp.storage.errors import CheckpointMovedError, ConcurrentSaveError
from refdcp.storage.format import layout
from refdcp.storage.fs import cleanup
from refdcp.storage.fs import filesystem as fs_module

SINGLE_PATH = "mutation-kill tests pinning one module of the default path (tests/MUTATION.md); the behaviour runs on both in the shared suites"

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _load(root: Path, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {k: torch.zeros_like(v) for k, v in like.items()}
    refdcp.load(out, storage_reader=FileSystemReader(root), no_dist=True)
    return out


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in b)


def _data_files(root: Path) -> set[str]:
    return {n for n in os.listdir(root) if n.endswith(".distcp")}


# -- STORE-31: a rank without the lock waits for the save to end before removing ----------


@pytest.mark.spec("STORE-31")
def test_a_lockless_rank_keeps_its_files_while_the_save_is_live(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two ranks of one save, by hand: rank 1 (no lock) wrote its files, the coordinator
    still holds the save's lock. Rank 1's ``abort_save`` removes nothing while that lock is
    live (the coordinator may yet commit them); once the coordinator has aborted and freed
    the lock, nothing of the save is left."""
    real_wait = cleanup.wait_until_not_live

    def quick(root: Path, token: str, timeout: float, *, dir_fd: int | None = None) -> bool:
        return real_wait(root, token, min(timeout, 0.05), dir_fd=dir_fd)

    monkeypatch.setattr(fs_module, "wait_until_not_live", quick)
    sd0, sd1 = {"a": torch.ones(3)}, {"b": torch.arange(4.0), "c": torch.ones(2)}
    coord, other = (FileSystemWriter(tmp_path, single_file_per_rank=False) for _ in range(2))
    p0, p1 = DefaultSavePlanner(), DefaultSavePlanner()
    p0.set_up_planner(sd0, is_coordinator=True)
    p1.set_up_planner(sd1, is_coordinator=False)
    coord.set_up_storage_writer(True, rank=0)
    other.set_up_storage_writer(False, rank=1)
    local0 = coord.prepare_local_plan(p0.create_local_plan())
    local1 = other.prepare_local_plan(p1.create_local_plan())
    plans, _ = p0.create_global_plan([local0, local1])
    plans = coord.prepare_global_plan(plans)
    other.write_data(p1.finish_plan(plans[1]), p1).wait()
    written = _data_files(tmp_path)
    assert len(written) == 2
    other.abort_save()
    assert _data_files(tmp_path) == written  # the save is live: its files stay
    coord.abort_save()
    assert _data_files(tmp_path) == set()
    assert not (tmp_path / ".metadata.lock").exists()


# -- STORE-29: reset forgets the last save, lock included -----------------------------------


@pytest.mark.spec("STORE-29")
def test_reset_frees_the_lock_of_the_save_it_forgets(tmp_path: Path) -> None:
    """A coordinator took the lock of ``first`` and its save went no further; ``reset`` to
    another location ends that save: ``first`` is free for another writer's save at once,
    while the reset writer is still alive."""
    first = tmp_path / "first"
    writer = FileSystemWriter(first)
    writer.set_up_storage_writer(True)
    writer.prepare_local_plan(SavePlan([]))
    assert (first / ".metadata.lock").exists()
    with pytest.raises(CheckpointError) as info:
        refdcp.save({"w": torch.ones(2)}, checkpoint_id=first, no_dist=True)
    (failure,) = info.value.rank_failures.values()
    assert isinstance(failure.exception, ConcurrentSaveError)  # held, as STORE-29 says
    writer.reset(tmp_path / "second")
    assert not (first / ".metadata.lock").exists()
    sd = {"w": torch.arange(3.0)}
    refdcp.save(sd, checkpoint_id=first, no_dist=True)
    assert _same(_load(first, sd), sd)
    del writer


# -- STORE-57: a plan naming no directory has nothing to compare ----------------------------


class _PlainPlans(DefaultSavePlanner):
    """Gives the writer its final plan without the coordinator's storage data (the
    prefix, token and directory), as a lone writer's plan may come."""

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        return SavePlan(super().finish_plan(new_plan).items)


@pytest.mark.spec("STORE-57")
def test_a_plan_that_names_no_directory_is_written_by_the_lone_writer(tmp_path: Path) -> None:
    """A final plan with no storage data names no coordinator's directory: the writer that
    opened the directory writes it there as ``__0_`` under its own token, and it commits
    and loads."""
    sd = {"a": torch.arange(5.0), "b": torch.ones(2, 2)}
    refdcp.save(sd, storage_writer=FileSystemWriter(tmp_path), planner=_PlainPlans(), no_dist=True)
    assert all(n.startswith("__0_") for n in _data_files(tmp_path))
    assert _same(_load(tmp_path, sd), sd)


# -- STORE-58: finish with no opened directory; the words of the error ----------------------


@pytest.mark.spec("STORE-58", "STORE-1")
def test_a_finish_by_a_writer_that_opened_no_directory_commits_by_path(tmp_path: Path) -> None:
    """The data written by one writer object, ``finish`` called on another that never ran
    ``prepare_local_plan`` (it opened no directory): it commits by path and has no opened
    directory to compare the path with, so it raises nothing."""
    sd = {"a": torch.arange(4.0)}
    planner = DefaultSavePlanner()
    planner.set_up_planner(sd, is_coordinator=True)
    first = FileSystemWriter(tmp_path)
    first.set_up_storage_writer(True)
    local = first.prepare_local_plan(planner.create_local_plan())
    plans, metadata = planner.create_global_plan([local])
    plan = planner.finish_plan(first.prepare_global_plan(plans)[0])
    results = first.write_data(plan, planner).wait()
    second = FileSystemWriter(tmp_path)
    second.set_up_storage_writer(True)
    second.finish(metadata, [results])
    first.reset()  # the save is over: its lock is freed
    assert _same(_load(tmp_path, sd), sd)


@pytest.mark.spec("STORE-58")
@pytest.mark.parametrize("after", ["renamed", "replaced"])
def test_the_moved_error_says_what_the_path_names_now(tmp_path: Path, after: str) -> None:
    """The directory is renamed away (the path then names nothing) or renamed and replaced
    by a new empty directory, between the writes and the commit: the committed error says
    which, and where the checkpoint is."""
    root, moved = tmp_path / "ckpt", tmp_path / "moved"

    class Moving(DefaultSavePlanner):
        def finish_plan(self, new_plan: SavePlan) -> SavePlan:
            root.rename(moved)
            if after == "replaced":
                root.mkdir()
            return super().finish_plan(new_plan)

    sd = {"w": torch.arange(6.0)}
    with pytest.raises(CheckpointError) as info:
        refdcp.save(sd, storage_writer=FileSystemWriter(root), planner=Moving(), no_dist=True)
    (failure,) = info.value.rank_failures.values()
    exc = failure.exception
    assert isinstance(exc, CheckpointMovedError)
    message = str(exc)
    assert str(moved) in message
    if after == "renamed":
        assert "now names nothing" in message
        assert not root.exists()
    else:
        assert "now names another directory, which this save left untouched" in message
        assert os.listdir(root) == []
    assert _same(_load(moved, sd), sd)


# -- LOAD-23 / INTEG-2: the stamp in a reader's load plan is the file's size and CRC-32C ----


@pytest.mark.spec("LOAD-23", "INTEG-2")
@pytest.mark.parametrize("trailer", [True, False])
def test_the_load_plan_carries_the_size_and_crc32c_of_the_metadata_read(
    tmp_path: Path, trailer: bool
) -> None:
    """With refdcp's trailer the stamp's CRC is the trailer's, which is the CRC-32C of the
    pickle before it; without one (the trailer cut off) it is the CRC-32C of the file."""
    sd = {"w": torch.arange(3.0)}
    if trailer:
        refdcp.save(sd, checkpoint_id=tmp_path, no_dist=True)
    else:  # written by torch: no trailer
        dcp.save(sd, storage_writer=dcp.FileSystemWriter(tmp_path), no_dist=True)
    data = (tmp_path / ".metadata").read_bytes()
    assert (b"#refdcp-crc32c:" in data) == trailer
    body = data[: data.rindex(b"#refdcp-crc32c:")] if trailer else data
    reader = FileSystemReader(tmp_path)
    metadata = reader.read_metadata()
    reader.set_up_storage_reader(metadata, True)
    planner = DefaultLoadPlanner()
    planner.set_up_planner({"w": torch.zeros(3)}, metadata, True)
    plan = reader.prepare_local_plan(planner.create_local_plan())
    stamp = plan.storage_data
    assert isinstance(stamp, layout.MetadataStamp)
    expected = crc32c(body)
    assert (stamp.size, stamp.crc) == (len(data), expected)
    if trailer:
        assert data.endswith(b"%08x\n" % expected)
