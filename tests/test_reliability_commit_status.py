"""Reliability: the commit status a rank reports is true, or says "unknown" (SAVE-15, SAVE-16).

Issue 11 item 6: when the coordinator died after its commit, when the
directory fsync failed after the rename, or when a writer's ``finish`` raised
after committing, the other ranks raised ``committed=False`` although the
path loaded the new checkpoint.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

import refdcp
import refdcp.storage.fs.filesystem as fs
from refdcp.comm import FakeWorld
from refdcp.comm.fake import FakeComm
from refdcp.driver import Fault, SaveContext, simulate
from refdcp.errors import CheckpointError
from refdcp.planning import DefaultSavePlanner
from refdcp.protocol import SAVE, Kind
from refdcp.storage import FileSystemWriter
from refdcp.storage.format import layout
from refdcp.storage.fs.commit_mark import mark

warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def _state(rank: int) -> dict[str, Any]:
    return {"w": torch.full((4,), 7.0), f"own{rank}": torch.arange(3.0), "step": 5}


def _loads(path: Path, impl: ModuleType = refdcp) -> bool:
    if not (path / ".metadata").exists():
        return False
    dest = {"w": torch.zeros(4), "own0": torch.zeros(3), "step": 0}
    impl.load(dest, checkpoint_id=str(path), no_dist=True)
    return bool(dest["step"] == 5)


def _contexts(path: Path, world: int) -> list[SaveContext]:
    return [
        SaveContext(
            rank=r,
            world_size=world,
            coordinator=r == 0,
            state_dict=_state(r),
            writer=FileSystemWriter(str(path), sync_files=False),
            planner=DefaultSavePlanner(),
        )
        for r in range(world)
    ]


@pytest.mark.spec("SAVE-15", "COMM-61")
@pytest.mark.parametrize("world", [2, 3])
def test_a_rank_dying_at_any_point_never_yields_a_false_status(tmp_path: Path, world: int) -> None:
    """Simulator: kill every rank before every action; each survivor's status is true or None."""
    # single path: refdcp.tools.simulate runs the default path's step bodies and storage
    clean = simulate(SAVE, _contexts(tmp_path / "clean", world))
    unknown = 0
    for victim in range(world):
        for index in range(len(clean.actions[victim])):
            path = tmp_path / f"r{victim}i{index}"
            fault = Fault(victim, index, SystemExit("killed"), dies=True)
            res = simulate(SAVE, _contexts(path, world), fault=fault)
            truly = _loads(path)
            for rank, out in enumerate(res.results):
                if rank == victim:
                    continue
                if not isinstance(out, CheckpointError):
                    assert truly, (victim, index, rank)  # returned: committed
                    continue
                assert out.committed in (truly, None), (victim, index, rank, out.committed, truly)
                assert f"rank {victim}" in str(out), (victim, index, rank)  # names the culprit
                if out.committed is None:
                    unknown += 1
                    assert "commit status UNKNOWN" in str(out)
    assert unknown > 0  # the coordinator dying after its commit is among the cases


def _broadcast_index(actions: list[Any]) -> int:
    return [(a.kind, a.phase) for a in actions].index((Kind.BROADCAST, "broadcast_outcome"))


@pytest.mark.spec("SAVE-15")
def test_simulator_coordinator_dies_after_commit(tmp_path: Path) -> None:
    # single path: refdcp.tools.simulate runs the default path's step bodies and storage
    clean = simulate(SAVE, _contexts(tmp_path / "clean", 2))
    index = _broadcast_index(clean.actions[0])
    fault = Fault(0, index, SystemExit("killed"), dies=True)
    res = simulate(SAVE, _contexts(tmp_path / "c", 2), fault=fault)
    assert _loads(tmp_path / "c")
    err = res.results[1]
    assert isinstance(err, CheckpointError) and err.committed is None
    assert "may have committed" in str(err) and "rank 0" in str(err)


class _DiesAtOutcome:
    """A FakeComm whose coordinator dies (SystemExit) instead of broadcasting the outcome."""

    def __init__(self, comm: FakeComm) -> None:
        self._comm = comm

    def __getattr__(self, name: str) -> Any:
        return getattr(self._comm, name)

    def broadcast(self, obj: Any, *, timeout: float | None = None) -> Any:
        if self._comm.rank == 0 and hasattr(obj, "storage_data"):  # the committed Metadata
            raise SystemExit("coordinator killed after its commit")
        return self._comm.broadcast(obj, timeout=timeout)


@pytest.mark.spec("SAVE-15", "COMM-61")
def test_fakeworld_coordinator_dies_after_commit(tmp_path: Path, impl: ModuleType) -> None:
    def rank_main(comm: FakeComm) -> Any:
        wrapped: Any = _DiesAtOutcome(comm)
        return impl.save(_state(comm.rank), checkpoint_id=str(tmp_path), comm=wrapped)

    out = FakeWorld(2, timeout=30).run(rank_main, return_exceptions=True)
    assert isinstance(out[0], SystemExit)
    err = out[1]
    assert isinstance(err, CheckpointError)
    assert err.committed is None  # was False: a lie, the path loads the new checkpoint
    assert "UNKNOWN" in str(err) and 0 in err.rank_failures
    assert _loads(tmp_path, impl)


