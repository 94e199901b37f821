"""Reliability: a save commits in the directory it wrote to (STORE-57, STORE-58).

Issue 26 item 4: when the checkpoint path (a symbolic link, or a directory
renamed by another process) was re-pointed between the writes and ``finish``,
the data files went to the directory the save started in and ``.metadata`` to
whatever the path named at commit time: the save reported success, the path
did not load. Here every rank resolves the directory once and works relative
to its descriptor; a path re-pointed mid-save never yields a reported success
that does not load, and the error says where the checkpoint is.
"""

from __future__ import annotations

import os
import threading
import warnings
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

import refdcp
from refdcp.comm import FakeWorld
from refdcp.comm.fake import FakeComm
from refdcp.errors import CheckpointError
from refdcp.protocol.machine import Action
from refdcp.protocol.names import Step
from refdcp.storage import CheckpointMovedError, FileSystemWriter
from refdcp.storage.format import layout

warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def _state(rank: int, v: float) -> dict[str, Any]:
    return {"w": torch.full((8,), v), f"own{rank}": torch.full((3,), v + rank), "step": int(v)}


def _loaded(path: Path, world: int, impl: ModuleType = refdcp) -> float:
    """The value a checkpoint at ``path`` holds, checked whole (``verify=True``)."""
    dest: dict[str, Any] = {"w": torch.zeros(8), "step": 0}
    dest.update({f"own{r}": torch.zeros(3) for r in range(world)})
    impl.load(dest, checkpoint_id=path, verify=True, no_dist=True)
    v = float(dest["w"][0])
    assert dest["step"] == int(v)
    for r in range(world):
        assert torch.equal(dest[f"own{r}"], torch.full((3,), v + r))
    return v


def _failure(err: BaseException) -> BaseException:
    assert isinstance(err, CheckpointError), err
    (failure, *_) = err.rank_failures.values()
    return failure.exception


def _save_all(
    path: Path, world: int, v: float, fault: Any = None, impl: ModuleType = refdcp
) -> list[Any]:
    def rank_main(comm: FakeComm) -> Any:
        return impl.save(
            _state(comm.rank, v),
            checkpoint_id=path,
            comm=comm,
            fault=(lambda i, a: fault(comm.rank, a)) if fault is not None else None,
        )

    return FakeWorld(world, timeout=60).run(rank_main, return_exceptions=True)


def _before_commit(action_hook: Any) -> Any:
    def fault(rank: int, action: Action) -> None:
        if action.step == Step.COMMIT and rank == 0:
            action_hook()

    return fault


@pytest.mark.spec("STORE-57", "STORE-58")
@pytest.mark.parametrize("world", [1, 2, 3])
def test_a_symlink_re_pointed_before_finish_commits_where_the_data_is(
    tmp_path: Path, world: int
) -> None:
    # single path: STORE-57/58 resolve the directory once, the fast FileSystemWriter's descriptor
    a, b, link = tmp_path / "a", tmp_path / "b", tmp_path / "ckpt"
    a.mkdir()
    b.mkdir()
    os.symlink(a, link)
    assert not any(isinstance(r, BaseException) for r in _save_all(link, world, 1.0))
    _save_all(b, world, 5.0)  # b holds a checkpoint of its own
    b_files = {n: (b / n).read_bytes() for n in os.listdir(b)}

    def re_point() -> None:
        os.unlink(link)
        os.symlink(b, link)

    results = _save_all(link, world, 2.0, _before_commit(re_point))
    for out in results:  # never a reported success: the path does not name the new checkpoint
        assert isinstance(out, CheckpointError) and out.committed is True, out
    moved = _failure(results[0])
    assert isinstance(moved, CheckpointMovedError)
    assert str(a) in str(moved) and str(link) in str(moved)
    assert _loaded(a, world) == 2.0  # committed where the data is
    assert {n: (b / n).read_bytes() for n in os.listdir(b)} == b_files  # b untouched
    assert _loaded(link, world) == 5.0  # the path names b, whose checkpoint is b's own


