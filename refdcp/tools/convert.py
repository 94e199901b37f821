"""``refdcp convert SRC DST``: DCP <-> torch.save <-> safetensors, streaming (TOOL-18..22, TOOL-32).

One tensor is in memory at a time: every source is read tensor by tensor
(DCP chunks and safetensors data with ``preadv`` straight into the
destination tensor; a ``torch.save`` file through ``torch.load(mmap=True)``,
dropping each tensor's pages once it is written) and every sink writes a
tensor as soon as it has it (torch.save through torch's own zip writer, a
DCP checkpoint through refdcp's item encoding and ``FileSystemWriter.finish``,
safetensors written by this module). Bytes are copied, never converted, so
every dtype survives bit for bit. What a format cannot hold (a non-tensor
value in safetensors, a dtype safetensors has no name for) is refused before
anything is written.

Sharded safetensors (``safetensors-index``, TOOL-32) is the Hugging Face layout: files
``{stem}-00001-of-0000N.safetensors`` beside ``{stem}.safetensors.index.json``, whose
``weight_map`` names the file of every tensor; torch's ``HuggingFaceStorageWriter``
writes it, and its ``HuggingFaceStorageReader`` reads what this module writes.

The safetensors format (an 8-byte little-endian header length, a JSON header,
then the raw bytes) is written and read here rather than by the
``safetensors`` package, whose ``save_file`` needs every tensor in memory at
once; the tests use the package as an independent oracle.
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import json
import math
import mmap
import os
import pickle
import re
import stat
import struct
import sys
import tempfile
import uuid
import zipfile
import zlib
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import crc32c
import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from refdcp.errors import ConvertError, RefdcpError
from refdcp.planning.flatten import (
    RESERVED_KEY,
    decode_structure,
    flatten_state_dict,
    unflatten_state_dict,
)
from refdcp.storage.errors import CorruptionError
from refdcp.storage.format import layout
from refdcp.storage.format.items import (
    checksum_of,
    data_offset_of,
    encode_bytes,
    encode_tensor,
    make_storage_info,
    raw_view,
)
from refdcp.storage.fs.paths import (
    check_data_name,
    open_data_file,
    open_regular,
    opened_dir,
    pread_exact,
)
from refdcp.storage.fs.safetensors_files import SAFETENSORS_DTYPES, read_header
from refdcp.tools.progress import Progress

__all__ = [
    "FORMATS",
    "DEFAULT_MAX_SHARD_BYTES",
    "INDEX_SUFFIX",
    "MAX_INDEX_BYTES",
    "SAFETENSORS_DTYPES",
    "ConvertError",
    "ConvertReport",
    "convert",
    "convert_command",
    "detect_format",
    "shard_groups",
]

FORMATS = ("dcp", "torch", "safetensors", "safetensors-index")
#: The name that ends a sharded safetensors checkpoint's index (TOOL-32).
INDEX_SUFFIX = ".safetensors.index.json"
#: Largest shard written to sharded safetensors unless told otherwise (Hugging Face's 5GB).
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9
#: Largest index file read (TOOL-34): as large as the largest safetensors header.
MAX_INDEX_BYTES = 100_000_000
#: What refdcp writes in an index's ``metadata``: the mark by which a later
#: ``--overwrite`` knows the index and its shards are refdcp's (TOOL-33).
WRITTEN_BY = ("written_by", "refdcp convert")
#: File extensions that name a format when ``--to``/``--from`` is not given (TOOL-18).
EXTENSIONS = {
    ".pt": "torch",
    ".pth": "torch",
    ".bin": "torch",
    ".ckpt": "torch",
    ".safetensors": "safetensors",
}
#: Bound on the scratch buffer used to scatter a DCP chunk into a strided box.
_SCRATCH_BYTES = 4 << 20
_MADV_DONTNEED = 4


@dataclass
class ConvertReport:
    """What a conversion did: formats, counts, bytes, and what was left out."""

    src: str
    dst: str
    src_format: str
    dst_format: str
    tensors: int = 0
    objects: int = 0
    tensor_bytes: int = 0
    largest_tensor_bytes: int = 0
    dropped: list[str] = field(default_factory=list)
    checksums_verified: int = 0
    shards: int = 0  # files written to sharded safetensors (TOOL-32)
    index: str = ""


def _tensor_nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


# --- format detection ----------------------------------------------------------------------


def detect_format(path: str | os.PathLike[str], *, existing: bool) -> str:
    """The format a path names (TOOL-18).

    A name ending ``.safetensors.index.json``, or an existing directory holding
    such a file and no ``.metadata``, is sharded safetensors (TOOL-32); another
    existing directory is DCP; otherwise the extension decides
    (``.safetensors``; ``.pt``/``.pth``/``.bin``/``.ckpt`` for torch.save); a
    destination without a known extension is a DCP directory. An existing
    source file of unknown extension is sniffed (zip -> torch.save).
    """
    p = Path(path)
    if p.name.endswith(INDEX_SUFFIX):
        return "safetensors-index"
    if p.is_dir():
        if not (p / layout.METADATA_NAME).exists() and _index_files(p):
            return "safetensors-index"
        return "dcp"
    fmt = EXTENSIONS.get(p.suffix.lower())
    if fmt is not None:
        return fmt
    if existing and p.is_file():
        fd = _open_named(p)
        try:
            head = os.pread(fd, 4, 0)
        finally:
            os.close(fd)
        if head == b"PK\x03\x04":
            return "torch"
        raise ConvertError(f"{p}: cannot tell its format from its name; pass --from")
    if existing:
        raise ConvertError(f"{p}: no such file or directory")
    return "dcp"


def _open_named(path: Path, flags: int = os.O_RDONLY) -> int:
    """A safetensors, index or torch.save file the user named, through the opening rule
    (STORE-59): a FIFO, device or directory is refused without blocking; a symbolic
    link is followed, since Hugging Face caches link snapshot files to their blobs."""
    try:
        return open_regular(path, flags, follow_links=True)
    except RefdcpError as exc:
        raise ConvertError(str(exc)) from exc


def _read_index(fd: int, file: str | os.PathLike[str]) -> bytes:
    """The whole of an index file open at ``fd``, refused unread when larger than
    ``MAX_INDEX_BYTES`` (TOOL-34)."""
    size = os.fstat(fd).st_size
    if size <= MAX_INDEX_BYTES:
        data = pread_exact(fd, size + 1, 0)
        if len(data) <= MAX_INDEX_BYTES:
            return data
    raise ConvertError(
        f"{file}: an index of {max(size, MAX_INDEX_BYTES + 1)} bytes is larger than the "
        f"{MAX_INDEX_BYTES} bytes refdcp reads; refused unread"
    )


# --- sources ---------------------------------------------------------------------------------


class _Source:
    """A checkpoint read tensor by tensor.

    ``structure`` is the nested state dict with every tensor replaced by a
    meta tensor of its dtype and shape; ``read(fqn)`` returns the data of the
    tensor at flattened key ``fqn`` as a contiguous CPU tensor, valid until the
    next ``read`` (sources that copy reuse one buffer the size of the largest
    tensor, so memory does not depend on how the allocator recycles blocks).
    """

    structure: dict[Any, Any]
    flat: dict[str, Any]
    checksums_verified = 0
    _buffer: torch.Tensor | None = None

    def read(self, fqn: str) -> torch.Tensor:
        raise NotImplementedError

    def release(self, tensor: torch.Tensor) -> None:
        """Called once ``tensor`` (from ``read``) is written."""

    def close(self) -> None:
        self._buffer = None

    def _empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised tensor in the shared read buffer."""
        nbytes = _tensor_nbytes(shape, dtype)
        if nbytes == 0:
            return torch.empty(shape, dtype=dtype)
        if self._buffer is None or self._buffer.numel() < nbytes:
            largest = max(
                (
                    _tensor_nbytes(tuple(v.shape), v.dtype)
                    for v in self.flat.values()
                    if isinstance(v, torch.Tensor)
                ),
                default=0,
            )
            self._buffer = None
            self._buffer = torch.empty(max(largest, nbytes), dtype=torch.uint8)
        return self._buffer[:nbytes].view(dtype).view(shape)


