"""refdcp's planners against torch's: same metadata, bit-exact loads both ways (PLAN-8, PLAN-3)."""

from __future__ import annotations

import itertools
import random
import tempfile
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import given
from hypothesis import strategies as st
from torch.distributed.checkpoint import default_planner as tp
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from refdcp.planning import DefaultLoadPlanner, DefaultSavePlanner, LocalShards
from refdcp.planning.flatten import RESERVED_KEY
from refdcp.planning.simulate import simulate_load, simulate_save

SINGLE_PATH = "differential: refdcp's default planners against torch's (PLAN-8); the reference's planners are compared in test_reference_differential*"

warnings.filterwarnings("ignore", message="torch.distributed is")

SAVERS: dict[str, Callable[[], Any]] = {
    "refdcp": DefaultSavePlanner,
    "torch": tp.DefaultSavePlanner,
}
LOADERS: dict[str, Callable[[], Any]] = {
    "refdcp": DefaultLoadPlanner,
    "torch": tp.DefaultLoadPlanner,
}


def sample_state_dict() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    return {
        "model": {
            "w": torch.randn(4, 3, generator=g),
            "b": torch.randn(3, generator=g).to(torch.bfloat16),
            "f8": torch.randn(5, generator=g).to(torch.float8_e4m3fn),
            "c": torch.randn(2, dtype=torch.complex64, generator=g),
            "mask": torch.rand(6, generator=g) > 0.5,
            "ids": torch.arange(7, dtype=torch.int64),
            "empty": torch.zeros(0, 3),
            "scalar": torch.tensor(2.5),
            "t": torch.randn(3, 4, generator=g).t(),  # non-contiguous
        },
        "layers": [torch.randn(2, generator=g), {"k": torch.ones(1)}],
        "ls": LocalShards((5,), [((0,), torch.arange(2.0)), ((2,), torch.arange(3.0))]),
        "step": 7,
        "cfg": {"lr": 0.1, "names": ["a", "b"]},
    }


def zeros_like_sd(sd: dict[str, Any]) -> dict[str, Any]:
    def z(v: Any) -> Any:
        if isinstance(v, LocalShards):
            return LocalShards(
                v.shape, [(o, torch.zeros_like(t)) for o, t in v.chunks], dtype=v.dtype
            )
        if isinstance(v, torch.Tensor):
            return torch.zeros_like(v)
        if isinstance(v, dict):
            return {k: z(x) for k, x in v.items()}
        if isinstance(v, list):
            return [z(x) for x in v]
        return None

    out = z(sd)
    assert isinstance(out, dict)
    return out


def bits(t: torch.Tensor) -> bytes:
    if t.numel() == 0:
        return b""
    c = torch.empty_like(t, memory_format=torch.contiguous_format).copy_(t)
    return bytes(c.reshape(-1).view(torch.uint8).numpy().tobytes())


def assert_same(a: Any, b: Any) -> None:
    if isinstance(a, LocalShards):
        assert isinstance(b, LocalShards)
        for (oa, ta), (ob, tb) in zip(a.chunks, b.chunks):
            assert oa == ob and bits(ta) == bits(tb) and ta.dtype == tb.dtype
    elif isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and bits(a) == bits(b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, list):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    else:
        assert a == b


def canonical(md: Metadata) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for fqn, m in md.state_dict_metadata.items():
        if isinstance(m, TensorStorageMetadata):
            chunks = sorted((tuple(c.offsets), tuple(c.sizes)) for c in m.chunks)
            out[fqn] = (m.properties, tuple(m.size), chunks)
        else:
            out[fqn] = type(m).__name__
    return out


@pytest.mark.spec("PLAN-8", "PLAN-3")
@pytest.mark.parametrize("saver", ["refdcp", "torch"])
@pytest.mark.parametrize("loader", ["refdcp", "torch"])
def test_inside_torch_dcp_save_load(saver: str, loader: str) -> None:
    sd = sample_state_dict()
    with tempfile.TemporaryDirectory() as d:
        md = dcp.save(sd, checkpoint_id=d, planner=SAVERS[saver](), no_dist=True)
        dest = zeros_like_sd(sd)
        # torch's load planner pickles objects back (weights_only=False); refdcp's needs no opt-in here
        dcp.load(dest, checkpoint_id=d, planner=LOADERS[loader](), no_dist=True)
    assert_same(sd, dest)
    with tempfile.TemporaryDirectory() as d2:
        other = "torch" if saver == "refdcp" else "refdcp"
        md_other = dcp.save(sd, checkpoint_id=d2, planner=SAVERS[other](), no_dist=True)
    assert canonical(md) == canonical(md_other)
    paths = {k: v for k, v in (md.planner_data or {}).items() if k != RESERVED_KEY}
    other_paths = {k: v for k, v in (md_other.planner_data or {}).items() if k != RESERVED_KEY}
    assert paths == other_paths


