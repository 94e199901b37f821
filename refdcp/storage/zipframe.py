"""torch.save-compatible framing written around raw tensor bytes (FMT-3, FMT-4).

A tensor item in a ``.distcp`` file is a complete zip archive that
``torch.load(..., weights_only=True)`` reads.  Instead of calling
``torch.save`` per item, refdcp builds the archive's head (everything before
the raw data) and tail (everything after) once per (dtype, shape) and writes
the tensor's bytes between them, so the data goes from the tensor's memory to
the file without an intermediate copy.  Entries are stored (no compression),
the data member starts on a 64-byte boundary of the blob.  The data member's
zip CRC-32 field is 0, exactly as ``torch.save`` writes it under
``torch.serialization.set_crc32_options(False)``; integrity is refdcp's
CRC-32C per item instead (INTEG-1).
"""

from __future__ import annotations

import io
import pickle
import struct
import zlib
from dataclasses import dataclass
from typing import Any

import crc32c
import torch

__all__ = ["Frame", "frame_for", "MAX_FRAMED_BYTES"]

#: Tensors at least this large fall back to ``torch.save`` (zip64 territory).
MAX_FRAMED_BYTES = 0xFFFF_0000

_ARCHIVE = "archive"
_LOCAL = struct.Struct("<IHHHHHIIIHH")
_CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")
_EOCD = struct.Struct("<IHHHHIIH")
_LOCAL_SIG = 0x04034B50
_CENTRAL_SIG = 0x02014B50
_EOCD_SIG = 0x06054B50
_ALIGN = 64


@dataclass(frozen=True)
class Frame:
    """The bytes around one tensor's raw data, and where the CRC-32 goes."""

    head: bytes
    tail: bytes
    data_crc_at_head: int
    data_crc_at_tail: int
    head_crc: int


class _StoragePickler(pickle.Pickler):
    """Pickles a tensor the way torch.save's data.pkl does, without its bytes."""

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, torch.storage.TypedStorage):
            typed: Any = obj
            type_name = typed._pickle_storage_type()
            return ("storage", getattr(torch, type_name), "0", "cpu", typed._size())
        if isinstance(obj, torch.UntypedStorage):
            return ("storage", torch.UntypedStorage, "0", "cpu", obj.nbytes())
        return None


def _data_pickle(dtype: torch.dtype, shape: tuple[int, ...]) -> bytes:
    template = torch.empty(shape, dtype=dtype)
    buf = io.BytesIO()
    _StoragePickler(buf, protocol=2).dump(template)
    return buf.getvalue()


def _local_header(name: bytes, size: int, crc: int, extra: bytes) -> bytes:
    return (
        _LOCAL.pack(_LOCAL_SIG, 20, 0, 0, 0, 0, crc, size, size, len(name), len(extra))
        + name
        + extra
    )


def _pad_extra(offset_after_name: int) -> bytes:
    pad = (-(offset_after_name + 4)) % _ALIGN
    return b"FB" + struct.pack("<H", pad) + b"Z" * pad


_FRAMES: dict[tuple[torch.dtype, tuple[int, ...]], Frame] = {}


def _build(dtype: torch.dtype, shape: tuple[int, ...]) -> Frame:
    nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    members: list[tuple[bytes, bytes | None]] = [
        (f"{_ARCHIVE}/data.pkl".encode(), _data_pickle(dtype, shape)),
        (f"{_ARCHIVE}/.format_version".encode(), b"1"),
        (f"{_ARCHIVE}/.storage_alignment".encode(), b"64"),
        (f"{_ARCHIVE}/byteorder".encode(), b"little"),
        (f"{_ARCHIVE}/data/0".encode(), None),
        (f"{_ARCHIVE}/version".encode(), b"3\n"),
    ]
    head = bytearray()
    tail = bytearray()
    central = bytearray()
    crc_at_head = crc_at_tail = -1
    offset = 0
    for name, payload in members:
        out = head if payload is None or crc_at_head < 0 else tail
        size = nbytes if payload is None else len(payload)
        crc = 0 if payload is None else zlib.crc32(payload)
        extra = _pad_extra(offset + _LOCAL.size + len(name))
        local = _local_header(name, size, crc, extra)
        if payload is None:
            crc_at_head = len(head) + 14
        out += local
        if payload is not None:
            out += payload
        entry_at = len(central)
        central += _CENTRAL.pack(
            _CENTRAL_SIG, 20, 20, 0, 0, 0, 0, crc, size, size, len(name), 0, 0, 0, 0, 0, offset
        )
        central += name
        if payload is None:
            crc_at_tail = entry_at + 16
        offset += len(local) + size
    cd_offset = offset
    tail_before_cd = len(tail)
    tail += central
    tail += _EOCD.pack(_EOCD_SIG, 0, 0, len(members), len(members), len(central), cd_offset, 0)
    return Frame(
        bytes(head),
        bytes(tail),
        crc_at_head,
        tail_before_cd + crc_at_tail,
        crc32c.crc32c(bytes(head)),
    )


def frame_for(dtype: torch.dtype, shape: tuple[int, ...]) -> Frame:
    """The cached frame for a contiguous tensor of this dtype and shape (FMT-3)."""
    key = (dtype, shape)
    frame = _FRAMES.get(key)
    if frame is None:
        frame = _build(dtype, shape)
        if len(_FRAMES) > 4096:
            _FRAMES.clear()
        _FRAMES[key] = frame
    return frame