def _meta(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta")


class _DcpSource(_Source):
    """A DCP directory (torch's or refdcp's FileSystemWriter layout)."""

    def __init__(self, path: Path) -> None:
        from refdcp.storage.fs.metadata_file import read_metadata_file
        from refdcp.storage.metadata.safe import load_metadata

        self.path = path
        md_file = path / layout.METADATA_NAME
        if not md_file.is_file():
            raise ConvertError(f"{path}: no {md_file.name}: not a committed DCP checkpoint")
        # capped, regular-file-only read, then the checked unpickler (FMT-9, FMT-10)
        self.metadata: Metadata = load_metadata(read_metadata_file(md_file), file=str(md_file))
        storage = self.metadata.storage_data
        if not isinstance(storage, Mapping):
            raise ConvertError(f"{path}: .metadata has no storage records")
        self.storage: Mapping[MetadataIndex, Any] = storage
        self._fds: dict[str, int] = {}
        items: dict[str, Any] = {}
        for fqn, entry in self.metadata.state_dict_metadata.items():
            if isinstance(entry, TensorStorageMetadata):
                items[fqn] = _meta(tuple(entry.size), entry.properties.dtype)
            elif isinstance(entry, BytesStorageMetadata):
                items[fqn] = self._load_object(fqn)
            else:
                raise ConvertError(f"{fqn}: unknown metadata entry {type(entry).__name__}")
        planner_data = self.metadata.planner_data or {}
        paths = {fqn: tuple(planner_data.get(fqn) or (fqn,)) for fqn in items}
        extra = planner_data.get(RESERVED_KEY)
        rich, empties = decode_structure(paths, extra if isinstance(extra, Mapping) else None)
        self.flat = items
        self.structure = unflatten_state_dict(items, rich, empties)

    def _fd(self, relative_path: str) -> int:
        fd = self._fds.get(relative_path)
        if fd is None:
            fd = open_data_file(self.path, relative_path)  # the readers' rule (STORE-27)
            self._fds[relative_path] = fd
        return fd

    def _info(self, fqn: str, offset: Any) -> Any:
        info = self.storage.get(MetadataIndex(fqn, offset))
        if info is None:
            raise CorruptionError(
                "no storage record for this item", fqn=fqn, file=layout.METADATA_NAME, offset=0
            )
        if getattr(info, "transform_descriptors", None):
            raise ConvertError(
                f"{fqn}: stored with stream transforms {info.transform_descriptors}, "
                "which refdcp convert does not decode"
            )
        size = os.fstat(self._fd(info.relative_path)).st_size
        if info.offset + info.length > size:  # before anything is allocated for it (TOOL-29)
            raise CorruptionError(
                f"item truncated: the data file holds {size} bytes, the item needs "
                f"{info.offset + info.length}",
                fqn=fqn,
                file=info.relative_path,
                offset=info.offset,
            )
        return info

    def _blob(self, fqn: str, info: Any) -> bytes:
        fd = self._fd(info.relative_path)
        blob = os.pread(fd, info.length, info.offset)
        if len(blob) != info.length:
            raise CorruptionError(
                "data file truncated", fqn=fqn, file=info.relative_path, offset=info.offset
            )
        expected = checksum_of(info)
        if expected is not None:
            if crc32c.crc32c(blob) != expected:
                raise CorruptionError(
                    "checksum mismatch", fqn=fqn, file=info.relative_path, offset=info.offset
                )
            self.checksums_verified += 1
        return blob

    def _load_object(self, fqn: str) -> Any:
        info = self._info(fqn, None)
        blob = self._blob(fqn, info)
        try:
            return torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)
        except Exception as exc:
            raise ConvertError(
                f"{fqn}: the stored object does not load with weights_only=True "
                f"({type(exc).__name__}: {str(exc).splitlines()[0]})"
            ) from exc

    def read(self, fqn: str) -> torch.Tensor:
        entry = self.metadata.state_dict_metadata[fqn]
        assert isinstance(entry, TensorStorageMetadata)
        dtype = entry.properties.dtype
        out = self._empty(tuple(entry.size), dtype)
        _check_cover(
            fqn, tuple(entry.size), [(tuple(c.offsets), tuple(c.sizes)) for c in entry.chunks]
        )
        for chunk in entry.chunks:
            info = self._info(fqn, chunk.offsets)
            box = out
            for dim, (o, n) in enumerate(zip(chunk.offsets, chunk.sizes)):
                box = box.narrow(dim, int(o), int(n))
            self._read_chunk(fqn, info, box)
        return out

    def _read_chunk(self, fqn: str, info: Any, box: torch.Tensor) -> None:
        nbytes = box.numel() * box.element_size()
        fd = self._fd(info.relative_path)
        file = info.relative_path
        start = data_offset_of(info)
        zip_crc: int | None = None
        if start is None:
            span = _torch_save_span(fd, info, box.dtype, tuple(box.shape))
            if span is None:  # not a plain contiguous tensor archive: decode it whole
                blob = self._blob(fqn, info)
                try:
                    stored = torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)
                except Exception as exc:
                    raise CorruptionError(
                        f"stored chunk does not load ({type(exc).__name__}: "
                        f"{str(exc).splitlines()[0]})",
                        fqn=fqn,
                        file=file,
                        offset=info.offset,
                    ) from exc
                if (
                    not isinstance(stored, torch.Tensor)
                    or stored.shape != box.shape
                    or stored.dtype != box.dtype
                ):
                    raise CorruptionError(
                        f"stored chunk is not a {box.dtype} tensor of shape {tuple(box.shape)}",
                        fqn=fqn,
                        file=file,
                        offset=info.offset,
                    )
                box.copy_(stored)
                return
            start, zip_crc = span
        if start + nbytes > info.length:
            raise CorruptionError(
                f"item of {info.length} bytes cannot hold {nbytes} bytes of data at {start}",
                fqn=fqn,
                file=file,
                offset=info.offset,
            )
        expected = checksum_of(info)
        crc = 0
        if expected is not None:
            crc = crc32c.crc32c(_pread_exact(fd, start, info.offset, fqn, file))
        hashes: list[Callable[[memoryview], None]] = []
        state = {"crc": crc, "zip": 0}
        if expected is not None:
            hashes.append(lambda mv: state.__setitem__("crc", crc32c.crc32c(mv, state["crc"])))
        if zip_crc:
            hashes.append(lambda mv: state.__setitem__("zip", zlib.crc32(mv, state["zip"])))
        _read_box(fd, info.offset + start, box, fqn, file, hashes)
        if expected is not None:
            tail_at = info.offset + start + nbytes
            tail = _pread_exact(fd, info.length - start - nbytes, tail_at, fqn, file)
            if crc32c.crc32c(tail, state["crc"]) != expected:
                raise CorruptionError("checksum mismatch", fqn=fqn, file=file, offset=info.offset)
            self.checksums_verified += 1
        if zip_crc and state["zip"] != zip_crc:
            raise CorruptionError(
                "zip CRC-32 of the tensor data does not match",
                fqn=fqn,
                file=file,
                offset=info.offset,
            )

    def close(self) -> None:
        super().close()
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


