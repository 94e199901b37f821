"""Reliability: loads racing saves into the same directory (LOAD-22).

Issue 26 item 3: a load whose data file a concurrent save's commit had just
reclaimed raised a bare ``FileNotFoundError``. Now it raises
``CheckpointReplacedError`` saying the checkpoint was replaced while loading
(or ``CorruptionError`` when a file is missing with no new commit), and a load
that returns holds the values of one committed checkpoint, never a mix.
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
from refdcp.storage import CheckpointReplacedError, CorruptionError, FileSystemWriter

warnings.filterwarnings("ignore", message="torch.distributed is disabled")

_KEYS = 6


def _state(v: float) -> dict[str, Any]:
    sd: dict[str, Any] = {f"t{k}": torch.full((64,), v + k) for k in range(_KEYS)}
    sd["step"] = int(v)
    return sd


def _empty() -> dict[str, Any]:
    sd: dict[str, Any] = {f"t{k}": torch.full((64,), -1.0) for k in range(_KEYS)}
    sd["step"] = -1
    return sd


def _save(impl: ModuleType, path: Path, v: float) -> None:
    # several data files, so a load opens them one after another
    impl.save(_state(v), storage_writer=FileSystemWriter(path, thread_count=3), no_dist=True)


def _one_checkpoint(sd: dict[str, Any]) -> float:
    """The value of the one checkpoint ``sd`` was loaded from; fails on a mix."""
    v = float(sd["step"])
    for k in range(_KEYS):
        assert torch.equal(sd[f"t{k}"], torch.full((64,), v + k)), (k, v, sd[f"t{k}"][:2])
    return v


def _cause(err: CheckpointError) -> BaseException:
    (failure, *_) = err.rank_failures.values()
    return failure.exception


@pytest.mark.spec("LOAD-22")
@pytest.mark.parametrize("world", [1, 2])
def test_a_save_committing_during_a_load_is_reported_as_a_replaced_checkpoint(
    tmp_path: Path, world: int
) -> None:
    """A full overwriting save runs between the load's metadata read and its reads."""
    # single path: the reference does not compare the metadata its ranks read (REF-8, LOAD-23)
    _save(refdcp, tmp_path, 1.0)
    done = threading.Event()

    def fault(i: int, action: Action) -> None:
        if action.step == Step.READ and not done.is_set():
            done.set()
            _save(refdcp, tmp_path, 2.0)

    def rank_main(comm: FakeComm) -> Any:
        dest = _empty()
        try:
            refdcp.load(dest, checkpoint_id=tmp_path, comm=comm, fault=fault)
        except CheckpointError as exc:
            return exc, dest
        return None, dest

    for err, dest in FakeWorld(world, timeout=60).run(rank_main):
        assert isinstance(err, CheckpointError), "the load must not return"
        cause = _cause(err)
        assert isinstance(cause, CheckpointReplacedError), cause
        assert not isinstance(cause, FileNotFoundError)
        assert "replaced while this load ran" in str(cause) and "load again" in str(cause)
        assert dest["step"] == -1  # LOAD-5: nothing applied
    out = _empty()
    refdcp.load(out, checkpoint_id=tmp_path, verify=True, no_dist=True)
    assert _one_checkpoint(out) == 2.0  # loading again reads the new checkpoint


class _KeepsOldFiles(FileSystemWriter):
    """A writer whose post-commit clean-up has not run yet: the window in which a rank
    that read the old ``.metadata`` could still open the old data files."""

    def _clean_up(self, storage_md: Any) -> None:
        return None


@pytest.mark.spec("LOAD-23")
def test_ranks_that_read_different_commits_refuse_before_reading(tmp_path: Path) -> None:
    """Rank 0 reads ``.metadata`` before a commit and rank 1 after it, while the old data
    files still exist: without the check each rank would load a different checkpoint."""
    # single path: the reference does not compare the metadata its ranks read (REF-8, LOAD-23)
    refdcp.save(_state(1.0), storage_writer=_KeepsOldFiles(tmp_path), no_dist=True)
    first_read = threading.Event()

    def fault(rank: int, action: Action) -> None:
        if rank == 0 and action.step == Step.LOCAL_PLAN:
            first_read.set()  # rank 0 has read the metadata (set-up is done)
        if rank == 1 and action.step == Step.SET_UP:
            assert first_read.wait(30)
            refdcp.save(_state(2.0), storage_writer=_KeepsOldFiles(tmp_path), no_dist=True)

    def rank_main(comm: FakeComm) -> Any:
        dest = _empty()
        try:
            refdcp.load(
                dest, checkpoint_id=tmp_path, comm=comm, fault=lambda i, a: fault(comm.rank, a)
            )
        except CheckpointError as exc:
            return exc, dest
        return None, dest

    for err, dest in FakeWorld(2, timeout=60).run(rank_main):
        assert isinstance(err, CheckpointError), dest["step"]
        cause = _cause(err)
        assert isinstance(cause, CheckpointReplacedError), cause
        assert "2 different committed" in str(cause)
        assert torch.equal(dest["t0"], torch.full((64,), -1.0))  # nothing was read


@pytest.mark.spec("LOAD-22")
def test_a_missing_data_file_without_a_new_commit_is_corruption(
    tmp_path: Path, impl: ModuleType
) -> None:
    _save(impl, tmp_path, 1.0)
    victim = sorted(n for n in os.listdir(tmp_path) if n.endswith(".distcp"))[-1]
    os.unlink(tmp_path / victim)
    with pytest.raises(CheckpointError) as err:
        impl.load(_empty(), checkpoint_id=tmp_path, no_dist=True)
    cause = _cause(err.value)
    assert isinstance(cause, CorruptionError) and not isinstance(cause, FileNotFoundError)
    assert "data file missing" in str(cause) and victim in str(cause)


@pytest.mark.spec("LOAD-22", "STORE-2")
def test_loads_racing_overwriting_saves_return_one_checkpoint_or_say_it_was_replaced(
    tmp_path: Path,
) -> None:
    """Stress, bounded in count: a saver thread overwrites the checkpoint 40 times while
    loads run back to back; each load returns one committed checkpoint's values or
    raises CheckpointReplacedError, nothing else."""
    # single path: the reference does not compare the metadata its ranks read (REF-8, LOAD-23)
    _save(refdcp, tmp_path, 0.0)
    stop = threading.Event()
    saver_errors: list[BaseException] = []

    def saver() -> None:
        try:
            for v in range(1, 41):
                if stop.is_set():
                    return
                _save(refdcp, tmp_path, float(v))
        except BaseException as exc:  # reported below
            saver_errors.append(exc)
        finally:
            stop.set()

    thread = threading.Thread(target=saver, name="test-saver")
    thread.start()
    outcomes: dict[str, int] = {"loaded": 0, "replaced": 0}
    seen: list[float] = []
    try:
        for _ in range(2000):
            if stop.is_set():
                break
            dest = _empty()
            try:
                refdcp.load(dest, checkpoint_id=tmp_path, no_dist=True)
            except CheckpointError as exc:
                cause = _cause(exc)
                assert isinstance(cause, CheckpointReplacedError), repr(cause)
                outcomes["replaced"] += 1
                continue
            seen.append(_one_checkpoint(dest))
            outcomes["loaded"] += 1
    finally:
        stop.set()
        thread.join(60)
    assert not thread.is_alive() and not saver_errors, saver_errors
    assert outcomes["loaded"] > 0, outcomes
    assert seen == sorted(seen)  # each load saw a checkpoint no older than the last one
