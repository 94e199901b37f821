"""Encoding and decoding of one stored item (FMT-2, FMT-3, FMT-4, INTEG-1).

Shared by the filesystem and in-memory storages, so both hold byte-identical
blobs: a BYTE_IO item is the caller's ``torch.save`` bytes; a tensor item is
a torch.save-compatible zip archive (refdcp framing, see ``zipframe``) whose
raw data begins ``data_offset`` bytes into the blob.
"""

from __future__ import annotations

import ctypes
import io
import os
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlanner, ReadItem

from refdcp.crc import kernel as crc32c  # crc32c.crc32c: the fastest kernel (INTEG-9)
from refdcp.errors import RefdcpError
from refdcp.storage.errors import CorruptionError, MissingChecksumError
from refdcp.storage.format.tensor_values import bytes_are_values, values_tensor
from refdcp.storage.format.zipframe import frame_for, frame_records

__all__ = [
    "CRC_ATTR",
    "DATA_OFFSET_ATTR",
    "INPLACE_MIN_BYTES",
    "Encoded",
    "ChunkIndex",
    "checksum_of",
    "data_offset_of",
    "value_digest_seed",
    "encode_bytes",
    "encode_tensor",
    "load_tensor_from_blob",
    "raw_view",
]

#: Extra attributes refdcp sets on torch's ``_StorageInfo`` (torch ignores them).
CRC_ATTR = "refdcp_crc32c"
DATA_OFFSET_ATTR = "refdcp_data_offset"


@dataclass
class Encoded:
    """One item's bytes as a list of buffers, plus its CRC-32C and data offset.

    ``keepalive`` holds the tensor whose memory ``parts`` point into; keep the
    Encoded alive until the parts are written.  For large tensors the CRC is
    computed on a worker thread while the bytes are written (``final_crc``).
    """

    parts: list[Any]
    length: int
    crc: int
    data_offset: int | None
    keepalive: Any = None
    #: (the CRC, the value digest or None), computed on a helper thread
    crc_future: Future[tuple[int, int | None]] | None = None
    #: the CRC of ``parts[0]`` when the writer computes the rest piece by piece as it writes
    #: ``parts[1]`` (``encode_tensor(..., by_writer=True)``, STORE-51); None once it has
    head_crc: int | None = None
    #: a framed tensor's value digest: the CRC over ``parts[0] + parts[1]`` (the frame's
    #: head and the raw values), known with ``crc`` (DEDUP-17); None for other items
    value_crc: int | None = None

    def final_crc(self) -> int:
        if self.head_crc is not None:
            raise RuntimeError("the writer has not computed this item's CRC-32C yet (STORE-51)")
        if self.crc_future is not None:
            self.crc, self.value_crc = self.crc_future.result()
            self.crc_future = None
        return self.crc


#: Items at least this large are never held whole in memory on load: read in place, verified
#: through a bounded buffer, or ``torch.load``-ed from their byte range (STORE-40..STORE-42).
INPLACE_MIN_BYTES = 1 << 20

_CRC_POOL: tuple[int, ThreadPoolExecutor] | None = None


def _crc_pool() -> ThreadPoolExecutor:
    """This process's CRC helper threads: a forked child starts its own (STORE-49)."""
    global _CRC_POOL
    pool = _CRC_POOL
    if pool is None or pool[0] != os.getpid():
        with _CRC_POOL_LOCK:
            if _CRC_POOL is None or _CRC_POOL[0] != os.getpid():
                _CRC_POOL = (os.getpid(), ThreadPoolExecutor(2, thread_name_prefix="refdcp-crc"))
            pool = _CRC_POOL
    return pool[1]


def _forget_crc_pool() -> None:
    global _CRC_POOL, _CRC_POOL_LOCK
    _CRC_POOL, _CRC_POOL_LOCK = None, threading.Lock()


_CRC_POOL_LOCK = threading.Lock()
os.register_at_fork(after_in_child=_forget_crc_pool)  # a lock held at the fork stays held
_ASYNC_CRC_BYTES = 8 << 20
_CARRAYS: dict[int, Any] = {}


