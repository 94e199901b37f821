"""torch.save-compatible framing written around raw tensor bytes (FMT-3, FMT-4, FMT-20..FMT-22).

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

A field that does not fit its 32-bit zip slot (a member of 4 GiB or more, a
member or central directory starting past 4 GiB) is written as 0xFFFFFFFF
with a zip64 extended-information record, and the archive then ends with a
zip64 end-of-central-directory record and locator (APPNOTE 4.3.14-4.3.15,
4.5.3), which torch's reader (miniz) and Python's ``zipfile`` read (FMT-20).
Archives without such a field are byte-identical to the 32-bit form.

Tensors that are not plain dense ones (quantized, sparse, ...) are framed the
same way from the records torch's own pickling produces (``frame_records``),
so their storages are written from memory too (FMT-22).
"""

from __future__ import annotations

import io
import pickle
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import crc32c
import torch

__all__ = [
    "Frame",
    "Framed",
    "frame_for",
    "frame_records",
    "MAX_FRAMED_BYTES",
    "ZIP64_LIMIT",
    "parse_data_span",
]

#: The largest value a 32-bit zip field holds; a field at or above it takes zip64 (FMT-20).
ZIP64_LIMIT = 0xFFFF_FFFF
#: Kept for callers of the old name: every size is framed now (zip64 from ``ZIP64_LIMIT``).
MAX_FRAMED_BYTES = 1 << 62

_ARCHIVE = "archive"
_LOCAL = struct.Struct("<IHHHHHIIIHH")
_CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")
_EOCD = struct.Struct("<IHHHHIIH")
_EOCD64 = struct.Struct("<IQHHIIQQQQ")
_LOCATOR64 = struct.Struct("<IIQI")
_LOCAL_SIG = 0x04034B50
_CENTRAL_SIG = 0x02014B50
_EOCD_SIG = 0x06054B50
_EOCD64_SIG = 0x06064B50
_LOCATOR64_SIG = 0x07064B50
_ZIP64_ID = 0x0001
_ALIGN = 64


@dataclass(frozen=True)
class Frame:
    """The bytes around one tensor's raw data, and where the CRC-32 goes."""

    head: bytes
    tail: bytes
    data_crc_at_head: int
    data_crc_at_tail: int
    head_crc: int

    def with_crc(self, crc: int) -> tuple[bytes, bytes]:
        """Head and tail with the data member's zip CRC-32 filled in (refdcp leaves it 0 and keeps
        its own CRC-32C; tests use this to check frames end to end with Python's ``zipfile``)."""
        head = bytearray(self.head)
        tail = bytearray(self.tail)
        struct.pack_into("<I", head, self.data_crc_at_head, crc)
        struct.pack_into("<I", tail, self.data_crc_at_tail, crc)
        return bytes(head), bytes(tail)


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


def _pad_extra(offset_after_extras: int) -> bytes:
    pad = (-(offset_after_extras + 4)) % _ALIGN
    return b"FB" + struct.pack("<H", pad) + b"Z" * pad


def _zip64_extra(values: Sequence[int]) -> bytes:
    if not values:
        return b""
    return struct.pack(f"<HH{len(values)}Q", _ZIP64_ID, 8 * len(values), *values)


#: A member: its name and either its bytes or, for raw data written by the caller, its size.
Member = tuple[bytes, "bytes | int"]


