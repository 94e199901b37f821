"""refdcp.Checkpointer (spec/staging.md ASYNC-9, ASYNC-10)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import FileSystemWriter

from refdcp.asyncsave.checkpointer import Checkpointer
from refdcp.staging import CpuStager

#: Why this module runs on refdcp only (REF-6).
SINGLE_PATH = (
    "refdcp.Checkpointer has no twin in refdcp.reference; its async saves are refdcp.async_save's"
)


@pytest.mark.spec("ASYNC-9")
def test_save_async_save_load(tmp_path: Path) -> None:
    ck = Checkpointer(no_dist=True)
    w = torch.randn(10)
    md = ck.save({"w": w, "step": 1}, checkpoint_id=str(tmp_path / "s"))
    assert "w" in md.state_dict_metadata
    expected = w.clone()
    handle = ck.async_save({"w": w, "step": 2}, checkpoint_id=str(tmp_path / "a"))
    w.add_(5)
    handle.result(timeout=60)
    for name, exp_w, exp_step in [("s", expected, 1), ("a", expected, 2)]:
        out = {"w": torch.empty(10), "step": 0}
        ck.load(out, checkpoint_id=str(tmp_path / name))
        assert torch.equal(out["w"], exp_w) and out["step"] == exp_step
    ck.close()


@pytest.mark.spec("ASYNC-9")
def test_fixed_writer_is_used(tmp_path: Path) -> None:
    with Checkpointer(storage_writer=FileSystemWriter(str(tmp_path)), no_dist=True) as ck:
        ck.async_save({"x": torch.ones(3)}).result(timeout=60)
    assert (tmp_path / ".metadata").exists()


@pytest.mark.spec("ASYNC-10")
def test_steady_state_reuses_buffers(tmp_path: Path) -> None:
    ck = Checkpointer(no_dist=True)
    assert isinstance(ck.stager, CpuStager) and ck.stager.pool is not None
    sd = {"w": torch.randn(64), "b": torch.randn(4)}
    for i in range(4):
        sd["w"].add_(1)
        ck.async_save(sd, checkpoint_id=str(tmp_path / f"c{i}"))
    ck.wait(timeout=60)
    assert ck.stager.pool.allocations == 1
    out = {"w": torch.empty(64), "b": torch.empty(4)}
    ck.load(out, checkpoint_id=str(tmp_path / "c3"))
    assert torch.equal(out["w"], sd["w"])
    ck.close()


@pytest.mark.spec("ASYNC-9", "ASYNC-7")
@pytest.mark.timeout(180)
def test_process_executor_checkpointer(tmp_path: Path) -> None:
    from refdcp.asyncsave.process_executor import shutdown_worker

    ck = Checkpointer(no_dist=True, executor="process")
    try:
        assert isinstance(ck.stager, CpuStager) and ck.stager.pool is not None
        assert ck.stager.pool.share_memory and not ck.stager.pool.pin_memory
        sd = {"w": torch.randn(32)}
        for i in range(2):
            sd["w"].add_(1)
            ck.async_save(sd, checkpoint_id=str(tmp_path / f"p{i}")).result(timeout=120)
        out = {"w": torch.empty(32)}
        ck.load(out, checkpoint_id=str(tmp_path / "p1"))
        assert torch.equal(out["w"], sd["w"]) and ck.stager.pool.allocations == 1
    finally:
        shutdown_worker()
        ck.close()
