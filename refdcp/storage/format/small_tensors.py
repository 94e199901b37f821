"""Framing of small plain tensors for the write path, without per-item helper objects
(FMT-3, INTEG-1, SAVE-10).

A save of many small tensors spends more on the bookkeeping around each
item than on its bytes. For a plain CPU tensor whose memory holds exactly its
values (:func:`~refdcp.storage.format.tensor_values.bytes_are_values`, SAVE-10),
:func:`small_tensor_parts` returns the three buffers to write (the cached
torch.save frame's head, the tensor's own memory, the frame's tail), the
blob's length, its CRC-32C and the data offset: the same bytes, checksum and
offset :func:`~refdcp.storage.format.items.encode_tensor` gives, without building an
``Encoded`` per item. Other tensors (empty, large, views whose bytes are not
their values, quantized, sparse, off the CPU) return None and take
``encode_tensor``.
"""

from __future__ import annotations

import ctypes
from typing import Any

import crc32c
import torch

from refdcp.storage.format.tensor_values import bytes_are_values
from refdcp.storage.format.zipframe import frame_for

__all__ = ["SMALL_MAX_BYTES", "small_tensor_parts"]

#: Tensors below this size take the small path (larger ones are written straight out).
SMALL_MAX_BYTES = 1 << 20

#: (dtype, shape) -> (head, tail, CRC-32C of head, len(head), len(tail))
_FRAMES: dict[tuple[torch.dtype, torch.Size], tuple[bytes, bytes, int, int, int]] = {}
_BUFFER_TYPES: dict[int, Any] = {}

SmallParts = tuple[bytes, Any, bytes, int, int, int, int]


def small_tensor_parts(t: torch.Tensor) -> SmallParts | None:
    """``(head, data, tail, length, crc, data_offset, value_crc)`` for a small plain tensor,
    else None; ``value_crc`` is the CRC over head and data (the value digest, DEDUP-17).

    ``data`` is a ctypes view of ``t``'s memory: keep ``t`` alive until it is written.
    """
    if not (t.is_cpu and bytes_are_values(t)):
        return None
    n = t.nbytes
    if n == 0 or n >= SMALL_MAX_BYTES:
        return None
    key = (t.dtype, t.size())
    frame = _FRAMES.get(key)
    if frame is None:
        f = frame_for(t.dtype, tuple(t.shape))
        frame = (f.head, f.tail, f.head_crc, len(f.head), len(f.tail))
        if len(_FRAMES) > 4096:
            _FRAMES.clear()
        _FRAMES[key] = frame
    head, tail, head_crc, head_len, tail_len = frame
    buffer_type = _BUFFER_TYPES.get(n)
    if buffer_type is None:
        buffer_type = ctypes.c_ubyte * n
        if len(_BUFFER_TYPES) > 4096:
            _BUFFER_TYPES.clear()
        _BUFFER_TYPES[n] = buffer_type
    data = buffer_type.from_address(t.data_ptr())
    value = crc32c.crc32c(data, head_crc)
    return head, data, tail, head_len + n + tail_len, crc32c.crc32c(tail, value), head_len, value