def _archive(members: Sequence[Member], force_zip64: bool = False) -> list[bytearray]:
    """The archive's bytes split around its raw members: ``len(raw members) + 1`` segments.

    The zip CRC-32 of raw members is 0; of byte members, their CRC-32.  A raw
    member's data starts 64-byte aligned.  ``force_zip64`` writes the raw
    members' sizes and the end of the archive in zip64 form whatever their
    size (for tests; FMT-20).
    """
    segments = [bytearray()]
    central = bytearray()
    offset = 0
    for name, payload in members:
        raw = isinstance(payload, int)
        size = payload if isinstance(payload, int) else len(payload)
        crc = 0 if isinstance(payload, int) else zlib.crc32(payload)
        big = size >= ZIP64_LIMIT or (raw and force_zip64)
        local_extra = _zip64_extra([size, size] if big else [])
        local_extra += _pad_extra(offset + _LOCAL.size + len(name) + len(local_extra))
        slot = ZIP64_LIMIT if big else size
        version = 45 if big else 20
        out = segments[-1]
        out += _LOCAL.pack(
            _LOCAL_SIG, version, 0, 0, 0, 0, crc, slot, slot, len(name), len(local_extra)
        )
        out += name + local_extra
        if isinstance(payload, int):
            segments.append(bytearray())
        else:
            out += payload
        far = offset >= ZIP64_LIMIT
        central_extra = _zip64_extra(([size, size] if big else []) + ([offset] if far else []))
        central_version = 45 if central_extra else 20
        central += _CENTRAL.pack(
            _CENTRAL_SIG,
            central_version,
            central_version,
            0,
            0,
            0,
            0,
            crc,
            slot,
            slot,
            len(name),
            len(central_extra),
            0,
            0,
            0,
            0,
            ZIP64_LIMIT if far else offset,
        )
        central += name + central_extra
        offset += _LOCAL.size + len(name) + len(local_extra) + size
    tail = segments[-1]
    cd_offset, cd_size, count = offset, len(central), len(members)
    tail += central
    if force_zip64 or cd_offset >= ZIP64_LIMIT or cd_size >= ZIP64_LIMIT or count >= 0xFFFF:
        eocd64_at = cd_offset + cd_size
        tail += _EOCD64.pack(
            _EOCD64_SIG, _EOCD64.size - 12, 45, 45, 0, 0, count, count, cd_size, cd_offset
        )
        tail += _LOCATOR64.pack(_LOCATOR64_SIG, 0, eocd64_at, 1)
        tail += _EOCD.pack(
            _EOCD_SIG,
            0,
            0,
            min(count, 0xFFFF),
            min(count, 0xFFFF),
            min(cd_size, ZIP64_LIMIT),
            ZIP64_LIMIT,
            0,
        )
    else:
        tail += _EOCD.pack(_EOCD_SIG, 0, 0, count, count, cd_size, cd_offset, 0)
    return segments


def _crc_field_positions(segments: Sequence[bytes | bytearray]) -> tuple[int, int]:
    """Where the first raw member's CRC-32 sits in its local header and central entry."""
    head, tail = segments[0], segments[1]
    local_at = head.rfind(struct.pack("<I", _LOCAL_SIG))
    central_at = -1
    pos = tail.find(struct.pack("<I", _CENTRAL_SIG))
    while pos >= 0:
        name_len, extra_len = struct.unpack_from("<HH", tail, pos + 28)
        name = bytes(tail[pos + 46 : pos + 46 + name_len])
        if name.endswith(b"/data/0"):
            central_at = pos
            break
        pos = tail.find(struct.pack("<I", _CENTRAL_SIG), pos + 46 + name_len + extra_len)
    return local_at + 14, central_at + 16


_FRAMES: dict[tuple[torch.dtype, tuple[int, ...], bool], Frame] = {}


def _dense_members(dtype: torch.dtype, shape: tuple[int, ...]) -> list[Member]:
    nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    return [
        (f"{_ARCHIVE}/data.pkl".encode(), _data_pickle(dtype, shape)),
        (f"{_ARCHIVE}/.format_version".encode(), b"1"),
        (f"{_ARCHIVE}/.storage_alignment".encode(), b"64"),
        (f"{_ARCHIVE}/byteorder".encode(), b"little"),
        (f"{_ARCHIVE}/data/0".encode(), nbytes),
        (f"{_ARCHIVE}/version".encode(), b"3\n"),
    ]


def _build(dtype: torch.dtype, shape: tuple[int, ...], force_zip64: bool = False) -> Frame:
    segments = _archive(_dense_members(dtype, shape), force_zip64)
    at_head, at_tail = _crc_field_positions(segments)
    head, tail = bytes(segments[0]), bytes(segments[1])
    return Frame(head, tail, at_head, at_tail, crc32c.crc32c(head))


def frame_for(dtype: torch.dtype, shape: tuple[int, ...], force_zip64: bool = False) -> Frame:
    """The cached frame for a contiguous tensor of this dtype and shape (FMT-3, FMT-20)."""
    key = (dtype, shape, force_zip64)
    frame = _FRAMES.get(key)
    if frame is None:
        frame = _build(dtype, shape, force_zip64)
        if len(_FRAMES) > 4096:
            _FRAMES.clear()
        _FRAMES[key] = frame
    return frame


