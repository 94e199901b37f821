"""async_save under a real Gloo process group (spec/staging.md ASYNC-6, ASYNC-7)."""

from __future__ import annotations

import multiprocessing
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

pytestmark = pytest.mark.dist


def _train_and_checkpoint(rank: int, world: int, root: str, iters: int, every: int) -> list[float]:
    """A training loop whose own all_reduce calls interleave with background saves."""
    from refdcp.asyncsave.save import InFlightLimiter, async_save
    from refdcp.staging import CpuStager

    stager = CpuStager(cache_staged_state_dict=True)
    limiter = InFlightLimiter(max_in_flight=2, wait_timeout=60)
    param = torch.full((256,), float(rank))
    handles = []
    for it in range(iters):
        grad = torch.ones(256)
        dist.all_reduce(grad)  # the training loop's collective on the default group
        param.add_(grad)
        if it % every == 0:
            h = async_save(
                {f"p{rank}": param, f"own{rank}": torch.tensor([it])},
                checkpoint_id=f"{root}/step{it}",
                stager=stager,
                limiter=limiter,
            )
            h.staged.result(timeout=30)
            handles.append((it, h))
        dist.barrier()
    for _, h in handles:
        h.result(timeout=60)
    stager.close()
    return [float(param[0])]


def _process_executor_rank(rank: int, world: int, root: str) -> int:
    from refdcp.asyncsave.process_executor import shutdown_worker
    from refdcp.asyncsave.save import InFlightLimiter, async_save
    from refdcp.staging import CpuStager

    # run_gloo starts its ranks as daemonic processes, which multiprocessing forbids to
    # have children; ranks started by torchrun are not daemonic, so mirror that here.
    multiprocessing.current_process().daemon = False
    stager = CpuStager(cache_staged_state_dict=True, share_memory=True, pin_memory=False)
    try:
        # a rank-local snapshot first: its worker must not serve the collective saves (ASYNC-14)
        local = async_save(
            {"local": torch.ones(1)},
            checkpoint_id=f"{root}/local{rank}",
            no_dist=True,
            executor="process",
            limiter=InFlightLimiter(1),
        )
        local.result(timeout=120)
        t = torch.full((8,), float(rank))
        for i in range(2):
            h = async_save(
                {f"r{rank}": t, "step": i},
                checkpoint_id=f"{root}/p{i}",
                executor="process",
                stager=stager,
                limiter=InFlightLimiter(1),
            )
            x = torch.ones(1)
            dist.all_reduce(x)  # training collective while the worker saves
            h.result(timeout=120)
        return len(h.result().state_dict_metadata)
    finally:
        shutdown_worker()
        stager.close()


@pytest.mark.spec("ASYNC-6", "ASYNC-8", "ASYNC-13")
@pytest.mark.timeout(200)
def test_interleaved_with_training_collectives(tmp_path: Path) -> None:
    from refdcp.api import load
    from refdcp.testing.spawn import run_gloo

    iters, every = 24, 3
    finals = run_gloo(2, _train_and_checkpoint, str(tmp_path), iters, every, timeout=150)
    assert finals == [[float(iters * 2)], [1.0 + iters * 2]]
    for it in range(0, iters, every):
        out: dict[str, Any] = {
            "p0": torch.empty(256),
            "p1": torch.empty(256),
            "own0": torch.empty(1, dtype=torch.int64),
            "own1": torch.empty(1, dtype=torch.int64),
        }
        load(out, checkpoint_id=str(tmp_path / f"step{it}"), no_dist=True)
        # each rank's parameter as it was when that save was staged
        assert out["own0"].item() == it and out["own1"].item() == it
        assert bool((out["p0"] == 2.0 * (it + 1)).all())
        assert bool((out["p1"] == 1.0 + 2.0 * (it + 1)).all())


@pytest.mark.spec("ASYNC-7", "ASYNC-6", "ASYNC-14")
@pytest.mark.timeout(200)
def test_process_executor_in_gloo_world(tmp_path: Path) -> None:
    from refdcp.api import load
    from refdcp.testing.spawn import run_gloo

    assert run_gloo(2, _process_executor_rank, str(tmp_path), timeout=150) == [3, 3]
    out: dict[str, Any] = {"r0": torch.empty(8), "r1": torch.empty(8), "step": -1}
    load(out, checkpoint_id=str(tmp_path / "p1"), no_dist=True)
    assert out["r1"].tolist() == [1.0] * 8 and out["step"] == 1