def _check_cover(
    fqn: str, size: tuple[int, ...], chunks: list[tuple[tuple[int, ...], tuple[int, ...]]]
) -> None:
    """The saved chunks tile the tensor exactly: inside it, disjoint, covering it."""
    total = 0
    for offsets, sizes in chunks:
        if len(offsets) != len(size) or any(
            o < 0 or n < 0 or o + n > s for o, n, s in zip(offsets, sizes, size)
        ):
            raise ConvertError(
                f"{fqn}: chunk at {list(offsets)} of {list(sizes)} lies outside {list(size)}"
            )
        total += math.prod(sizes)
    # a sweep along dimension 0: only chunks whose row ranges meet can overlap
    boxes = sorted((c for c in chunks if math.prod(c[1])), key=lambda c: c[0][:1])
    active: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    for ob, sb in boxes:
        active = [a for a in active if not size or a[0][0] + a[1][0] > ob[0]]
        for oa, sa in active:
            if all(a < b + m and b < a + n for a, n, b, m in zip(oa, sa, ob, sb)):
                raise ConvertError(f"{fqn}: saved chunks at {list(oa)} and {list(ob)} overlap")
        active.append((ob, sb))
    if total != math.prod(size):
        raise ConvertError(f"{fqn}: the saved chunks cover {total} of {math.prod(size)} elements")


def _pread_exact(fd: int, n: int, offset: int, fqn: str, file: str) -> bytes:
    data = os.pread(fd, n, offset)
    if len(data) != n:
        raise CorruptionError("data file truncated", fqn=fqn, file=file, offset=offset + len(data))
    return data


def _readinto(fd: int, view: memoryview, offset: int, fqn: str, file: str) -> None:
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            raise CorruptionError("data file truncated", fqn=fqn, file=file, offset=offset + done)
        done += n


