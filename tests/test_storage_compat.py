"""Checkpoints cross between refdcp's and torch 2.13's filesystem storage (STORE-14, FMT-4, FMT-5)."""

from __future__ import annotations

import tempfile
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from refdcp.storage import FileSystemReader, FileSystemWriter

SINGLE_PATH = "refdcp's fast FileSystemWriter/Reader driven by torch's dcp.save/load (the storage classes, not the driver)"

warnings.filterwarnings("ignore", message="torch.distributed is disabled")

DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.complex64,
    torch.bool,
    torch.int8,
    torch.int64,
    torch.uint8,
    torch.uint16,
    torch.uint32,
    torch.uint64,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.float8_e8m0fnu,
    torch.float4_e2m1fn_x2,
]


def make_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Random bits of any dtype (built from bytes, so every bit pattern is exercised)."""
    g = torch.Generator().manual_seed(seed)
    itemsize = torch.empty((), dtype=dtype).element_size()
    n = 1
    for s in shape:
        n *= s
    raw = torch.randint(0, 256, (n * itemsize,), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        raw = raw % 2
    return raw.view(dtype).reshape(shape) if n else torch.empty(shape, dtype=dtype)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def local_state(rank: int, world: int) -> dict[str, Any]:
    sd: dict[str, Any] = {}
    for i, dt in enumerate(DTYPES):
        sd[f"t.{dt}"] = make_tensor(dt, (3, 4), 100 + i)  # replicated: same on every rank
        sd[f"own{rank}.{dt}"] = make_tensor(dt, (2, 5), 1000 * rank + i)
    sd["scalar"] = torch.tensor(2.5)
    sd["empty"] = torch.zeros(0, 3)
    sd["view"] = torch.arange(1000.0).reshape(100, 10)[5:7, 2:5]  # view of a larger storage
    sd["transposed"] = torch.arange(12.0).reshape(3, 4).t()
    sd["obj"] = {"rank_independent": [1, "two", 3.0], "world": world}
    return sd


def blank(sd: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in sd.items():
        if isinstance(v, torch.Tensor):
            out[k] = (
                torch.zeros_like(v)
                if v.dtype != torch.float4_e2m1fn_x2
                else make_tensor(v.dtype, tuple(v.shape), 0)
            )
        elif isinstance(v, dict):
            out[k] = {kk: None for kk in v}
        else:
            out[k] = None
    return out


def compare(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    bad = []
    for k, v in a.items():
        if isinstance(v, torch.Tensor):
            w = b[k]
            if v.dtype != w.dtype or v.shape != w.shape or not torch.equal(bits(v), bits(w)):
                bad.append(k)
        elif v != b[k]:
            bad.append(k)
    return bad


def cross_both_ways(rank: int, world: int, root: str, writer_kw: dict[str, Any]) -> list[str]:
    """refdcp -> torch and torch -> refdcp on this rank; returns mismatching keys."""
    sd = local_state(rank, world)
    a, b = Path(root) / "refdcp", Path(root) / "torch"
    dcp.save(sd, storage_writer=FileSystemWriter(a, **writer_kw))
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(b))
    problems: list[str] = []
    for name, path, reader, verify in [
        ("torch<-refdcp", a, dcp.FileSystemReader, False),
        ("refdcp<-torch", b, FileSystemReader, False),
        ("refdcp<-refdcp(verify)", a, FileSystemReader, True),
    ]:
        out = blank(sd)
        r = reader(path)
        if verify:
            r.set_verify(True)
        dcp.load(out, storage_reader=r)
        problems += [f"{name}:{k}" for k in compare(sd, out)]
    return problems


@pytest.mark.spec("STORE-14", "FMT-4", "FMT-5", "FMT-2")
@pytest.mark.parametrize(
    "writer_kw",
    [{}, {"thread_count": 3}, {"single_file_per_rank": False, "sync_files": False}],
)
def test_world_1_all_dtypes_both_ways(tmp_path: Path, writer_kw: dict[str, Any]) -> None:
    import torch.distributed as dist

    assert not dist.is_initialized()
    assert cross_both_ways(0, 1, str(tmp_path), writer_kw) == []


@pytest.mark.spec("FMT-4")
def test_views_store_only_their_elements(tmp_path: Path) -> None:
    big = torch.arange(1_000_000.0).reshape(1000, 1000)
    dcp.save({"v": big[:2, :3]}, storage_writer=FileSystemWriter(tmp_path), no_dist=True)
    total = sum(p.stat().st_size for p in tmp_path.iterdir())
    assert total < 4096


@pytest.mark.dist
@pytest.mark.spec("STORE-14")
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.timeout(240)
def test_gloo_worlds_both_ways(world: int) -> None:
    from refdcp.testing.spawn import run_gloo

    with tempfile.TemporaryDirectory() as root:
        results = run_gloo(world, _gloo_rank, root, timeout=200.0)
    assert results == [[] for _ in range(world)]


def _gloo_rank(rank: int, world: int, root: str) -> list[str]:
    warnings.filterwarnings("ignore")
    problems = cross_both_ways(rank, world, root, {"thread_count": 2})
    problems += _dtensor_cross(rank, world, root)
    return problems


def _dtensor_cross(rank: int, world: int, root: str) -> list[str]:
    """Sharded DTensors saved by one implementation, loaded by the other."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world,))
    problems: list[str] = []

    def state(fill: bool) -> dict[str, Any]:
        sd: dict[str, Any] = {}
        for i, dt in enumerate(DTYPES):
            full = make_tensor(dt, (2 * world + 1, 3), 500 + i)
            step = -(-(2 * world + 1) // world)  # torch.chunk semantics
            start = min(rank * step, 2 * world + 1)
            n = max(0, min(step, 2 * world + 1 - start))
            rows = full.view(torch.uint8).reshape(2 * world + 1, -1)[start : start + n]
            local = rows.view(dt) if fill else make_tensor(dt, (n, 3), 7)
            sd[f"d.{dt}"] = DTensor.from_local(
                local, mesh, [Shard(0)], run_check=False, shape=full.shape, stride=full.stride()
            )
        return sd

    for writer, reader, tag in [
        (FileSystemWriter, dcp.FileSystemReader, "dt torch<-refdcp"),
        (dcp.FileSystemWriter, FileSystemReader, "dt refdcp<-torch"),
    ]:
        path = Path(root) / tag.replace(" ", "_").replace("<-", "_from_")
        src = state(True)
        dcp.save(src, storage_writer=writer(path))
        out = state(False)
        dcp.load(out, storage_reader=reader(path))
        for k in src:
            if not torch.equal(bits(src[k].to_local()), bits(out[k].to_local())):
                problems.append(f"{tag}:{k}")
    return problems
