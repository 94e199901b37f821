"""TorchDistComm over NCCL (spec/comm.md, COMM-51); run by ``make test-gpu``."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

from refdcp.testing.spawn import run_gloo
from tests.test_comm_fake import check_exercise, exercise

PAYLOADS = [{"rank": 0, "t": [1.5, 2.5]}, "one", (2,), None, b"four", 5, 6.0, [7]]

_NO_CUDA = "CUDA is not available: NCCL communicator tests need a GPU"

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.dist,
    pytest.mark.skipif(not torch.cuda.is_available(), reason=_NO_CUDA),
]


def _nccl_checks(rank: int, world_size: int, late_check: bool) -> dict[str, Any]:
    import torch

    from refdcp.comm import TorchDistComm
    from refdcp.errors import CommError

    comm = TorchDistComm(timeout=60.0)
    out: dict[str, Any] = {
        "device": (comm.device.type, comm.device.index, torch.cuda.current_device()),
        "exercise": exercise(comm, PAYLOADS[:world_size]),
    }
    if late_check:
        if rank == world_size - 1:
            time.sleep(2.5)
        t0 = time.monotonic()
        try:
            comm.barrier(timeout=1.0)
            out["late"] = ("completed", time.monotonic() - t0)
        except CommError as exc:
            out["late"] = (type(exc).__name__, time.monotonic() - t0)
    torch.cuda.synchronize()
    return out


@pytest.mark.spec("COMM-51", "COMM-3")
def test_nccl_world_of_one_uses_the_current_cuda_device() -> None:
    results = run_gloo(1, _nccl_checks, False, timeout=300.0, backend="nccl")
    assert results[0]["device"] == ("cuda", 0, 0)
    check_exercise([r["exercise"] for r in results], PAYLOADS[:1], 0)


@pytest.mark.spec("COMM-51", "COMM-3", "COMM-5")
@pytest.mark.skipif(
    torch.cuda.device_count() < 2,
    reason="multi-rank NCCL needs at least 2 GPUs (one rank per GPU); fewer are visible",
)
def test_nccl_all_gpus() -> None:
    world = min(torch.cuda.device_count(), len(PAYLOADS))
    results = run_gloo(world, _nccl_checks, True, timeout=300.0, backend="nccl")
    check_exercise([r["exercise"] for r in results], PAYLOADS[:world], 0)
    for rank, r in enumerate(results):
        assert r["device"] == ("cuda", rank, rank)
    for rank in range(world - 1):
        outcome, waited = results[rank]["late"]
        assert outcome == "CommTimeout" and waited >= 0.9