def _failing_dir_fsync(after_rename: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the directory fsync of finish: the one before the rename, or the one after it."""
    real = fs._fsync_dir

    def fsync_dir(path: Path) -> None:
        names = os.listdir(path)
        before = any(layout.is_metadata_temp(n) for n in names)  # the temp awaits its rename
        after = ".metadata" in names and not before
        if after if after_rename else before:
            raise OSError(5, "injected directory fsync failure")
        real(path)

    monkeypatch.setattr(fs, "_fsync_dir", fsync_dir)


@pytest.mark.spec("SAVE-9", "SAVE-16")
def test_directory_fsync_failing_after_the_rename_reports_committed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # single path: the commit mark of SAVE-16 is the fast FileSystemWriter's declaration
    _failing_dir_fsync(after_rename=True, monkeypatch=monkeypatch)

    def rank_main(comm: FakeComm) -> Any:
        return refdcp.save(_state(comm.rank), checkpoint_id=str(tmp_path), comm=comm)

    errors = FakeWorld(2, timeout=30).run(rank_main, return_exceptions=True)
    for err in errors:
        assert isinstance(err, CheckpointError) and err.committed is True, err
        assert "WAS committed" in str(err) and "directory fsync" in str(err)
    monkeypatch.undo()
    assert _loads(tmp_path)


@pytest.mark.spec("SAVE-16")
def test_directory_fsync_failing_before_the_rename_reports_not_committed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # single path: the commit mark of SAVE-16 is the fast FileSystemWriter's declaration
    _failing_dir_fsync(after_rename=False, monkeypatch=monkeypatch)
    with pytest.raises(CheckpointError) as info:
        refdcp.save(_state(0), checkpoint_id=str(tmp_path), no_dist=True)
    assert info.value.committed is False
    assert not (tmp_path / ".metadata").exists()


def _raises_after_commit(self: Any, metadata: Any, results: Any) -> None:
    """A third-party-like writer's finish: commits, then raises (declares nothing)."""
    type(self).__mro__[1].finish(self, metadata, results)
    raise RuntimeError("post-commit bookkeeping failed")


def _declares_commit(self: Any, metadata: Any, results: Any) -> None:
    """A writer's finish that says it had committed when it raised."""
    type(self).__mro__[1].finish(self, metadata, results)
    exc = RuntimeError("upload of the index failed after the commit")
    mark(exc, True)
    raise exc


@pytest.mark.spec("SAVE-15", "SAVE-16")
@pytest.mark.parametrize(
    ("finish", "expected"), [(_raises_after_commit, None), (_declares_commit, True)]
)
def test_finish_raising_after_commit(
    tmp_path: Path, finish: Any, expected: bool | None, impl: ModuleType
) -> None:
    writer_cls = type("Writer", (impl.FileSystemWriter,), {"finish": finish})

    def rank_main(comm: FakeComm) -> Any:
        w = writer_cls(str(tmp_path), sync_files=False)
        return impl.save(_state(comm.rank), storage_writer=w, comm=comm)

    errors = FakeWorld(3, timeout=30).run(rank_main, return_exceptions=True)
    for err in errors:
        assert isinstance(err, CheckpointError) and err.committed is expected, err
        assert err.steps == {0: "commit"}
    text = str(errors[1])
    assert ("StorageWriter.finish raised on rank 0" in text) == (expected is None)
    assert _loads(tmp_path, impl)
    again = CheckpointError.__reduce__(errors[2])
    assert again[1][2] is expected  # survives pickling (ERR-3)


@pytest.mark.spec("STORE-33", "STORE-31", "PROTO-13")
@pytest.mark.parametrize("rank", [0, 1])
def test_a_fault_after_the_commit_never_removes_a_committed_file_of_the_reference_writer(
    tmp_path: Path, impl: ModuleType, rank: int
) -> None:
    """A rank whose save fails after the commit (here: after its last action) cleans up with
    the writer's abort_save; with the reference writer, under either save, the files the
    committed .metadata names stay, and the checkpoint loads."""
    from refdcp.reference import ReferenceWriter

    def fault(index: int, action: Any) -> None:
        if action.kind is Kind.RETURN:
            raise RuntimeError("after the last action")

    def run(comm: FakeComm) -> Any:
        hook = fault if comm.rank == rank else None
        writer = ReferenceWriter(tmp_path)
        try:
            return impl.save(_state(comm.rank), storage_writer=writer, comm=comm, fault=hook)
        except CheckpointError as exc:
            return exc

    out = FakeWorld(2).run(run)
    assert isinstance(out[rank], CheckpointError) and out[rank].committed is True
    assert not isinstance(out[1 - rank], BaseException)
    for loader in (impl, refdcp):
        dest = {"w": torch.zeros(4), "own0": torch.zeros(3), "own1": torch.zeros(3), "step": 0}
        loader.load(dest, checkpoint_id=str(tmp_path), no_dist=True)  # every rank's file
        assert dest["step"] == 5 and torch.equal(dest["own1"], torch.arange(3.0))
