"""Safetensors files read through the opening rule, with the format's own layout checks
(STORE-64, TOOL-34).

A safetensors file is an 8-byte little-endian header length, a JSON header naming each
tensor's dtype, shape and ``data_offsets`` within the data region, then the data region.
:func:`read_header` reads the header bounded (at most ``MAX_HEADER_BYTES``, as the
``safetensors`` package allows) and refuses every layout the package refuses: a
duplicate name, an unknown dtype, offsets that do not hold exactly the tensor's bytes,
tensors that overlap, leave a gap or leave bytes after the last one. ``refdcp convert``
reads safetensors with it; :class:`HuggingFaceStorageReader` is torch's reader of a
directory of ``.safetensors`` files, rebuilt so that every file is opened relative to
the opened directory by :func:`~refdcp.storage.fs.paths.open_regular` (no symbolic link,
no FIFO or device, never blocking) and read only in the byte ranges its header states.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint._hf_utils import _HFStorageInfo
from torch.distributed.checkpoint.hf_storage import (
    HuggingFaceStorageReader as _TorchHuggingFaceStorageReader,
)
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from refdcp.errors import RefdcpError
from refdcp.storage.errors import CorruptionError
from refdcp.storage.format.items import raw_view
from refdcp.storage.fs.paths import open_regular, opened_dir, pread_exact, pread_into

__all__ = [
    "MAX_HEADER_BYTES",
    "SAFETENSORS_DTYPES",
    "SUFFIX",
    "Entry",
    "Header",
    "HuggingFaceStorageReader",
    "read_header",
]

#: The largest header the ``safetensors`` package reads (its ``MAX_HEADER_SIZE``).
MAX_HEADER_BYTES = 100_000_000
SUFFIX = ".safetensors"
#: safetensors' dtype names (the format's spec), torch dtype -> name.
SAFETENSORS_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e4m3fnuz: "F8_E4M3FNUZ",
    torch.float8_e5m2: "F8_E5M2",
    torch.float8_e5m2fnuz: "F8_E5M2FNUZ",
    torch.complex64: "C64",
    torch.uint64: "U64",
    torch.uint32: "U32",
    torch.uint16: "U16",
}
_NAMES = {v: k for k, v in SAFETENSORS_DTYPES.items()}
#: torch's key in ``__metadata__`` for the offsets of a distributed save's shards
_SHARDING_KEY = "DCP_SHARDING_INFO"
_OFFSETS_KEY = "saved_offsets"


@dataclass(frozen=True)
class Entry:
    """One tensor of a safetensors file: its bytes are ``[begin, end)`` of the data region."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int


@dataclass(frozen=True)
class Header:
    """A checked header: the tensors by name, ``__metadata__``, and where data begins."""

    entries: dict[str, Entry]
    metadata: dict[str, str] | None
    base: int


def _bad(file: str, message: str, fqn: str | None = None, offset: int = 0) -> CorruptionError:
    return CorruptionError(
        f"not a valid safetensors file: {message}", fqn=fqn, file=file, offset=offset
    )