@st.composite
def world_case(draw: st.DrawFn) -> tuple[int, int, int, str, str]:
    return (
        draw(st.integers(1, 6)),
        draw(st.integers(1, 6)),
        draw(st.integers(0, 10**6)),
        draw(st.sampled_from(["refdcp", "torch"])),
        draw(st.sampled_from(["refdcp", "torch"])),
    )


def split(n: int, parts: int, rng: random.Random) -> list[tuple[int, int]]:
    cuts = sorted(rng.randint(0, n) for _ in range(parts - 1))
    edges = [0, *cuts, n]
    return [(a, b - a) for a, b in itertools.pairwise(edges)]


@pytest.mark.spec("PLAN-8")
@given(world_case())
def test_multi_rank_metadata_equal_and_loads_cross(case: tuple[int, int, int, str, str]) -> None:
    n, m, seed, saver, loader = case
    rng = random.Random(seed)
    full = torch.randn(9, 4, generator=torch.Generator().manual_seed(seed))
    rep = torch.arange(6, dtype=torch.int16)

    def sds(parts: list[tuple[int, int]], source: torch.Tensor | None) -> list[dict[str, Any]]:
        out = []
        for off, size in parts:
            chunk = source[off : off + size] if source is not None else torch.zeros(size, 4)
            out.append(
                {
                    "x": LocalShards(
                        (9, 4), [((off, 0), chunk)] if size else [], dtype=torch.float32
                    ),
                    "rep": rep.clone() if source is not None else torch.zeros_like(rep),
                    "step": 3 if source is not None else None,
                }
            )
        return out

    save_parts = split(9, n, rng)
    saved = {name: simulate_save(sds(save_parts, full), f) for name, f in SAVERS.items()}
    assert canonical(saved["refdcp"].metadata) == canonical(saved["torch"].metadata)
    dest = sds(split(9, m, rng), None)
    simulate_load(dest, saved[saver], LOADERS[loader])
    for sd in dest:
        x = sd["x"]
        assert isinstance(x, LocalShards)
        for off, t in x.chunks:
            assert torch.equal(t, full[off[0] : off[0] + t.shape[0]])
        assert torch.equal(sd["rep"], rep) and sd["step"] == 3


@pytest.mark.spec("API-3")
@pytest.mark.parametrize("world", [1, 3])
def test_torch_planners_inside_refdcp_save_and_load(world: int) -> None:
    """torch's DefaultSavePlanner/DefaultLoadPlanner driven by refdcp's protocol, FakeWorld ranks."""
    import refdcp
    from refdcp.comm import FakeWorld
    from refdcp.storage.memory import MemoryStorage

    storage = MemoryStorage()
    full = torch.arange(24.0).reshape(6, 4)

    def save(comm: Any) -> Metadata:
        r = comm.rank
        sd = {"shared": full.clone(), f"own{r}": torch.full((3,), float(r)), "step": 5}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return refdcp.save(
                sd, storage_writer=storage.writer("tp"), planner=tp.DefaultSavePlanner(), comm=comm
            )

    mds = FakeWorld(world).run(save)
    assert all(md == mds[0] for md in mds)
    assert set(mds[0].state_dict_metadata) == {"shared", "step", *(f"own{r}" for r in range(world))}

    def load(comm: Any) -> dict[str, Any]:
        r = comm.rank
        sd: dict[str, Any] = {"shared": torch.zeros(6, 4), f"own{r}": torch.zeros(3), "step": 0}
        refdcp.load(
            sd, storage_reader=storage.reader("tp"), planner=tp.DefaultLoadPlanner(), comm=comm
        )
        return sd

    for r, sd in enumerate(FakeWorld(world).run(load)):
        assert torch.equal(sd["shared"], full) and sd["step"] == 5
        assert torch.equal(sd[f"own{r}"], torch.full((3,), float(r)))
