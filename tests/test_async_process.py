"""async_save with the process executor (spec/staging.md ASYNC-7)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint import FileSystemWriter

from refdcp.api import load
from refdcp.async_save import InFlightLimiter, async_save
from refdcp.staging import CpuStager
from refdcp.staging.process_executor import shutdown_worker


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