def _read_box(
    fd: int,
    offset: int,
    box: torch.Tensor,
    fqn: str,
    file: str,
    hashes: list[Callable[[memoryview], None]],
) -> int:
    """Fill ``box`` from row-major bytes at ``offset``, with at most a bounded scratch buffer."""
    nbytes = box.numel() * box.element_size()
    if nbytes == 0:
        return 0
    if box.is_contiguous():
        view = raw_view(box)
        _readinto(fd, view, offset, fqn, file)
        for h in hashes:
            h(view)
        return nbytes
    if nbytes <= _SCRATCH_BYTES:
        scratch = torch.empty(box.shape, dtype=box.dtype)
        view = raw_view(scratch)
        _readinto(fd, view, offset, fqn, file)
        for h in hashes:
            h(view)
        box.copy_(scratch)
        return nbytes
    row = nbytes // box.shape[0]
    step = max(1, _SCRATCH_BYTES // row)
    done = 0
    for i in range(0, box.shape[0], step):
        part = box[i] if step == 1 else box[i : i + step]
        done += _read_box(fd, offset + done, part, fqn, file, hashes)
    return done


# torch.save archives inside DCP files: find the raw data of a plain tensor ---------------------

_LOCAL = struct.Struct("<IHHHHHIIIHH")
_LOCAL_SIG = 0x04034B50


class _StorageStub:
    def __init__(self, dtype: torch.dtype, key: str, numel: int) -> None:
        self.dtype, self.key, self.numel = dtype, key, numel


class _TensorStub:
    def __init__(self, *args: Any) -> None:
        self.args = args


class _ArchiveUnpickler(pickle.Unpickler):
    """Reads a torch.save data.pkl without running anything: only the names a tensor needs."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in (
            ("torch._utils", "_rebuild_tensor_v2"),
            ("torch._utils", "_rebuild_tensor_v3"),
        ):
            return _TensorStub
        if module in ("torch", "torch.storage") and name == "UntypedStorage":
            return "UntypedStorage"
        if (module, name) == ("collections", "OrderedDict"):
            return OrderedDict
        if module == "torch" and name.endswith("Storage"):
            return name
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        kind, storage_type, key, _location, numel = pid
        if kind != "storage" or not isinstance(storage_type, str):
            raise pickle.UnpicklingError(repr(pid))
        if storage_type == "UntypedStorage":
            return _StorageStub(torch.uint8, str(key), int(numel))
        legacy = getattr(torch, storage_type, None)
        dtype = getattr(legacy, "dtype", None)
        if not isinstance(dtype, torch.dtype):
            raise pickle.UnpicklingError(storage_type)
        return _StorageStub(dtype, str(key), int(numel))


class _BlobFile(io.RawIOBase):
    """A read-only file object over ``length`` bytes at ``offset`` of ``fd`` (one stored item)."""

    def __init__(self, fd: int, offset: int, length: int) -> None:
        self.fd, self.offset, self.length, self.pos = fd, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, pos: int, whence: int = 0) -> int:
        base = {0: 0, 1: self.pos, 2: self.length}[whence]
        self.pos = max(0, base + pos)
        return self.pos

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        n = max(0, min(len(view), self.length - self.pos))
        data = os.pread(self.fd, n, self.offset + self.pos)
        view[: len(data)] = data
        self.pos += len(data)
        return len(data)


def _torch_save_span(
    fd: int, info: Any, dtype: torch.dtype, shape: tuple[int, ...]
) -> tuple[int, int] | None:
    """(offset of the raw data within the item, its zip CRC-32) for a torch.save archive
    holding one contiguous tensor of ``dtype`` and ``shape`` at storage offset 0; None
    when the archive is anything else (the caller then decodes it with torch.load).

    Only the zip's central directory, ``data.pkl`` (read with an unpickler that knows
    nothing but the names a tensor needs) and ``byteorder`` are read here."""
    try:
        with zipfile.ZipFile(_BlobFile(fd, info.offset, info.length)) as z:
            members = {m.filename.split("/", 1)[-1]: m for m in z.infolist()}
            pkl, data = members.get("data.pkl"), members.get("data/0")
            order = members.get("byteorder")
            if pkl is None or data is None or data.compress_type != zipfile.ZIP_STORED:
                return None
            if order is not None and z.read(order) != b"little":
                return None
            obj = _ArchiveUnpickler(io.BytesIO(z.read(pkl))).load()
            head = os.pread(fd, _LOCAL.size, info.offset + data.header_offset)
            fields = _LOCAL.unpack(head)
            if fields[0] != _LOCAL_SIG:
                return None
            start = data.header_offset + _LOCAL.size + fields[9] + fields[10]
    except (zipfile.BadZipFile, pickle.UnpicklingError, struct.error, ValueError, KeyError):
        return None
    if not isinstance(obj, _TensorStub) or len(obj.args) < 4:
        return None
    storage, storage_offset, size_, stride = obj.args[:4]
    numel = math.prod(shape)
    if isinstance(storage, _StorageStub) and storage.dtype == torch.uint8 and len(obj.args) >= 7:
        # _rebuild_tensor_v3: an untyped storage (numel in bytes) and the dtype as an argument
        if not isinstance(obj.args[6], torch.dtype) or storage.numel % obj.args[6].itemsize:
            return None
        storage = _StorageStub(obj.args[6], storage.key, storage.numel // obj.args[6].itemsize)
    if (
        not isinstance(storage, _StorageStub)
        or storage.key != "0"
        or storage.dtype != dtype
        or storage.numel != numel
        or storage_offset != 0
        or tuple(size_) != shape
        or (numel > 1 and tuple(stride) != _contiguous_strides(shape))
        or data.file_size != numel * dtype.itemsize
    ):
        return None
    return start, data.CRC


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(strides))


class _SafetensorsSource(_Source):
    """One safetensors file: the file the user named (a link followed, STORE-59), or with
    ``dir_fd`` a shard an index names, opened in that directory with no link followed
    (STORE-64); its header checked as the ``safetensors`` package checks it (TOOL-34)."""

    def __init__(self, path: Path, dir_fd: int | None = None) -> None:
        self.path = path
        if dir_fd is None:
            self.fd = _open_named(path)
        else:
            try:
                self.fd = open_regular(path.name, os.O_RDONLY, dir_fd=dir_fd)
            except RefdcpError as exc:
                raise ConvertError(
                    f"{exc} (a shard an index names is read only as a regular file of the "
                    "index's directory: copy linked files in, e.g. with cp -L)"
                ) from exc
        try:
            header = read_header(self.fd, str(path))
        except CorruptionError as exc:
            os.close(self.fd)
            raise ConvertError(str(exc)) from exc
        self.base = header.base
        self.entries: dict[str, tuple[torch.dtype, tuple[int, ...], int]] = {}
        self.flat = {}
        for key, e in header.entries.items():
            self.entries[key] = (e.dtype, e.shape, e.begin)
            self.flat[key] = _meta(e.shape, e.dtype)
        self.structure = dict(self.flat)

    def read(self, fqn: str) -> torch.Tensor:
        dtype, shape, begin = self.entries[fqn]
        out = self._empty(shape, dtype)
        if out.numel():
            _readinto(self.fd, raw_view(out), self.base + begin, fqn, str(self.path))
        return out

    def close(self) -> None:
        super().close()
        os.close(self.fd)


def _index_files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.iterdir() if p.name.endswith(INDEX_SUFFIX))


class _IndexSource(_Source):
    """Sharded safetensors: the index's ``weight_map`` and the files it names (TOOL-32).

    Every file named must be a plain name in the index's directory, opened there with no
    link followed (STORE-64); the index is read bounded (TOOL-34), and the index and
    the files' headers must agree key for key: a key the index names that its file
    lacks, or a tensor of a file that the index leaves out or puts elsewhere, is refused.
    """

    def __init__(self, path: Path) -> None:
        named = not path.is_dir()  # the user named the index itself: a link is followed
        if not named:
            found = _index_files(path)
            if len(found) != 1:
                raise ConvertError(
                    f"{path}: holds {len(found)} *{INDEX_SUFFIX} files "
                    f"({', '.join(p.name for p in found) or 'none'}); name the index itself"
                )
            path = found[0]
        self.path = path
        self.files: dict[str, _SafetensorsSource] = {}
        dfd = opened_dir(path.parent)
        try:
            try:
                fd = (
                    _open_named(path) if named else open_regular(path.name, os.O_RDONLY, dir_fd=dfd)
                )
            except RefdcpError as exc:
                raise ConvertError(str(exc)) from exc
            try:
                index = json.loads(_read_index(fd, path))
            except (OSError, ValueError) as exc:
                raise ConvertError(f"{path}: not a readable JSON index: {exc}") from exc
            finally:
                os.close(fd)
            weight_map = index.get("weight_map") if isinstance(index, dict) else None
            if not isinstance(weight_map, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
            ):
                raise ConvertError(f"{path}: no weight_map of tensor names to file names")
            for name in dict.fromkeys(weight_map.values()):
                try:
                    check_data_name(name, file=path.name)
                except RefdcpError as exc:
                    raise ConvertError(str(exc)) from exc
                # a shard is a file of the index's directory: no link followed (STORE-64)
                self.files[name] = _SafetensorsSource(path.parent / name, dir_fd=dfd)
            for name, part in self.files.items():
                wanted = {k for k, v in weight_map.items() if v == name}
                if wanted != set(part.entries):
                    lacks, extra = (
                        sorted(wanted - set(part.entries)),
                        sorted(set(part.entries) - wanted),
                    )
                    raise ConvertError(
                        f"{path}: the index and {name} disagree: the index names "
                        f"{lacks[:5]} there, which it lacks; it holds {extra[:5]}, which the "
                        "index does not put there"
                    )
        except BaseException:
            self.close()
            raise
        finally:
            os.close(dfd)
        self.where = dict(weight_map)
        self.flat = {k: self.files[v].flat[k] for k, v in weight_map.items()}
        self.structure = dict(self.flat)

    def read(self, fqn: str) -> torch.Tensor:
        part = self.files[self.where[fqn]]
        dtype, shape, begin = part.entries[fqn]
        out = self._empty(shape, dtype)
        if out.numel():
            _readinto(part.fd, raw_view(out), part.base + begin, fqn, str(part.path))
        return out

    def close(self) -> None:
        super().close()
        for part in getattr(self, "files", {}).values():
            part.close()


class _TorchSaveSource(_Source):
    """A torch.save file, memory-mapped; each tensor's pages are dropped once written."""

    def __init__(self, path: Path) -> None:
        os.close(_open_named(path))  # a FIFO or device is refused, never waited on (STORE-59)
        try:
            loaded = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except Exception as exc:
            raise ConvertError(
                f"{path}: torch.load(weights_only=True, mmap=True) failed: "
                f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
            ) from exc
        if not isinstance(loaded, Mapping):
            raise ConvertError(f"{path}: holds a {type(loaded).__name__}, not a state dict")
        flat = flatten_state_dict(loaded)
        self.tensors: dict[str, torch.Tensor] = {}
        items: dict[str, Any] = {}
        for fqn, value in flat.items.items():
            if isinstance(value, torch.Tensor):
                if value.layout != torch.strided or value.is_quantized:
                    raise ConvertError(f"{fqn}: a {value.layout} tensor cannot be converted")
                self.tensors[fqn] = value
                items[fqn] = _meta(tuple(value.shape), value.dtype)
            else:
                items[fqn] = value
        self.flat = items
        self.structure = unflatten_state_dict(items, flat.rich, flat.empties)

    def read(self, fqn: str) -> torch.Tensor:
        return self.tensors[fqn].detach().contiguous()

    def release(self, tensor: torch.Tensor) -> None:
        _drop_pages(tensor)