def storage_view(storage: torch.UntypedStorage) -> memoryview:
    """The bytes of a CPU storage, without copying (the caller keeps ``storage`` alive)."""
    import ctypes

    n = storage.nbytes()
    if n == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_ubyte * n).from_address(storage.data_ptr())).cast("B")


class _RecordingZip:
    """Stands in for torch's zip writer in ``torch.serialization._save``: keeps the records."""

    def __init__(self) -> None:
        self.records: list[tuple[str, bytes | torch.UntypedStorage]] = []

    def write_record(self, name: str, data: Any, nbytes: int) -> None:
        if isinstance(data, str):
            data = data.encode()
        if isinstance(data, torch.UntypedStorage):
            if data.device.type != "cpu":  # pragma: no cover - callers move tensors to CPU
                raise ValueError(f"storage for {name} is on {data.device}, not the CPU")
            self.records.append((name, data))
        else:
            self.records.append((name, bytes(data)[:nbytes]))

    def write_record_metadata(self, name: str, nbytes: int) -> None:  # pragma: no cover
        raise ValueError("torch.serialization skip_data mode cannot frame a checkpoint item")


@dataclass
class Framed:
    """An object framed as a torch.save archive: buffers to write in order, and their owners."""

    parts: list[Any]
    length: int
    keepalive: list[torch.UntypedStorage]


def frame_records(obj: Any, force_zip64: bool = False) -> Framed:
    """Frame any object ``torch.save`` saves, its storages written from memory (FMT-22).

    The pickle and the storage records come from torch's own ``_save`` (so
    quantized, sparse and other tensors pickle exactly as ``torch.save``
    pickles them); refdcp lays them out in the archive and the storages'
    bytes go straight from their memory to the file.
    """
    recorder = _RecordingZip()
    torch.serialization._save(obj, recorder, pickle, 2, False)  # type: ignore[no-untyped-call]
    members: list[Member] = []
    storages: list[torch.UntypedStorage] = []
    for name, data in recorder.records:
        full = f"{_ARCHIVE}/{name}".encode()
        if isinstance(data, torch.UntypedStorage):
            members.append((full, data.nbytes()))
            storages.append(data)
        else:
            members.append((full, data))
    members.append((f"{_ARCHIVE}/version".encode(), b"3\n"))
    segments = _archive(members, force_zip64)
    parts: list[Any] = [bytes(segments[0])]
    for storage, segment in zip(storages, segments[1:]):
        parts.append(storage_view(storage))
        parts.append(bytes(segment))
    return Framed(parts, sum(len(p) for p in parts), storages)


def _zip64_sizes(extra: bytes) -> tuple[int, int] | None:
    pos = 0
    while pos + 4 <= len(extra):
        tag, n = struct.unpack_from("<HH", extra, pos)
        if tag == _ZIP64_ID and n >= 16:
            usize, csize = struct.unpack_from("<QQ", extra, pos + 4)
            return usize, csize
        pos += 4 + n
    return None


def parse_data_span(blob_head: bytes) -> tuple[int, int] | None:
    """(offset, length) of ``*/data/0`` inside a refdcp-framed blob, from its head.

    Returns None when the bytes do not start with refdcp's member order. Tests
    use it to pin the frame layout (FMT-20); readers locate data through the
    zip directory instead (``storage/fs/inplace.py``).
    """
    pos = 0
    for _ in range(5):
        if len(blob_head) < pos + _LOCAL.size:
            return None
        fields = _LOCAL.unpack_from(blob_head, pos)
        if fields[0] != _LOCAL_SIG or fields[3] != 0:
            return None
        name_len, extra_len, size = fields[9], fields[10], fields[8]
        name = blob_head[pos + _LOCAL.size : pos + _LOCAL.size + name_len]
        extra_at = pos + _LOCAL.size + name_len
        if size == ZIP64_LIMIT:
            sizes = _zip64_sizes(blob_head[extra_at : extra_at + extra_len])
            if sizes is None:
                return None
            size = sizes[1]
        data_at = extra_at + extra_len
        if name.endswith(b"/data/0"):
            return data_at, size
        pos = data_at + size
    return None
