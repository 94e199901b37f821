"""async_save with the process executor (spec/staging.md ASYNC-7)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint import FileSystemWriter

from refdcp.api import load
from refdcp.asyncsave.process_executor import shutdown_worker
from refdcp.asyncsave.save import InFlightLimiter, async_save
from refdcp.staging import CpuStager


class BrokenWriter(FileSystemWriter):
    """Raises in write_data (module level so the worker process can unpickle it)."""

    def write_data(self, plan: Any, planner: Any) -> Any:
        raise OSError("injected failure in the worker")


@pytest.mark.spec("ASYNC-7")
@pytest.mark.timeout(180)
def test_process_executor_commits_and_reports_failures(tmp_path: Path) -> None:
    stager = CpuStager(cache_staged_state_dict=True, share_memory=True, pin_memory=False)
    limiter = InFlightLimiter(1)
    try:
        w = torch.randn(1000)
        expected = w.clone()
        h = async_save(
            {"w": w, "tag": "p"},
            checkpoint_id=str(tmp_path / "a"),
            executor="process",
            stager=stager,
            no_dist=True,
            limiter=limiter,
        )
        assert h.staged.done()
        w.zero_()
        md = h.result(timeout=120)
        assert "w" in md.state_dict_metadata
        out = {"w": torch.empty(1000), "tag": ""}
        load(out, checkpoint_id=str(tmp_path / "a"), no_dist=True)
        assert torch.equal(out["w"], expected) and out["tag"] == "p"

        bad = async_save(
            {"w": w},
            storage_writer=BrokenWriter(str(tmp_path / "b")),
            executor="process",
            stager=stager,
            no_dist=True,
            limiter=limiter,
        )
        assert "injected failure" in str(bad.exception(timeout=120))
        assert not (tmp_path / "b" / ".metadata").exists()

        w.fill_(7)  # the worker survives a failed save; buffers are reused
        async_save(
            {"w": w, "tag": "q"},
            checkpoint_id=str(tmp_path / "c"),
            executor="process",
            stager=stager,
            no_dist=True,
            limiter=limiter,
        ).result(timeout=120)
        load(out, checkpoint_id=str(tmp_path / "c"), no_dist=True)
        assert bool((out["w"] == 7).all()) and out["tag"] == "q"
        assert stager.pool is not None and stager.pool.allocations == 1
    finally:
        shutdown_worker()
        stager.close()


@pytest.mark.spec("ASYNC-7")
def test_process_executor_rejects_in_process_comm(tmp_path: Path) -> None:
    class Dummy:
        rank = 0

    with pytest.raises(ValueError, match="process"):
        async_save(
            {"w": torch.zeros(1)}, checkpoint_id=str(tmp_path), executor="process", comm=Dummy()
        )  # type: ignore[arg-type]


class LockedWriter(FileSystemWriter):
    """Holds a lock, so it cannot be pickled to the worker process."""

    def __init__(self, path: Any) -> None:
        super().__init__(path)
        import threading

        self.lock = threading.Lock()


@pytest.mark.spec("ASYNC-15")
@pytest.mark.timeout(180)
def test_unpicklable_writer_fails_committed_and_worker_stays_usable(tmp_path: Path) -> None:
    limiter = InFlightLimiter(1)
    try:
        bad = async_save(
            {"w": torch.ones(3)},
            storage_writer=LockedWriter(tmp_path / "a"),
            no_dist=True,
            executor="process",
            limiter=limiter,
        )
        exc = bad.committed.exception(timeout=120)
        assert isinstance(exc, TypeError) and "could not send the save" in str(exc)
        good = async_save(
            {"w": torch.full((3,), 2.0)},
            checkpoint_id=str(tmp_path / "b"),
            no_dist=True,
            executor="process",
            limiter=limiter,
        )
        good.result(timeout=120)
        out = {"w": torch.zeros(3)}
        load(out, checkpoint_id=str(tmp_path / "b"), no_dist=True)
        assert torch.equal(out["w"], torch.full((3,), 2.0))
    finally:
        shutdown_worker()


class _BadRelease(CpuStager):
    def release(self, staged: object) -> None:
        raise RuntimeError("release failed")


@pytest.mark.spec("ASYNC-15")
def test_failing_release_still_resolves_and_later_saves_run(tmp_path: Path) -> None:
    with pytest.warns(RuntimeWarning, match="release"):
        first = async_save(
            {"w": torch.ones(2)},
            checkpoint_id=str(tmp_path / "a"),
            no_dist=True,
            stager=_BadRelease(),
            limiter=InFlightLimiter(4),
        )
        md = first.result(timeout=60)
    assert "w" in md.state_dict_metadata
    second = async_save(
        {"w": torch.ones(2)},
        checkpoint_id=str(tmp_path / "b"),
        no_dist=True,
        limiter=InFlightLimiter(4),
    )
    assert "w" in second.result(timeout=60).state_dict_metadata