def _drop_pages(tensor: torch.Tensor) -> None:
    """madvise(DONTNEED) the whole pages of a file-mapped tensor: clean private pages are
    simply re-read if touched again, so this only returns memory (Linux; a no-op elsewhere)."""
    if not sys.platform.startswith("linux") or tensor.numel() == 0:
        return
    page = mmap.PAGESIZE
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    first, last = -(-start // page) * page, end // page * page
    if last > first:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), _MADV_DONTNEED)


# --- sinks -----------------------------------------------------------------------------------


def _tensor_keys(src: _Source) -> list[str]:
    return [k for k, v in src.flat.items() if isinstance(v, torch.Tensor)]


def _object_keys(src: _Source) -> list[str]:
    return [k for k, v in src.flat.items() if not isinstance(v, torch.Tensor)]


class _StorageRef:
    def __init__(self, fqn: str, key: str, dtype: torch.dtype, numel: int) -> None:
        self.fqn, self.key, self.dtype, self.numel = fqn, key, dtype, numel


class _ZipPickler(pickle.Pickler):
    """Pickles the structure as torch.save's data.pkl does, tensors as storage references."""

    def __init__(self, buf: io.BytesIO, placeholders: dict[int, str]) -> None:
        super().__init__(buf, protocol=2)
        self.placeholders = placeholders  # id(meta tensor) -> fqn
        self.refs: list[_StorageRef] = []
        self.real: dict[str, torch.UntypedStorage] = {}
        self._ids: dict[int, str] = {}

    def _next_key(self) -> str:
        return str(len(self.refs) + len(self.real))

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor) and id(obj) in self.placeholders:
            ref = _StorageRef(self.placeholders[id(obj)], self._next_key(), obj.dtype, obj.numel())
            self.refs.append(ref)
            stride = _contiguous_strides(tuple(obj.shape))
            args: tuple[Any, ...] = (ref, 0, tuple(obj.shape), stride, False, OrderedDict())
            if obj.dtype in _V3_DTYPES:  # as torch.save: an untyped storage, the dtype apart
                return (torch._utils._rebuild_tensor_v3, (*args, obj.dtype))
            return (torch._utils._rebuild_tensor_v2, args)
        return NotImplemented

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, _StorageRef):
            if obj.dtype in _V3_DTYPES:
                nbytes = obj.numel * obj.dtype.itemsize
                return ("storage", torch.UntypedStorage, obj.key, "cpu", nbytes)
            return ("storage", _storage_type(obj.dtype), obj.key, "cpu", obj.numel)
        if isinstance(obj, torch.UntypedStorage):  # a tensor inside a saved object
            untyped_storage: Any = obj.cpu()  # type: ignore[no-untyped-call]
            key = self._ids.setdefault(untyped_storage._cdata, self._next_key())
            self.real[key] = untyped_storage
            return ("storage", torch.UntypedStorage, key, "cpu", untyped_storage.nbytes())
        if isinstance(obj, torch.storage.TypedStorage):  # a tensor inside a saved object
            typed: Any = obj
            untyped = typed._untyped_storage.cpu()
            key = self._ids.setdefault(untyped._cdata, self._next_key())
            self.real[key] = untyped
            return (
                "storage",
                getattr(torch, typed._pickle_storage_type()),
                key,
                "cpu",
                typed._size(),
            )
        return None