def _no_duplicates(file: str) -> Any:
    def hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in pairs:
            if key in out:
                raise _bad(file, f"duplicate name {key!r} in the header", fqn=key, offset=8)
            out[key] = value
        return out

    return hook


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def read_header(fd: int, file: str) -> Header:
    """The checked header of the safetensors file open at ``fd`` (TOOL-34).

    Reads at most ``8 + MAX_HEADER_BYTES`` bytes; refuses, naming ``file`` and the
    tensor at fault, every layout the ``safetensors`` package refuses, and a duplicate
    name anywhere in the header.
    """
    size = os.fstat(fd).st_size
    raw = pread_exact(fd, 8, 0)
    if len(raw) != 8:
        raise _bad(file, f"{size} bytes, too short for the header length")
    (n,) = struct.unpack("<Q", raw)
    if n > MAX_HEADER_BYTES:
        raise _bad(file, f"header length {n} exceeds the format's {MAX_HEADER_BYTES} bytes")
    if 8 + n > size:
        raise _bad(file, f"header length {n} does not fit the file ({size} bytes)")
    text = pread_exact(fd, n, 8)
    try:
        doc = json.loads(
            text.decode("utf-8"),
            object_pairs_hook=_no_duplicates(file),
            parse_constant=_refuse_constant,
        )
    except (UnicodeDecodeError, ValueError) as exc:
        raise _bad(file, f"header is not UTF-8 JSON ({exc})", offset=8) from exc
    if not isinstance(doc, dict):
        raise _bad(file, "header is not a JSON object", offset=8)
    metadata = doc.pop("__metadata__", None)
    if metadata is not None and not (
        isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())
    ):
        raise _bad(file, "__metadata__ is not a map of strings to strings", offset=8)
    entries: dict[str, Entry] = {}
    for key, spec in doc.items():
        entries[key] = _entry(file, key, spec)
    end = 0  # sorted by offset, the tensors tile the data region exactly
    for key, e in sorted(entries.items(), key=lambda kv: (kv[1].begin, kv[1].end)):
        if e.begin != end:
            what = "overlaps the tensor before it" if e.begin < end else "leaves a gap before it"
            raise _bad(file, f"data_offsets {[e.begin, e.end]} {what}", fqn=key, offset=8 + n)
        end = e.end
    if 8 + n + end != size:
        raise _bad(
            file,
            f"the tensors end at byte {end} of the data region, which holds {size - 8 - n}",
            offset=8 + n,
        )
    return Header(entries, metadata, 8 + n)


def _entry(file: str, key: str, spec: Any) -> Entry:
    if not isinstance(spec, dict):
        raise _bad(file, f"entry {spec!r} is not an object", fqn=key, offset=8)
    name = spec.get("dtype")
    dtype = _NAMES.get(name) if isinstance(name, str) else None
    shape, offsets = spec.get("shape"), spec.get("data_offsets")
    if dtype is None:
        raise _bad(file, f"unknown dtype {spec.get('dtype')!r}", fqn=key, offset=8)
    if not isinstance(shape, list) or not all(_is_int(s) for s in shape):
        raise _bad(file, f"shape {shape!r} is not a list of non-negative integers", fqn=key)
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_is_int, offsets))):
        raise _bad(file, f"data_offsets {offsets!r} are not two non-negative integers", fqn=key)
    begin, end = offsets
    nbytes = math.prod(shape) * dtype.itemsize
    if end < begin or end - begin != nbytes:
        raise _bad(
            file,
            f"data_offsets {offsets} do not hold the {nbytes} bytes of {spec['dtype']} {shape}",
            fqn=key,
            offset=8,
        )
    return Entry(dtype, tuple(shape), begin, end)


