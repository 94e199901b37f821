"""Shared hypothesis strategies for tensors whose bytes are not their values (SAVE-10).

``tensors()`` draws plain tensors and every kind of view that shares or skips
memory: conjugate and negative views (a lazy bit over unchanged memory),
zero-stride expanded views, slices with a storage offset or a step,
transposes, empty tensors and a plain tensor subclass. ``expected(t)`` is the
value a round trip must give back: a plain contiguous tensor equal to ``t``.
"""

from __future__ import annotations

from typing import Any

import torch
from hypothesis import strategies as st

__all__ = ["Subclass", "VIEW_KINDS", "expected", "make_view", "tensors", "tensor_dicts"]

DTYPES = (torch.float32, torch.float64, torch.complex64, torch.int64, torch.bfloat16, torch.bool)
VIEW_KINDS = (
    "plain",
    "conj",
    "neg",
    "conj_neg",
    "expand",
    "offset",
    "step",
    "transpose",
    "subclass",
)


class Subclass(torch.Tensor):
    """A plain (non-wrapper) tensor subclass."""


def _base(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype is torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype is torch.int64:
        return torch.randint(-100, 100, shape, generator=g)
    if dtype.is_complex:
        return torch.randn(shape, dtype=dtype, generator=g)
    return torch.randn(shape, generator=g).to(dtype)


def make_view(kind: str, dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """A tensor of ``kind`` (one of :data:`VIEW_KINDS`); falls back to plain where not defined."""
    rows, cols = shape[0], shape[1]
    base = _base(dtype, (rows + 2, cols + 1), seed)
    if kind in ("conj", "conj_neg") and dtype.is_complex:
        v = base.conj()
        return v._neg_view() if kind == "conj_neg" else v
    if kind in ("neg", "conj_neg") and dtype is not torch.bool:
        return base._neg_view()
    if kind == "expand":
        return base[:rows, :1].expand(rows, cols + 1)
    if kind == "offset":
        return base[2:, 1:]
    if kind == "step":
        return base[::2]
    if kind == "transpose":
        return base.t()
    if kind == "subclass":
        v = base.conj() if dtype.is_complex else base
        return v.as_subclass(Subclass)
    return base


def expected(t: torch.Tensor) -> torch.Tensor:
    """The plain values a round trip of ``t`` must give back."""
    out = torch.empty(tuple(t.shape), dtype=t.dtype)
    out.copy_(t.detach())
    return out


@st.composite
def tensors(draw: Any) -> torch.Tensor:
    """One tensor, often a view whose memory is not its values."""
    kind = draw(st.sampled_from(VIEW_KINDS))
    dtype = draw(st.sampled_from(DTYPES))
    shape = (draw(st.integers(0, 3)), draw(st.integers(0, 3)))
    return make_view(kind, dtype, shape, draw(st.integers(0, 2**16)))


def tensor_dicts(max_size: int = 4) -> st.SearchStrategy[dict[str, torch.Tensor]]:
    """Flat state dicts of :func:`tensors` under distinct string keys."""
    return st.dictionaries(st.text("abcdef", min_size=1, max_size=4), tensors(), max_size=max_size)