#: dtypes torch.save pickles with ``_rebuild_tensor_v3`` and an untyped storage.
_V3_DTYPES = frozenset(torch.storage._new_dtypes())


def _storage_type(dtype: torch.dtype) -> Any:
    typed: Any = torch.storage.TypedStorage(  # type: ignore[no-untyped-call]
        dtype=dtype, device="cpu", _internal=True
    )
    return getattr(torch, typed._pickle_storage_type())


def _write_torch_save(
    src: _Source, dst: io.BufferedWriter, progress: Progress, report: ConvertReport
) -> None:
    """torch's zip writer into ``dst``, a new file convert created (STORE-63)."""
    placeholders = {id(v): k for k, v in src.flat.items() if isinstance(v, torch.Tensor)}
    buf = io.BytesIO()
    pickler = _ZipPickler(buf, placeholders)
    pickler.dump(src.structure)
    from torch.serialization import _get_storage_alignment, get_crc32_options

    writer: Any = torch._C.PyTorchFileWriter(dst, get_crc32_options(), _get_storage_alignment())
    try:
        data = buf.getvalue()
        writer.write_record("data.pkl", data, len(data))
        writer.write_record(".format_version", "1", 1)
        alignment = str(_get_storage_alignment())
        writer.write_record(".storage_alignment", alignment, len(alignment))
        writer.write_record("byteorder", sys.byteorder, len(sys.byteorder))
        for ref in pickler.refs:
            tensor = src.read(ref.fqn)
            _count(report, tensor)
            storage = tensor.untyped_storage()
            if storage.data_ptr() != tensor.data_ptr() or not tensor.is_contiguous():
                tensor = tensor.contiguous().clone()  # only reads that are not at a buffer's start
                storage = tensor.untyped_storage()
            # the record is the storage's first nbytes bytes: the tensor (read buffers start at 0)
            writer.write_record(f"data/{ref.key}", storage, tensor.nbytes)
            src.release(tensor)
            progress.update(tensor.nbytes)
            del tensor, storage
        for key, untyped in pickler.real.items():
            writer.write_record(f"data/{key}", untyped, untyped.nbytes())
        writer.write_end_of_file()
    except BaseException:
        # the writer writes its end records when it is destroyed: let it do so now, while
        # dst is open (writing to a closed file object from its destructor aborts Python)
        with contextlib.suppress(Exception):
            writer.write_end_of_file()
        raise
    finally:
        del writer
    dst.flush()


def _count(report: ConvertReport, tensor: torch.Tensor) -> None:
    report.tensors += 1
    report.tensor_bytes += tensor.nbytes
    report.largest_tensor_bytes = max(report.largest_tensor_bytes, tensor.nbytes)


def _safetensors_header(src: _Source, keys: list[str]) -> bytes:
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for key in keys:
        meta = src.flat[key]
        dtype = meta.dtype
        if dtype not in SAFETENSORS_DTYPES:
            raise ConvertError(
                f"{key}: dtype {str(dtype).replace('torch.', '')} has no safetensors name "
                f"(safetensors holds {', '.join(sorted(SAFETENSORS_DTYPES.values()))})"
            )
        n = _tensor_nbytes(tuple(meta.shape), dtype)
        header[key] = {
            "dtype": SAFETENSORS_DTYPES[dtype],
            "shape": list(meta.shape),
            "data_offsets": [offset, offset + n],
        }
        offset += n
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def _write_safetensors(
    src: _Source, f: io.BufferedWriter, progress: Progress, report: ConvertReport, keys: list[str]
) -> None:
    """A safetensors file into ``f``, a new file convert created (STORE-63)."""
    f.write(_safetensors_header(src, keys))
    for key in keys:
        tensor = src.read(key)
        _count(report, tensor)
        if tensor.numel():
            f.write(raw_view(tensor))
        src.release(tensor)
        progress.update(tensor.nbytes)
        del tensor
    f.flush()


def _new_file(folder: Path, prefix: str) -> tuple[io.BufferedWriter, str]:
    """A new file under a random name in ``folder`` (``O_CREAT|O_EXCL``), written through
    the descriptor that created it, never reopened by name (STORE-63)."""
    fd, tmp = tempfile.mkstemp(prefix=prefix, suffix=".partial", dir=folder)
    return open(fd, "wb"), os.path.basename(tmp)


def shard_groups(src: _Source, keys: list[str], max_shard_bytes: int) -> list[list[str]]:
    """``keys`` in order, cut into shards of at most ``max_shard_bytes`` of tensor data;
    a tensor larger than that is a shard of its own (TOOL-32)."""
    groups: list[list[str]] = []
    size = 0
    for key in keys:
        n = _tensor_nbytes(tuple(src.flat[key].shape), src.flat[key].dtype)
        if not groups or (groups[-1] and size + n > max_shard_bytes):
            groups.append([])
            size = 0
        groups[-1].append(key)
        size += n
    return groups or [[]]


def _index_target(dst: Path) -> tuple[Path, str]:
    """The index file and the shards' stem for a sharded-safetensors destination."""
    if dst.name.endswith(INDEX_SUFFIX):
        return dst, dst.name[: -len(INDEX_SUFFIX)]
    return dst / f"model{INDEX_SUFFIX}", "model"