class HuggingFaceStorageReader(_TorchHuggingFaceStorageReader):
    """torch's reader of a directory of ``.safetensors`` files, opening none by path
    (STORE-64, API-25).

    It builds the metadata torch's reader builds (one chunk per file holding a key, at
    the offsets torch's ``DCP_SHARDING_INFO`` records), but lists and opens the files
    relative to the opened directory through the opening rule: a symbolic link, FIFO,
    socket or device named ``*.safetensors`` raises ``UnsafePathError`` naming it,
    without following or blocking. Headers are checked as TOOL-34 says, and a read
    takes only the rows of the stored tensor it needs.
    """

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        state: dict[str, TensorStorageMetadata] = {}
        storage: dict[MetadataIndex, _HFStorageInfo] = {}
        dfd = opened_dir(self.path)
        try:
            for name in sorted(n for n in os.listdir(dfd) if n.endswith(SUFFIX)):
                header = self._header(dfd, name)
                sharding = _sharding(header, name, str(self.path))
                for key, e in header.entries.items():
                    offset = sharding.get(key, [0] * len(e.shape))
                    size = [o + s for o, s in zip(offset, e.shape)]
                    chunk = ChunkStorageMetadata(torch.Size(offset), torch.Size(e.shape))
                    have = state.get(key)
                    if have is None:
                        state[key] = TensorStorageMetadata(
                            TensorProperties(dtype=e.dtype), torch.Size(size), [chunk]
                        )
                    else:
                        have.chunks.append(chunk)
                        have.size = torch.Size(max(a, b) for a, b in zip(have.size, size))
                    index = MetadataIndex(fqn=key, offset=offset)
                    storage[index] = _HFStorageInfo(name, torch.Size(e.shape), e.dtype)
        finally:
            os.close(dfd)
        metadata = Metadata(state_dict_metadata=dict(state), storage_data=storage)
        metadata.storage_meta = StorageMeta(load_id=self.load_id)
        return metadata

    @staticmethod
    def _header(dfd: int, name: str) -> Header:
        fd = open_regular(name, os.O_RDONLY, dir_fd=dfd)  # STORE-64: no link, no FIFO
        try:
            return read_header(fd, name)
        finally:
            os.close(fd)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        per_file: dict[str, list[ReadItem]] = {}
        for req in plan.items:
            info = self.storage_data[req.storage_index]
            per_file.setdefault(info.relative_path, []).append(req)
        dfd = opened_dir(self.path)
        try:
            for name, reqs in per_file.items():
                fd = open_regular(name, os.O_RDONLY, dir_fd=dfd)  # STORE-64
                try:
                    header = read_header(fd, name)
                    for req in reqs:
                        self._read(fd, name, header, req, planner)
                finally:
                    os.close(fd)
        finally:
            os.close(dfd)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _read(
        self, fd: int, name: str, header: Header, req: ReadItem, planner: LoadPlanner
    ) -> None:
        fqn = req.storage_index.fqn
        info = self.storage_data[req.storage_index]
        e = header.entries.get(fqn)
        if e is None or e.dtype != info.dtype or e.shape != tuple(info.shape):
            raise RefdcpError(f"{name}: tensor {fqn!r} changed since its header was read")
        offsets, lengths = tuple(req.storage_offsets), tuple(req.lengths)
        if len(offsets) != len(e.shape) or any(
            o < 0 or n < 0 or o + n > s for o, n, s in zip(offsets, lengths, e.shape)
        ):
            raise RefdcpError(
                f"{name}: a read of offsets {list(offsets)} and lengths {list(lengths)} is "
                f"not inside tensor {fqn!r} of shape {list(e.shape)}"
            )
        if e.shape:  # the rows the read needs are one contiguous byte range
            row = math.prod(e.shape[1:]) * e.dtype.itemsize
            rows = torch.empty((lengths[0], *e.shape[1:]), dtype=e.dtype)
            start = header.base + e.begin + offsets[0] * row
        else:
            rows = torch.empty((), dtype=e.dtype)
            start = header.base + e.begin
        view = raw_view(rows)
        if pread_into(fd, view, start) != len(view):
            raise CorruptionError("file truncated", fqn=fqn, file=name, offset=start)
        got = rows
        for dim in range(1, len(e.shape)):
            got = got.narrow(dim, offsets[dim], lengths[dim])
        target = planner.resolve_tensor(req).detach()
        if target.size() != got.size():
            raise RefdcpError(
                f"{name}: {fqn!r}: destination size {tuple(target.size())} != {tuple(got.size())}"
            )
        target.copy_(got)
        planner.commit_tensor(req, target)


def _sharding(header: Header, name: str, path: str) -> dict[str, list[int]]:
    """The offsets torch's distributed save recorded for each tensor of a file, else {}."""
    text = (header.metadata or {}).get(_SHARDING_KEY)
    if text is None:
        return {}
    try:
        info = json.loads(text)
        out = {k: [int(o) for o in v[_OFFSETS_KEY]] for k, v in info.items()}
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise RefdcpError(f"{path}/{name}: unreadable {_SHARDING_KEY}: {exc}") from exc
    for key, e in header.entries.items():
        if key in out and (len(out[key]) != len(e.shape) or min(out[key], default=0) < 0):
            raise RefdcpError(f"{path}/{name}: {_SHARDING_KEY} offsets of {key!r} do not fit")
    return out