@pytest.mark.spec("STORE-57", "STORE-58")
@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("replaced_by", ["nothing", "an empty directory"])
def test_a_directory_renamed_before_finish_commits_in_it_and_says_where(
    tmp_path: Path, world: int, replaced_by: str
) -> None:
    # single path: STORE-57/58 resolve the directory once, the fast FileSystemWriter's descriptor
    path, moved_to = tmp_path / "ckpt", tmp_path / "elsewhere"
    _save_all(path, world, 1.0)

    def rename() -> None:
        os.rename(path, moved_to)
        if replaced_by != "nothing":
            path.mkdir()

    results = _save_all(path, world, 2.0, _before_commit(rename))
    for out in results:
        assert isinstance(out, CheckpointError) and out.committed is True, out
    moved = _failure(results[0])
    assert isinstance(moved, CheckpointMovedError) and str(moved_to) in str(moved)
    assert _loaded(moved_to, world) == 2.0
    if replaced_by == "nothing":
        assert not path.exists()
    else:
        assert os.listdir(path) == []  # the save wrote nothing where the path points now
    names = os.listdir(moved_to)
    assert not any(n.endswith(".tmp") or n.endswith(".lock") for n in names), names
    assert len({n.split(".")[1] for n in names if n.endswith(".distcp")}) == 1  # one save's data


class _RePointsAfterOpening(FileSystemWriter):
    """Rank 0 re-points the symlink right after it opened the directory; the other ranks
    open theirs only then, so they open another directory than the coordinator did."""

    def __init__(self, path: Path, target: Path, opened: threading.Event) -> None:
        super().__init__(path, sync_files=False)
        self.target, self.opened = target, opened

    def prepare_local_plan(self, plan: Any) -> Any:
        if self.is_coordinator:
            out = super().prepare_local_plan(plan)
            os.unlink(self.path)
            os.symlink(self.target, self.path)
            self.opened.set()
            return out
        assert self.opened.wait(30)
        return super().prepare_local_plan(plan)


@pytest.mark.spec("STORE-57")
@pytest.mark.parametrize("world", [2, 3])
def test_ranks_that_opened_another_directory_refuse_to_write(tmp_path: Path, world: int) -> None:
    # single path: STORE-57/58 resolve the directory once, the fast FileSystemWriter's descriptor
    a, b, link = tmp_path / "a", tmp_path / "b", tmp_path / "ckpt"
    a.mkdir()
    b.mkdir()
    os.symlink(a, link)
    _save_all(a, world, 1.0)
    a_files = {n: (a / n).read_bytes() for n in os.listdir(a)}
    opened = threading.Event()

    def rank_main(comm: FakeComm) -> Any:
        writer = _RePointsAfterOpening(link, b, opened)
        return refdcp.save(_state(comm.rank, 2.0), storage_writer=writer, comm=comm)

    results = FakeWorld(world, timeout=60).run(rank_main, return_exceptions=True)
    for out in results:
        assert isinstance(out, CheckpointError) and out.committed is False, out
    failures = {r: f.exception for r, f in results[0].rank_failures.items()}
    assert set(failures) == set(range(1, world))
    assert all(isinstance(e, CheckpointMovedError) for e in failures.values()), failures
    assert os.listdir(b) == []  # the ranks that opened b wrote nothing there
    assert {n: (a / n).read_bytes() for n in os.listdir(a)} == a_files  # a as it was
    assert _loaded(a, world) == 1.0


@pytest.mark.spec("STORE-57")
@pytest.mark.parametrize("world", [1, 3])
def test_a_symlinked_path_left_alone_saves_and_loads_as_usual(
    tmp_path: Path, world: int, impl: ModuleType
) -> None:
    a, link = tmp_path / "a", tmp_path / "ckpt"
    a.mkdir()
    os.symlink(a, link)
    for v in (1.0, 2.0):
        results = _save_all(link, world, v, impl=impl)
        assert not any(isinstance(r, BaseException) for r in results), results
        assert _loaded(link, world, impl) == v
    assert os.path.islink(link) and (a / layout.METADATA_NAME).is_file()


@pytest.mark.spec("STORE-57")
def test_a_used_writer_pickles_without_its_descriptor(tmp_path: Path) -> None:
    """A writer sent to another process (async_save's process executor) carries no
    descriptor number that would mean another file there; it saves again as usual."""
    # single path: STORE-57/58 resolve the directory once, the fast FileSystemWriter's descriptor
    import pickle

    writer = FileSystemWriter(tmp_path, sync_files=False)
    refdcp.save(_state(0, 1.0), storage_writer=writer, no_dist=True)
    copy = pickle.loads(pickle.dumps(writer))
    assert copy._dir is None or copy._dir.fd is None
    refdcp.save(_state(0, 2.0), storage_writer=copy, no_dist=True)
    assert _loaded(tmp_path, 1) == 2.0
