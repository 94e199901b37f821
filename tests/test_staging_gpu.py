"""GPU staging: pinned pool and the CUDA async stager (STAGE-13..STAGE-15). Skipped without CUDA."""

from __future__ import annotations

from concurrent.futures import Future

import pytest
import torch

from refdcp.staging import CpuStager, CudaAsyncStager, State

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (no GPU on this machine)"),
]


@pytest.mark.spec("STAGE-13", "STAGE-11")
def test_cached_pool_is_pinned_and_reused() -> None:
    stager = CpuStager(cache_staged_state_dict=True)
    src = {"w": torch.randn(1024, device="cuda"), "n": 3}
    snap = stager.stage(src)
    assert snap["w"].device.type == "cpu" and snap["w"].is_pinned()
    assert torch.equal(snap["w"], src["w"].cpu())
    ptr = snap["w"].data_ptr()
    stager.release(snap)
    again = stager.stage(src)
    assert again["w"].data_ptr() == ptr
    stager.release(again)
    stager.close()
    shared = CpuStager(cache_staged_state_dict=True, share_memory=True)
    assert shared.pool is not None and not shared.pool.pin_memory


@pytest.mark.spec("STAGE-14", "STAGE-15")
def test_cuda_async_stager_snapshot_matches_stage_time() -> None:
    stager = CudaAsyncStager()
    w = torch.randn(4096, 1024, device="cuda")  # 16 MiB: the copy takes measurable time
    expected = w.cpu()
    fut = stager.stage({"w": w, "step": 5})
    assert isinstance(fut, Future)
    stager.synchronize_staging()
    assert fut.done()
    snap = fut.result(timeout=60)
    w.add_(1)  # after staging completed: must not reach the snapshot
    torch.cuda.synchronize()
    assert snap["w"].is_pinned() and torch.equal(snap["w"], expected) and snap["step"] == 5
    stager.release(snap)
    stager.close()


@pytest.mark.spec("STAGE-14")
def test_side_stream_waits_for_pending_writes() -> None:
    stager = CudaAsyncStager()
    w = torch.zeros(2048, 2048, device="cuda")
    # queue a write on the current stream; the side stream must see it
    w.fill_(3.0)
    fut = stager.stage({"w": w})
    snap = fut.result(timeout=60)
    assert bool((snap["w"] == 3.0).all())
    stager.release(snap)
    assert stager.pool is not None and stager.pool.states() == [State.RELEASED]
    stager.close()


@pytest.mark.spec("STAGE-15")
def test_cuda_stager_through_async_save(tmp_path: object) -> None:
    from refdcp.api import load
    from refdcp.asyncsave.save import InFlightLimiter, async_save

    stager = CudaAsyncStager()
    w = torch.randn(256, device="cuda")
    expected = w.cpu()
    handle = async_save(
        {"w": w},
        checkpoint_id=str(tmp_path),
        stager=stager,
        no_dist=True,
        limiter=InFlightLimiter(1),
    )
    handle.staged.result(timeout=60)
    w.mul_(0)
    handle.result(timeout=120)
    out = {"w": torch.empty(256)}
    load(out, checkpoint_id=str(tmp_path), no_dist=True)
    assert torch.equal(out["w"], expected)
    stager.close()