def _write_safetensors_index(
    src: _Source,
    dst: Path,
    progress: Progress,
    report: ConvertReport,
    keys: list[str],
    max_shard_bytes: int,
) -> None:
    """Each shard and the index under new names, then renamed into place, the index last.

    What a name already held is moved aside first and moved back when anything fails, so
    a failed conversion leaves the destination as it was (TOOL-32, TOOL-33); once the
    index is in place the moved-aside files go, and the replaced index's shards that
    refdcp can prove it wrote (TOOL-33)."""
    index_path, stem = _index_target(dst)
    folder = index_path.parent
    folder.mkdir(parents=True, exist_ok=True)
    groups = shard_groups(src, keys, max_shard_bytes)
    names = [f"{stem}-{i:05d}-of-{len(groups):05d}.safetensors" for i in range(1, len(groups) + 1)]
    dfd = opened_dir(folder)
    try:
        ours, theirs = _replaced_shards(dfd, index_path.name, stem, set(names))
        if theirs:
            raise ConvertError(
                f"{folder}: the index being replaced names {', '.join(theirs[:5])}, which this "
                "conversion does not replace and refdcp cannot tell it wrote: remove them, or "
                "convert into a new directory; nothing was written"
            )
        temps: list[str] = []
        placed: list[str] = []
        moved: list[tuple[str, str]] = []
        try:
            for group in groups:
                f, tmp = _new_file(folder, f".{stem}.")
                temps.append(tmp)
                with f:
                    _write_safetensors(src, f, progress, report, group)
            index = {
                "metadata": {"total_size": report.tensor_bytes, WRITTEN_BY[0]: WRITTEN_BY[1]},
                "weight_map": {k: names[i] for i, group in enumerate(groups) for k in group},
            }
            f, tmp = _new_file(folder, f".{index_path.name}.")
            temps.append(tmp)
            with f:
                f.write((json.dumps(index, indent=2) + "\n").encode())
            for tmp, name in zip(temps, [*names, index_path.name]):
                if _lexists(name, dfd):  # kept until the index is in place (TOOL-33)
                    aside = _aside_name(dfd, name)
                    os.replace(name, aside, src_dir_fd=dfd, dst_dir_fd=dfd)
                    moved.append((name, aside))
                os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
                placed.append(name)
        except BaseException:
            for name in [*temps, *placed]:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(name, dir_fd=dfd)
            for name, aside in reversed(moved):
                os.replace(aside, name, src_dir_fd=dfd, dst_dir_fd=dfd)
            raise
        report.shards, report.index = len(names), str(index_path)
        for name in [aside for _, aside in moved] + ours:  # best effort: committed
            with contextlib.suppress(OSError):
                os.unlink(name, dir_fd=dfd)
    finally:
        os.close(dfd)


def _lexists(name: str, dir_fd: int) -> bool:
    try:
        os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return True


def _aside_name(dir_fd: int, name: str) -> str:
    """A name no entry of the directory has, to keep ``name``'s file under until the
    conversion has succeeded."""
    while True:
        aside = f".{name}.{uuid.uuid4().hex}.replaced"
        if not _lexists(aside, dir_fd):
            return aside


def _replaced_shards(
    dir_fd: int, index_name: str, stem: str, new: set[str]
) -> tuple[list[str], list[str]]:
    """The shards the index being replaced names that the new checkpoint does not replace:
    (those refdcp can prove it wrote, the other ``.safetensors`` files there) (TOOL-33).

    Proof: the index carries refdcp's mark (``WRITTEN_BY``), the name is refdcp's shard
    name for that index's stem, and the file is a regular file. A name that is not a
    ``.safetensors`` file (``config.json``, the index itself) is never either.
    """
    try:
        fd = open_regular(index_name, os.O_RDONLY, dir_fd=dir_fd)
    except (OSError, RefdcpError):
        return [], []  # no old index, or not a file: it proves nothing and names nothing
    try:
        doc = json.loads(_read_index(fd, index_name))
    except (ValueError, RefdcpError):
        return [], []
    finally:
        os.close(fd)
    if not isinstance(doc, dict) or not isinstance(doc.get("weight_map"), dict):
        return [], []
    meta = doc.get("metadata")
    marked = isinstance(meta, dict) and meta.get(WRITTEN_BY[0]) == WRITTEN_BY[1]
    pattern = re.compile(re.escape(stem) + r"-(\d{5})-of-(\d{5})\.safetensors")
    ours: list[str] = []
    theirs: list[str] = []
    for name in dict.fromkeys(v for v in doc["weight_map"].values() if isinstance(v, str)):
        if name in new or not name.endswith(".safetensors") or "/" in name or name == index_name:
            continue
        try:
            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        except (FileNotFoundError, ValueError):
            continue
        if marked and pattern.fullmatch(name) and stat.S_ISREG(st.st_mode):
            ours.append(name)
        else:
            theirs.append(name)
    return ours, theirs