def raw_view(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without copying.

    The view does not keep ``t`` alive: the caller must.
    """
    n = t.nbytes
    if n == 0:
        return memoryview(b"")
    ctype = _CARRAYS.get(n)
    if ctype is None:
        ctype = ctypes.c_ubyte * n
        if len(_CARRAYS) > 4096:
            _CARRAYS.clear()
        _CARRAYS[n] = ctype
    return memoryview(ctype.from_address(t.data_ptr())).cast("B")


def _crc_and_value(head_crc: int, data: memoryview, tail: bytes) -> tuple[int, int | None]:
    """(the item's CRC, the value digest): one pass over the data (DEDUP-17)."""
    value = int(crc32c.crc32c(data, head_crc))
    return int(crc32c.crc32c(tail, value)), value


def value_digest_seed(t: torch.Tensor) -> int:
    """What a tensor's value digest is continued from: the CRC of the head of the frame
    ``encode_tensor`` stores it in, else 0 (DEDUP-17). Equal dtype and shape, equal seed."""
    if t.layout != torch.strided or t.is_quantized:
        return 0
    return frame_for(t.dtype, tuple(t.shape)).head_crc


def encode_tensor(tensor: torch.Tensor, by_writer: bool = False) -> Encoded:
    """Frame a tensor as a torch.save archive around its raw bytes (FMT-3, FMT-20, FMT-22).

    Every size takes this path (zip64 records from 4 GiB on); the bytes are
    written from the memory of the tensor's values (SAVE-10) and checksummed
    while they are written: on a helper thread, or, with ``by_writer`` and a
    large plain tensor, by the writer piece by piece (``head_crc`` set, STORE-51).
    """
    t = tensor if bytes_are_values(tensor) and tensor.is_cpu else values_tensor(tensor)  # SAVE-10
    if t.requires_grad:
        t = t.detach()
    if t.layout != torch.strided or t.is_quantized:
        return _encode_with_torch_pickle(t)
    frame = frame_for(t.dtype, tuple(t.shape))
    data = raw_view(t)
    head, tail = frame.head, frame.tail
    length = len(head) + len(data) + len(tail)
    if len(data) >= _ASYNC_CRC_BYTES and by_writer:
        return Encoded([head, data, tail], length, 0, len(head), t, head_crc=frame.head_crc)
    if len(data) >= _ASYNC_CRC_BYTES:
        fut = _crc_pool().submit(_crc_and_value, frame.head_crc, data, tail)
        return Encoded([head, data, tail], length, 0, len(head), t, fut)
    crc, value = _crc_and_value(frame.head_crc, data, tail)
    return Encoded([head, data, tail], length, crc, len(head), t, value_crc=value)


def _crc_parts(parts: Sequence[Any]) -> int:
    crc = 0
    for part in parts:
        crc = crc32c.crc32c(part, crc)
    return int(crc)


def _crc_parts_only(parts: Sequence[Any]) -> tuple[int, int | None]:
    return _crc_parts(parts), None


def _encode_with_torch_pickle(t: torch.Tensor) -> Encoded:
    """Quantized and non-strided tensors: torch's pickling, storages from memory (FMT-22)."""
    if t.layout == torch.strided:
        if not t.is_contiguous():
            t = t.contiguous()
        if t.untyped_storage().nbytes() > t.nbytes:
            t = t.clone()  # a view stores only its own elements (FMT-4)
    framed = frame_records(t)
    keep = (t, framed.keepalive)
    if framed.length >= _ASYNC_CRC_BYTES:
        fut = _crc_pool().submit(_crc_parts_only, framed.parts)
        return Encoded(framed.parts, framed.length, 0, None, keep, fut)
    return Encoded(framed.parts, framed.length, _crc_parts(framed.parts), None, keep)


def encode_bytes(data: io.BytesIO | bytes) -> Encoded:
    """A BYTE_IO item is stored as given (FMT-2)."""
    view = data.getbuffer() if isinstance(data, io.BytesIO) else memoryview(data)
    return Encoded([view], len(view), crc32c.crc32c(view), None)


def checksum_of(info: Any) -> int | None:
    """The CRC-32C recorded for an item, or None (e.g. written by torch)."""
    value = getattr(info, CRC_ATTR, None)
    return value if isinstance(value, int) else None


def data_offset_of(info: Any) -> int | None:
    """Where refdcp-framed raw data starts inside the blob, or None."""
    value = getattr(info, DATA_OFFSET_ATTR, None)
    return value if isinstance(value, int) else None


def make_storage_info(relative_path: str, offset: int, enc: Encoded) -> _StorageInfo:
    """torch's ``_StorageInfo`` plus refdcp's checksum and data offset (INTEG-1)."""
    info = _StorageInfo(relative_path, offset, enc.length)
    setattr(info, CRC_ATTR, enc.final_crc())
    if enc.data_offset is not None:
        setattr(info, DATA_OFFSET_ATTR, enc.data_offset)
    return info


class ChunkIndex:
    """(fqn, chunk offsets) -> (dtype, chunk sizes), built once per load."""

    def __init__(self, metadata: Metadata) -> None:
        self._chunks: dict[tuple[str, tuple[int, ...]], tuple[torch.dtype, tuple[int, ...]]] = {}
        # torch.Size hashes and compares as the tuple of its entries, so the metadata's own
        # (often shared, META-8) Size objects serve as keys and values without copies
        shared: dict[tuple[torch.dtype, tuple[int, ...]], tuple[torch.dtype, tuple[int, ...]]] = {}
        for fqn, md in metadata.state_dict_metadata.items():
            if isinstance(md, TensorStorageMetadata):
                dtype = md.properties.dtype
                for chunk in md.chunks:
                    offsets: tuple[int, ...] = chunk.offsets
                    sizes: tuple[int, ...] = chunk.sizes
                    if type(offsets) is not torch.Size or type(sizes) is not torch.Size:
                        offsets, sizes = tuple(offsets), tuple(sizes)
                    value = (dtype, sizes)
                    self._chunks[(fqn, offsets)] = shared.setdefault(value, value)

    def lookup(self, index: MetadataIndex) -> tuple[torch.dtype, tuple[int, ...]] | None:
        offset = tuple(index.offset) if index.offset is not None else ()
        return self._chunks.get((index.fqn, offset))


def whole_chunk(req: ReadItem, sizes: Sequence[int]) -> bool:
    """True when the read covers the entire saved chunk."""
    return all(o == 0 for o in req.storage_offsets) and tuple(req.lengths) == tuple(sizes)


def narrow(t: torch.Tensor, offsets: Sequence[int], lengths: Sequence[int]) -> torch.Tensor:
    """The sub-box of ``t`` given by ``offsets`` and ``lengths``."""
    for dim, (o, n) in enumerate(zip(offsets, lengths)):
        if o != 0 or n != t.shape[dim]:
            t = t.narrow(dim, o, n)
    return t


def copy_into_destination(planner: LoadPlanner, req: ReadItem, source: torch.Tensor) -> None:
    """resolve_tensor -> size check -> copy_ -> commit_tensor (STORE-12)."""
    target = planner.resolve_tensor(req).detach()
    if target.size() != source.size():
        raise RefdcpError(
            f"read {req.storage_index.fqn}: destination size {tuple(target.size())} "
            f"!= stored size {tuple(source.size())}"
        )
    target.copy_(source)
    planner.commit_tensor(req, target)


def load_tensor_from_blob(
    blob: memoryview,
    info: Any,
    chunk: tuple[torch.dtype, tuple[int, ...]] | None,
    req: ReadItem,
    planner: LoadPlanner,
) -> None:
    """Decode a tensor blob held in memory and deliver it to the planner (STORE-12)."""
    offset = data_offset_of(info)
    if offset is not None and chunk is not None:
        dtype, sizes = chunk
        n = torch.Size(sizes).numel() * torch.empty((), dtype=dtype).element_size()
        window = blob[offset : offset + n]
        if window.readonly:
            window = memoryview(bytearray(window))
        raw = torch.frombuffer(window, dtype=torch.uint8) if n else None
        stored = torch.empty(sizes, dtype=dtype) if raw is None else raw.view(dtype).reshape(sizes)
    else:
        loaded = torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)
        stored = cast(torch.Tensor, loaded)
    copy_into_destination(planner, req, narrow(stored, req.storage_offsets, req.lengths))


def verify_blob(blob: memoryview | bytes, info: Any, fqn: str, file: str) -> None:
    """Raise CorruptionError unless the blob's CRC-32C matches (INTEG-3)."""
    expected = checksum_of(info)
    if expected is None:
        raise MissingChecksumError(
            f"{fqn}: no checksum recorded in {file} (not written by refdcp?)"
        )
    if len(blob) != info.length:
        raise CorruptionError(
            f"item truncated: {len(blob)} of {info.length} bytes",
            fqn=fqn,
            file=file,
            offset=info.offset,
        )
    actual = crc32c.crc32c(blob)
    if actual != expected:
        raise CorruptionError(
            f"checksum mismatch (stored {expected:08x}, computed {actual:08x})",
            fqn=fqn,
            file=file,
            offset=info.offset,
        )
