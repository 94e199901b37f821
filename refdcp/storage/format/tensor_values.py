"""A tensor whose memory holds exactly its values, before any path takes raw bytes (SAVE-10).

A tensor's bytes are not always its values: a conjugate view (``x.conj()``)
or a negative view (``x._neg_view()``) shares memory with ``x`` and flips the
values lazily; expanded views have zero strides; slices start at a storage
offset or skip elements; a tensor subclass may hold no storage at all. Every
path that takes raw bytes (the framed writer, the in-memory storage, their
checksums, a raw read into a destination) goes through :func:`values_tensor`
or checks :func:`bytes_are_values` first.
"""

from __future__ import annotations

import torch

__all__ = ["bytes_are_values", "values_tensor"]

_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)


def bytes_are_values(t: torch.Tensor) -> bool:
    """True when ``t``'s ``nbytes`` bytes from ``data_ptr()`` are its values in row-major order."""
    return (
        type(t) in _PLAIN_TYPES
        and t.layout == torch.strided
        and not t.is_quantized
        and not t.is_meta
        and not t.is_conj()
        and not t.is_neg()
        and t.is_contiguous()
    )


def values_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s values as a plain, contiguous CPU tensor with no conj/neg bit (SAVE-10).

    Returns ``tensor`` itself (detached) when its bytes already are its values;
    otherwise a copy. Sparse and quantized tensors are returned on the CPU
    with conj/neg bits resolved; their encoding is torch.save's. A meta tensor
    has no values: ValueError.
    """
    t = tensor.detach()
    if t.is_meta:
        raise ValueError("a meta tensor has no values to save")
    if type(t) not in _PLAIN_TYPES:
        t = _plain_copy(t)
    if not t.is_cpu:
        t = t.cpu()
    if t.layout != torch.strided or t.is_quantized:
        return t
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    if not t.is_contiguous():
        t = t.contiguous()
    return t


def _plain_copy(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor holding a subclass's values, as the subclass's own ``copy_`` defines them."""
    if t.layout != torch.strided or t.is_quantized:
        return t.as_subclass(torch.Tensor)
    out = torch.empty(tuple(t.shape), dtype=t.dtype)
    with torch.no_grad():
        out.copy_(t)
    return out.as_subclass(torch.Tensor) if type(out) not in _PLAIN_TYPES else out