def _write_dcp(src: _Source, dst: Path, progress: Progress, report: ConvertReport) -> None:
    from refdcp.planning import DefaultSavePlanner
    from refdcp.planning.loadable import refuse_unloadable
    from refdcp.storage.fs.filesystem import FileSystemWriter

    class PlaceholderPlanner(DefaultSavePlanner):
        """Tensors are meta placeholders streamed from ``src``: only the other values are checked."""

        def check_values(self) -> None:
            others = {k: v for k, v in self.flat.items.items() if not isinstance(v, torch.Tensor)}
            refuse_unloadable(others, self.safe_globals, self.flat.paths)

    planner = PlaceholderPlanner()
    planner.set_up_planner(src.structure, is_coordinator=True)
    local = planner.create_local_plan()
    writer = FileSystemWriter(dst)
    writer.set_up_storage_writer(True)
    local = writer.prepare_local_plan(local)
    plans, metadata = planner.create_global_plan([local])
    plans = writer.prepare_global_plan(plans)
    plan = planner.finish_plan(plans[0])
    name = layout.data_file_name(layout.plan_prefix(plan), 0, writer.save_id)
    results: list[WriteResult] = []
    ordered = sorted(plan.items, key=lambda i: i.type != WriteItemType.BYTE_IO)
    fd = open_regular(dst / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    try:
        position = 0
        for item in ordered:
            if item.type == WriteItemType.BYTE_IO:
                data = planner.resolve_data(item)
                assert isinstance(data, io.BytesIO)
                enc = encode_bytes(data)
                tensor = None
            else:
                tensor = src.read(item.index.fqn)
                enc = encode_tensor(tensor)
            for part in enc.parts:
                view = memoryview(part).cast("B")
                while view:
                    n = os.write(fd, view)
                    view = view[n:]
            info = make_storage_info(name, position, enc)
            position += enc.length
            results.append(
                WriteResult(index=item.index, size_in_bytes=enc.length, storage_data=info)
            )
            if tensor is not None:
                _count(report, tensor)
                src.release(tensor)
                progress.update(tensor.nbytes)
            del enc, tensor
        os.fsync(fd)
    finally:
        os.close(fd)
    writer.finish(metadata, [results])


# --- driver ----------------------------------------------------------------------------------


def _open_source(path: Path, fmt: str) -> _Source:
    if fmt == "dcp":
        return _DcpSource(path)
    if fmt == "safetensors":
        return _SafetensorsSource(path)
    if fmt == "safetensors-index":
        return _IndexSource(path)
    return _TorchSaveSource(path)


def convert(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    src_format: str | None = None,
    dst_format: str | None = None,
    drop_non_tensors: bool = False,
    overwrite: bool = False,
    progress: TextIO | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> ConvertReport:
    """Convert the checkpoint at ``src`` into ``dst`` (TOOL-18..22).

    Formats come from the paths (``detect_format``) unless given. Refuses,
    before writing anything, a destination that exists (unless
    ``overwrite``), non-tensor values bound for safetensors (unless
    ``drop_non_tensors``, which lists what it dropped in the report) and
    dtypes safetensors cannot name. File destinations are written under a
    temporary name and renamed into place, so a failed conversion leaves no
    partial file; a DCP destination is committed only by its ``.metadata``, sharded
    safetensors (shards of at most ``max_shard_bytes``) by its index (TOOL-32).
    """
    src_p, dst_p = Path(src), Path(dst)
    sfmt = src_format or detect_format(src_p, existing=True)
    dfmt = dst_format or detect_format(dst_p, existing=False)
    for role, fmt in (("source", sfmt), ("destination", dfmt)):
        if fmt not in FORMATS:
            raise ConvertError(f"{role} format must be one of {FORMATS}, got {fmt!r}")
    if max_shard_bytes < 1:
        raise ConvertError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    if sfmt == dfmt:
        raise ConvertError(f"{src_p} and {dst_p} are both {sfmt}: nothing to convert")
    if not src_p.exists():
        raise ConvertError(f"{src_p}: no such file or directory")
    if dst_p.exists() and not overwrite:
        raise ConvertError(f"{dst_p} exists; pass --overwrite to replace it")
    if dfmt == "dcp" and dst_p.exists() and not dst_p.is_dir():
        raise ConvertError(f"{dst_p} is a file; a DCP checkpoint is a directory")
    report = ConvertReport(str(src_p), str(dst_p), sfmt, dfmt)
    source = _open_source(src_p, sfmt)
    try:
        tensors, objects = _tensor_keys(source), _object_keys(source)
        tensor_only = dfmt in ("safetensors", "safetensors-index")
        if tensor_only and objects:
            if not drop_non_tensors:
                shown = ", ".join(f"{k!r} ({type(source.flat[k]).__name__})" for k in objects[:10])
                more = f" and {len(objects) - 10} more" if len(objects) > 10 else ""
                raise ConvertError(
                    f"safetensors holds only tensors; {src_p} also has {len(objects)} "
                    f"non-tensor value(s): {shown}{more}. Convert to torch or DCP instead, "
                    "or pass --drop-non-tensors to leave them out"
                )
            report.dropped = list(objects)
        report.objects = 0 if tensor_only else len(objects)
        total = sum(
            _tensor_nbytes(tuple(source.flat[k].shape), source.flat[k].dtype) for k in tensors
        )
        if tensor_only:
            _safetensors_header(source, tensors)  # refuse unnamed dtypes before writing
        with Progress(total, f"convert {sfmt} -> {dfmt}", stream=progress) as bar:
            if dfmt == "dcp":
                dst_p.mkdir(parents=True, exist_ok=True)
                _write_dcp(source, dst_p, bar, report)
            elif dfmt == "safetensors-index":
                _write_safetensors_index(source, dst_p, bar, report, tensors, max_shard_bytes)
            else:
                dst_p.parent.mkdir(parents=True, exist_ok=True)
                f, tmp_name = _new_file(dst_p.parent, f".{dst_p.name}.")
                tmp = dst_p.parent / tmp_name
                try:
                    with f:
                        if dfmt == "torch":
                            _write_torch_save(source, f, bar, report)
                        else:
                            _write_safetensors(source, f, bar, report, tensors)
                    os.replace(tmp, dst_p)  # the name is replaced, never written through
                finally:
                    tmp.unlink(missing_ok=True)
        report.checksums_verified = source.checksums_verified
    finally:
        source.close()
    return report


def _iter_lines(report: ConvertReport) -> Iterator[str]:
    from refdcp.tools.progress import format_bytes

    yield (
        f"converted {report.src} ({report.src_format}) -> {report.dst} ({report.dst_format}): "
        f"{report.tensors} tensor(s), {format_bytes(report.tensor_bytes)}, "
        f"{report.objects} other value(s)"
    )
    if report.checksums_verified:
        yield f"checksums verified: {report.checksums_verified} item(s)"
    if report.shards:
        yield f"shards: {report.shards} file(s) named by {report.index}"
    if report.dropped:
        yield f"dropped (not tensors): {', '.join(report.dropped)}"


def convert_command(
    src: str,
    dst: str,
    *,
    src_format: str | None = None,
    dst_format: str | None = None,
    drop_non_tensors: bool = False,
    overwrite: bool = False,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    out: TextIO | None = None,
    err: TextIO | None = None,
) -> int:
    """CLI body: 0 on success, 1 when the conversion is refused or fails (message on stderr)."""
    stream, errs = out or sys.stdout, err or sys.stderr
    try:
        report = convert(
            src,
            dst,
            src_format=src_format,
            dst_format=dst_format,
            drop_non_tensors=drop_non_tensors,
            overwrite=overwrite,
            progress=errs,
            max_shard_bytes=max_shard_bytes,
        )
    except (RefdcpError, OSError) as exc:
        errs.write(f"refdcp convert: error: {exc}\n")
        return 1
    for line in _iter_lines(report):
        stream.write(line + "\n")
    return 0
