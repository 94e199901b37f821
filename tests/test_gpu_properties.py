"""CPU properties on their GPU paths (HARN-16..HARN-18); run by ``make test-gpu``.

Without CUDA they skip here with a reason (``make test``); ``make test-gpu``
refuses to pass on such a machine (refdcp.testing.gpu_gate). The NCCL rank
function is the same code as the Gloo/CPU one in
tests/test_harness_gpu_gate.py::test_round_trip_rank_function_on_gloo, which
runs it on CPU so its logic is checked even where no GPU is lent.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from refdcp.staging import CpuStager, CudaAsyncStager

SINGLE_PATH = "GPU harness properties run by make test-gpu (HARN-16..18) on the default path"

NO_CUDA = "needs CUDA (run by make test-gpu on a GPU machine)"

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA),
]


def _cuda_state() -> dict[str, Any]:
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(7)
    return {
        "w": torch.randn(512, 512, device=dev, generator=g),
        "idx": torch.arange(10_000, device=dev, dtype=torch.int64),
        "half": torch.randn(300, device=dev, generator=g).to(torch.bfloat16),
        "t_view": torch.randn(64, 64, device=dev, generator=g).t(),  # non-contiguous
        "empty": torch.empty(0, 3, device=dev),
        "cpu": torch.randn(16),
        "opt": {"step": 3, "m": torch.zeros(128, device=dev)},
        "name": "run-1",
    }


def _host_copy(sd: dict[str, Any]) -> dict[str, Any]:
    return {
        k: _host_copy(v)
        if isinstance(v, dict)
        else (v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v)
        for k, v in sd.items()
    }


def _assert_same(snap: dict[str, Any], want: dict[str, Any]) -> None:
    assert set(snap) == set(want)
    for k, v in want.items():
        got = snap[k]
        if isinstance(v, dict):
            _assert_same(got, v)
        elif isinstance(v, torch.Tensor):
            assert got.device.type == "cpu", k
            assert got.dtype == v.dtype and got.shape == v.shape, k
            assert torch.equal(got.view(-1).view(torch.uint8), v.reshape(-1).view(torch.uint8)), k
        else:
            assert got == v, k


def _scribble(sd: dict[str, Any]) -> None:
    """What the next training step does to the live state: every tensor and leaf changes."""
    for _k, v in sd.items():
        if isinstance(v, dict):
            _scribble(v)
        elif isinstance(v, torch.Tensor) and v.numel():
            v.add_(1)
    sd["name"] = "changed"
    sd["opt"]["step"] = 99


@pytest.mark.spec("HARN-16", "STAGE-14", "STAGE-15", "STAGE-6")
def test_cuda_snapshot_is_isolated_from_later_training_writes() -> None:
    sd = _cuda_state()
    want = _host_copy(sd)
    stager = CudaAsyncStager()
    try:
        for _ in range(3):  # cached buffers reused across rounds must not leak old values
            train = torch.cuda.Stream()  # type: ignore[no-untyped-call]
            with torch.cuda.stream(train):
                sd["w"].mul_(1.0)  # queued on the training stream: the side stream must wait for it
                fut = stager.stage(sd)
            stager.synchronize_staging()
            snap = fut.result(timeout=120)
            with torch.cuda.stream(train):
                _scribble(sd)  # the next step, after staging completed
            torch.cuda.synchronize()
            _assert_same(snap, want)
            assert all(t.is_pinned() for t in (snap["w"], snap["idx"], snap["opt"]["m"]))
            stager.release(snap)
            want = _host_copy(sd)
    finally:
        stager.close()


@pytest.mark.spec("HARN-16", "STAGE-14")
def test_side_stream_sees_writes_queued_on_a_non_default_stream() -> None:
    stager = CudaAsyncStager()
    try:
        x = torch.zeros(4096, 1024, device="cuda")  # 16 MiB: the fill takes measurable time
        producer = torch.cuda.Stream()  # type: ignore[no-untyped-call]
        with torch.cuda.stream(producer):
            torch.cuda._sleep(10_000_000)  # keep the producer busy so the fill lands late
            x.fill_(5.0)
            fut = stager.stage({"x": x})
        snap = fut.result(timeout=120)
        assert bool((snap["x"] == 5.0).all())
        stager.release(snap)
    finally:
        stager.close()


def _ptrs(snap: dict[str, Any]) -> set[int]:
    out = set()
    for v in snap.values():
        if isinstance(v, dict):
            out |= _ptrs(v)
        elif isinstance(v, torch.Tensor) and v.numel():
            out.add(v.data_ptr())
    return out


@pytest.mark.spec("HARN-17", "STAGE-11", "STAGE-13", "STAGE-12")
def test_pinned_buffers_are_reused_for_a_repeated_layout_and_never_aliased() -> None:
    sd = _cuda_state()
    stager = CpuStager(cache_staged_state_dict=True, max_buffer_sets=2)
    try:
        a = stager.stage(sd)
        assert all(t.is_pinned() for t in (a["w"], a["idx"], a["half"], a["t_view"], a["opt"]["m"]))
        want_a = _host_copy(sd)
        _scribble(sd)
        b = stager.stage(sd)  # a is still leased: b must get other buffers
        assert _ptrs(a).isdisjoint(_ptrs(b))
        _assert_same(a, want_a)  # staging b did not write into a
        a_ptrs, b_ptrs = _ptrs(a), _ptrs(b)
        stager.release(a)
        stager.release(b)
        c = stager.stage(sd)
        assert _ptrs(c) in (a_ptrs, b_ptrs)  # a released set is reused as a whole
        _assert_same(c, _host_copy(sd))
        stager.release(c)
        other = {"w": torch.randn(7, 3, device="cuda")}  # a different layout: its own buffers
        d = stager.stage(other)
        assert d["w"].is_pinned() and d["w"].shape == (7, 3)
        assert torch.equal(d["w"], other["w"].cpu())
        stager.release(d)
    finally:
        stager.close()


def nccl_round_trip(rank: int, world: int, path: str, subset: bool, device: str) -> dict[str, Any]:
    """Save a sharded + replicated state on ``world`` ranks (or on the first half, as a
    process-group subset), load it back sharded the other way round; report bit equality."""
    import torch
    import torch.distributed as dist

    import refdcp
    from refdcp.comm import TorchDistComm

    dev = (
        torch.device(device, torch.cuda.current_device())
        if device == "cuda"
        else torch.device("cpu")
    )
    members = list(range(world // 2)) if subset else list(range(world))
    group = dist.new_group(members) if subset else None  # every rank takes part in new_group
    out: dict[str, Any] = {"member": rank in members}
    if rank in members:
        comm = TorchDistComm(group, timeout=120.0)
        n, r = len(members), members.index(rank)
        rows = 16 // n
        full = torch.randn(16, 8, generator=torch.Generator().manual_seed(1234))
        ints = torch.arange(16 * 3, dtype=torch.int32).reshape(16, 3)
        shards = [((r * rows, 0), full[r * rows : (r + 1) * rows].to(dev))]
        sd = {
            "x": refdcp.LocalShards((16, 8), shards),
            "rep": ints.to(dev),
            "step": 3 + world,
        }
        refdcp.save(sd, checkpoint_id=path, comm=comm)
        back = n - 1 - r  # load the mirrored shard: every rank reads another rank's rows
        dest = {
            "x": refdcp.LocalShards(
                (16, 8), [((back * rows, 0), torch.zeros(rows, 8, device=dev))]
            ),
            "rep": torch.zeros(16, 3, dtype=torch.int32, device=dev),
            "step": 0,
        }
        refdcp.load(dest, checkpoint_id=path, comm=comm)
        x = dest["x"]
        assert isinstance(x, refdcp.LocalShards)
        ((_off, got),) = x.chunks
        out["x_ok"] = bool(torch.equal(got.cpu(), full[back * rows : (back + 1) * rows]))
        out["x_device"] = got.device.type
        out["rep_ok"] = bool(torch.equal(dest["rep"].cpu(), ints))
        out["step"] = dest["step"]
    if subset:
        dist.barrier()
    return out


@pytest.mark.dist
@pytest.mark.spec("HARN-18", "RESHARD-4", "COMM-51")
@pytest.mark.parametrize("world", [1, 2, 4])
def test_nccl_save_load_round_trip(world: int, tmp_path: Any) -> None:
    from refdcp.testing.spawn import run_gloo

    if torch.cuda.device_count() < world:
        pytest.skip(f"needs at least {world} GPUs (one rank per GPU); fewer are visible")
    res = run_gloo(
        world, nccl_round_trip, str(tmp_path), False, "cuda", timeout=300.0, backend="nccl"
    )
    for r in res:
        assert r == {
            "member": True,
            "x_ok": True,
            "x_device": "cuda",
            "rep_ok": True,
            "step": 3 + world,
        }


@pytest.mark.dist
@pytest.mark.spec("HARN-18", "COMM-51")
def test_nccl_round_trip_on_a_process_group_subset(tmp_path: Any) -> None:
    from refdcp.testing.spawn import run_gloo

    world = min(torch.cuda.device_count(), 4)
    if world < 2:
        pytest.skip("needs at least 2 GPUs for a subgroup of half the ranks")
    res = run_gloo(
        world, nccl_round_trip, str(tmp_path), True, "cuda", timeout=300.0, backend="nccl"
    )
    members = world // 2
    for rank, r in enumerate(res):
        if rank < members:
            assert r == {
                "member": True,
                "x_ok": True,
                "x_device": "cuda",
                "rep_ok": True,
                "step": 3 + world,
            }
        else:
            assert r == {"member": False}
