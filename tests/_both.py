"""Models drawn for the suites that run against both ``refdcp`` and ``refdcp.reference`` (REF-6).

A model is a list of entries; :func:`state_for` builds the state dict one rank
of a world holds (``zeros`` for a load's destination): replicated plain
tensors, row-sharded ``LocalShards`` (uneven and empty chunks included),
non-tensor values, nested containers and a top-level ``Stateful``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from hypothesis import strategies as st

import refdcp
import refdcp.reference

IMPLS: dict[str, Any] = {"fast": refdcp, "reference": refdcp.reference}
DTYPES = (
    torch.float32,
    torch.bfloat16,
    torch.float64,
    torch.int64,
    torch.bool,
    torch.complex64,
    torch.float8_e4m3fn,
    torch.uint8,
)


@dataclass(frozen=True)
class Entry:
    kind: str  # replicated | rows | object | nested | stateful
    dtype: torch.dtype
    rows: int
    cols: int
    seed: int


@st.composite
def models(draw: st.DrawFn, max_entries: int = 5) -> list[Entry]:
    n = draw(st.integers(1, max_entries))
    kinds = st.sampled_from(("replicated", "rows", "rows", "object", "nested", "stateful"))
    return [
        Entry(
            draw(kinds),
            draw(st.sampled_from(DTYPES)),
            draw(st.integers(0, 9)),
            draw(st.integers(1, 3)),
            i,
        )
        for i in range(n)
    ]


def values(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype is torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype in (torch.int64, torch.uint8):
        return torch.randint(0, 100, shape, generator=g).to(dtype)
    if dtype.is_complex:
        return torch.randn(shape, dtype=dtype, generator=g)
    return torch.randn(shape, generator=g).to(dtype)


def row_span(rows: int, world: int, rank: int) -> tuple[int, int]:
    """torch.chunk's split of ``rows`` into ``world`` parts: part ``rank`` (maybe empty)."""
    step = max(1, math.ceil(rows / world))
    start = min(rank * step, rows)
    return start, min(start + step, rows)


class Holder:
    """A ``Stateful`` holding one tensor (API-2)."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t

    def state_dict(self) -> dict[str, Any]:
        return {"t": self.t}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.t = sd["t"]


def state_for(model: list[Entry], world: int, rank: int, zeros: bool = False) -> dict[str, Any]:
    sd: dict[str, Any] = {}
    for e in model:
        full = values(e.dtype, (e.rows, e.cols), e.seed)
        if zeros:
            full = torch.zeros_like(full)
        if e.kind == "replicated":
            sd[f"r{e.seed}"] = full
        elif e.kind == "rows":
            start, stop = row_span(e.rows, world, rank)
            chunks = [((start, 0), full[start:stop].clone())] if stop > start else []
            sd[f"s{e.seed}"] = refdcp.LocalShards((e.rows, e.cols), chunks, dtype=e.dtype)
        elif e.kind == "object":
            sd[f"o{e.seed}"] = {"lr": 0.0 if zeros else 0.5 + e.seed, "ids": [e.seed, e.rows]}
        elif e.kind == "nested":
            sd[f"n{e.seed}"] = {"a": [full, 0 if zeros else e.seed], "b": {"c": full[:1].clone()}}
        else:
            sd[f"h{e.seed}"] = Holder(full)
    return sd


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """Bitwise view, so NaNs and float8 values compare exactly."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def check_loaded(model: list[Entry], world: int, rank: int, sd: dict[str, Any]) -> None:
    """Every value a rank loaded equals what was saved, bit for bit (RESHARD-4, API-2)."""
    for e in model:
        full = values(e.dtype, (e.rows, e.cols), e.seed)
        if e.kind == "replicated":
            assert torch.equal(as_bytes(sd[f"r{e.seed}"]), as_bytes(full)), e
        elif e.kind == "rows":
            start, stop = row_span(e.rows, world, rank)
            for _, chunk in sd[f"s{e.seed}"].chunks:
                assert torch.equal(as_bytes(chunk), as_bytes(full[start:stop])), e
        elif e.kind == "object":
            assert sd[f"o{e.seed}"] == {"lr": 0.5 + e.seed, "ids": [e.seed, e.rows]}, e
        elif e.kind == "nested":
            nest = sd[f"n{e.seed}"]
            assert torch.equal(as_bytes(nest["a"][0]), as_bytes(full)), e
            assert nest["a"][1] == e.seed
            assert torch.equal(as_bytes(nest["b"]["c"]), as_bytes(full[:1])), e
        else:
            assert torch.equal(as_bytes(sd[f"h{e.seed}"].t), as_bytes(full)), e
