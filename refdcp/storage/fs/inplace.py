"""Reading a stored tensor straight into place, whatever its size or writer (STORE-40..STORE-42).

``FileSlice`` is a seekable read-only view of one item's byte range in an
open file (reads are ``os.preadv`` into the caller's buffer, nothing is
held).  ``locate_tensor_data`` finds where a plain tensor's elements start
inside a torch.save archive written by torch (no ``refdcp_data_offset``
recorded) from the archive's central directory and its ``data.pkl`` alone,
unpickled with torch's weights-only unpickler onto storages on the ``meta``
device (no element is read or allocated).  ``verify_streaming`` checks an
item's CRC-32C through a bounded buffer.
"""

from __future__ import annotations

import io
import os
import struct
import zipfile
from collections.abc import Sequence
from typing import Any

import torch

from refdcp.crc.kernel import crc32c
from refdcp.storage.errors import CorruptionError

__all__ = ["FileSlice", "STREAM_CHUNK", "locate_tensor_data", "verify_streaming"]

#: Buffer size for streamed checksums (bounded memory however large the item, STORE-41).
STREAM_CHUNK = 8 << 20
_MAX_PICKLE = 16 << 20
_LOCAL = struct.Struct("<IHHHHHIIIHH")


class FileSlice(io.RawIOBase):
    """``length`` bytes of the open file ``fd`` from ``offset``, as a seekable binary stream."""

    def __init__(self, fd: int, offset: int, length: int) -> None:
        super().__init__()
        self._fd, self._offset, self._length, self._pos = fd, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._length}[whence]
        self._pos = max(0, base + pos)
        return self._pos

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        n = max(0, min(len(view), self._length - self._pos))
        if n == 0:
            return 0
        got = os.preadv(self._fd, [view[:n]], self._offset + self._pos)
        self._pos += got
        return got


def _meta_storage(saved_id: Any, keys: list[str]) -> Any:
    typename, storage_type, key, _location, numel = saved_id
    if typename != "storage":
        raise ValueError(f"unexpected persistent id {typename!r}")
    dtype = torch.uint8 if storage_type is torch.UntypedStorage else storage_type.dtype
    keys.append(str(key))
    nbytes = int(numel) * torch.empty((), dtype=dtype).element_size()
    untyped = torch.UntypedStorage(nbytes, device="meta")  # type: ignore[no-untyped-call]
    return torch.storage.TypedStorage(  # type: ignore[no-untyped-call]
        wrap_storage=untyped, dtype=dtype, _internal=True
    )


def _describe(pickled: bytes) -> tuple[torch.Tensor, list[str]] | None:
    """The tensor ``data.pkl`` describes, on the meta device, and the storage keys it uses."""
    from torch import _weights_only_unpickler

    keys: list[str] = []
    unpickler = _weights_only_unpickler.Unpickler(io.BytesIO(pickled), encoding="utf-8")
    unpickler.persistent_load = lambda saved_id: _meta_storage(saved_id, keys)  # type: ignore[method-assign]
    obj = unpickler.load()  # type: ignore[no-untyped-call]
    if type(obj) is not torch.Tensor:
        return None
    return obj, keys


def _member_data_at(stream: FileSlice, info: zipfile.ZipInfo) -> int:
    stream.seek(info.header_offset)
    header = stream.read(_LOCAL.size)
    fields = _LOCAL.unpack(header)
    if fields[0] != 0x04034B50:
        raise zipfile.BadZipFile(f"no local header for {info.filename}")
    return int(info.header_offset + _LOCAL.size + fields[9] + fields[10])


def locate_tensor_data(
    fd: int, offset: int, length: int, dtype: torch.dtype, sizes: Sequence[int]
) -> int | None:
    """Offset, inside the item, of the elements of a stored contiguous tensor (STORE-40).

    None unless the archive at ``fd[offset:offset+length]`` holds exactly one
    plain tensor of ``dtype`` and shape ``sizes``, contiguous, with its whole
    storage inside one stored (uncompressed) member and a ``data.pkl`` of at
    most 16 MiB; the caller then reads the item through ``torch.load`` instead.
    """
    stream = FileSlice(fd, offset, length)
    try:
        with zipfile.ZipFile(stream) as archive:
            infos = archive.infolist()
            pkl = next((i for i in infos if i.filename.endswith("/data.pkl")), None)
            if pkl is None or pkl.file_size > _MAX_PICKLE:
                return None
            described = _describe(archive.read(pkl))
            if described is None:
                return None
            tensor, keys = described
            if (
                len(set(keys)) != 1
                or tensor.layout != torch.strided
                or tensor.dtype != dtype
                or tuple(tensor.shape) != tuple(sizes)
                or not tensor.is_contiguous()
            ):
                return None
            prefix = pkl.filename[: -len("data.pkl")]
            member = archive.getinfo(f"{prefix}data/{keys[0]}")
            if member.compress_type != zipfile.ZIP_STORED:
                return None
            start = tensor.storage_offset() * tensor.element_size()
            stored = tensor.untyped_storage().nbytes()  # what data.pkl says the member holds
            if start + tensor.nbytes > member.file_size or stored > member.file_size:
                return None
            data_at = _member_data_at(stream, member)
    except (zipfile.BadZipFile, KeyError, ValueError, struct.error, RuntimeError, EOFError):
        return None
    except Exception as exc:  # the weights-only unpickler raises its own types
        if type(exc).__name__ == "UnpicklingError":
            return None
        raise
    if data_at + member.file_size > length:
        return None
    return int(data_at + start)


def verify_streaming(fd: int, offset: int, length: int, expected: int, fqn: str, file: str) -> None:
    """Raise CorruptionError unless the item's CRC-32C matches, reading it in bounded chunks (STORE-41)."""
    buf = bytearray(min(STREAM_CHUNK, max(length, 1)))
    view = memoryview(buf)
    crc = 0
    done = 0
    while done < length:
        n = min(len(view), length - done)
        got = os.preadv(fd, [view[:n]], offset + done)
        if got <= 0:
            raise CorruptionError(
                f"item truncated: {done} of {length} bytes", fqn=fqn, file=file, offset=offset
            )
        crc = crc32c(view[:got], crc)
        done += got
    if crc != expected:
        raise CorruptionError(
            f"checksum mismatch (stored {expected:08x}, computed {crc:08x})",
            fqn=fqn,
            file=file,
            offset=offset,
        )
