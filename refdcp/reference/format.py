"""What the bytes on disk are: one stored item, and the ``.metadata`` file (FMT-*, INTEG-1..2).

* A non-tensor item is the ``torch.save`` bytes the planner made, verbatim (FMT-2).
* A tensor item is ``torch.save`` of a contiguous copy of the chunk (FMT-3, FMT-4), so
  ``torch.load(..., weights_only=True)`` reads it; where its raw data starts in the item is
  recorded as ``refdcp_data_offset`` so a fast reader can read it in place.
* Every item's CRC-32C is recorded as ``refdcp_crc32c`` (INTEG-1, INTEG-9).
* ``.metadata`` is ``pickle.dumps(Metadata)`` plus a CRC-32C trailer (FMT-1, INTEG-2), read
  back with an unpickler that admits only DCP's metadata types (FMT-6) and checked for
  the fields a read relies on (FMT-7, FMT-9, STORE-26).
"""

from __future__ import annotations

import io
import itertools
import pickle
import struct
import zipfile
from typing import Any

import crc32c
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)

from refdcp.storage import (
    CorruptionError,
    FormatVersionError,
    MalformedMetadataError,
    UnsafeMetadataError,
    UnsafePathError,
)

__all__ = [
    "DCP_VERSION",
    "METADATA",
    "data_file_name",
    "decode_tensor",
    "dump_metadata",
    "encode_item",
    "load_metadata",
    "plain_values",
    "storage_info",
]

METADATA = ".metadata"  # the commit point's name (STORE-1)
DCP_VERSION = "1.0.0"  # the ``Metadata.version`` torch 2.13 writes (FMT-1, FMT-7)
TRAILER = b"#refdcp-crc32c:"  # then 8 hex digits and a newline (INTEG-2)
TRAILER_LEN = len(TRAILER) + 9
MAX_METADATA_BYTES = 1 << 30  # FMT-10's default cap

#: The globals a ``.metadata`` may name (FMT-6); torch dtypes and ``torch.Size`` besides.
ALLOWED = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in (
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),
    ("collections", "OrderedDict"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
    ("builtins", "complex"),
    *(("pathlib", n) for n in ("Path", "PosixPath", "WindowsPath", "PurePosixPath")),
}

#: What older torch wrote, read as today's class of the same fields and values (API-28).
RENAMED = {
    ("torch.distributed._shard.sharded_tensor.metadata", "TensorProperties"): "TensorProperties",
    (
        "torch.distributed._shard.sharded_tensor.metadata",
        "MEM_FORMAT_ENCODING",
    ): "_MEM_FORMAT_ENCODING",
}


def data_file_name(rank: int, token: str) -> str:
    """A rank's data file of one save: ``__{rank}_0.{token}.distcp`` (STORE-2, STORE-30)."""
    return f"__{rank}_0.{token}.distcp"


def encode_item(data: torch.Tensor | io.BytesIO) -> tuple[bytes, int | None]:
    """An item's stored bytes and, for a tensor, where its raw data starts (FMT-2..4)."""
    if isinstance(data, io.BytesIO):
        return data.getvalue(), None
    t = plain_values(data)
    buf = io.BytesIO()
    torch.save(t, buf)
    blob = buf.getvalue()
    return blob, _data_offset(blob) if t.layout == torch.strided and not t.is_quantized else None


def plain_values(t: torch.Tensor) -> torch.Tensor:
    """A plain CPU tensor of ``t``'s values: conjugate and negative bits resolved, subclasses
    dropped (SAVE-10), and a dense tensor copied to hold only its own elements (FMT-4)."""
    t = t.detach()
    if t.layout != torch.strided or t.is_quantized:
        return t.cpu()
    if type(t) not in (torch.Tensor, torch.nn.Parameter):
        # a subclass's values are what its own copy_ writes into a plain tensor (SAVE-10);
        # a wrapper subclass has no storage of its own to view
        plain = torch.empty(tuple(t.shape), dtype=t.dtype)
        with torch.no_grad():
            plain.copy_(t)
        t = plain.as_subclass(torch.Tensor)
    t = t.cpu().resolve_conj().resolve_neg().as_subclass(torch.Tensor)
    return t.clone(memory_format=torch.contiguous_format)


def _data_offset(blob: bytes) -> int:
    """Where the archive's storage record begins: its local header plus name and extra field."""
    with zipfile.ZipFile(io.BytesIO(blob)) as archive:
        info = next(i for i in archive.infolist() if i.filename.endswith("/data/0"))
    name_len, extra_len = struct.unpack(
        "<HH", blob[info.header_offset + 26 : info.header_offset + 30]
    )
    return int(info.header_offset + 30 + name_len + extra_len)


def storage_info(file: str, offset: int, blob: bytes, data_offset: int | None) -> _StorageInfo:
    """torch's record of where an item lies, with refdcp's checksum (INTEG-1) and data offset."""
    info = _StorageInfo(relative_path=file, offset=offset, length=len(blob))
    info.refdcp_crc32c = crc32c.crc32c(blob)  # type: ignore[attr-defined]
    if data_offset is not None:
        info.refdcp_data_offset = data_offset  # type: ignore[attr-defined]
    return info


def decode_tensor(blob: bytes) -> torch.Tensor:
    """A stored tensor item back as a tensor, unpickled weights-only (FMT-3, FMT-8)."""
    t: torch.Tensor = torch.load(io.BytesIO(blob), weights_only=True, map_location="cpu")
    return t


def dump_metadata(metadata: Metadata) -> bytes:
    """``.metadata``'s bytes: the pickle, then its CRC-32C trailer (FMT-1, INTEG-2)."""
    metadata.refdcp_format = 1  # type: ignore[attr-defined]
    body = pickle.dumps(metadata)
    return body + TRAILER + b"%08x\n" % crc32c.crc32c(body)


def load_metadata(data: bytes, file: str) -> Metadata:
    """Parse ``.metadata`` written by refdcp or torch (FMT-5): the size cap (FMT-10), the trailer
    (INTEG-2), the allowlist (FMT-6), the version (FMT-7) and the storage records (STORE-26)."""
    if len(data) > MAX_METADATA_BYTES:
        raise UnsafeMetadataError(f"{file}: {len(data)} bytes is over the metadata size limit")
    has_trailer = data[-TRAILER_LEN:-9] == TRAILER and data.endswith(b"\n")
    body = data[:-TRAILER_LEN] if has_trailer else data
    if has_trailer and crc32c.crc32c(body) != int(data[-9:-1], 16):  # INTEG-2
        raise CorruptionError("metadata checksum mismatch", fqn=None, file=file, offset=0)
    try:
        metadata = _Unpickler(io.BytesIO(body)).load()
    except UnsafeMetadataError as exc:
        raise UnsafeMetadataError(f"{file}: {exc}") from None
    except Exception as exc:
        raise CorruptionError(
            f"metadata does not unpickle: {type(exc).__name__}: {exc}",
            fqn=None,
            file=file,
            offset=0,
        ) from exc
    if not isinstance(metadata, Metadata):
        raise MalformedMetadataError(
            f"holds a {type(metadata).__name__}", field="<root>", file=file
        )
    fmt = getattr(metadata, "refdcp_format", None)
    if fmt not in (None, 1) or metadata.version not in (None, DCP_VERSION):  # FMT-7
        raise FormatVersionError(f"{file}: format {fmt!r}, version {metadata.version!r}")
    if fmt is not None and not has_trailer:
        raise CorruptionError(
            "refdcp metadata lacks its checksum trailer", fqn=None, file=file, offset=len(data)
        )
    _check_records(metadata, file)
    return metadata


class _Unpickler(pickle.Unpickler):
    """Builds only the allowlisted globals; anything else is refused unrun (FMT-6)."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in RENAMED:
            module, name = "torch.distributed.checkpoint.metadata", RENAMED[module, name]
        if module == "torch" and (
            name == "Size" or isinstance(getattr(torch, name, None), torch.dtype)
        ):
            return getattr(torch, name)
        if (module, name) in ALLOWED:
            return pickle.Unpickler.find_class(self, module, name)
        raise UnsafeMetadataError(f".metadata references {module}.{name}, which is not allowed")

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeMetadataError(".metadata uses pickle persistent ids")


def _check_records(metadata: Metadata, file: str) -> None:
    """Every storage record names a plain file name and a non-negative range (FMT-9, STORE-26),
    every stored chunk and object has a record, and no two records share a byte (FMT-29)."""
    sdm: Any = getattr(metadata, "state_dict_metadata", None)
    records: Any = getattr(metadata, "storage_data", None) or {}
    for field, value in (("state_dict_metadata", sdm), ("storage_data", records)):
        if not isinstance(value, dict):  # FMT-9: a field of the wrong type is named, not run into
            raise MalformedMetadataError(f"is a {type(value).__name__}", field=field, file=file)
    for fqn, md in sdm.items():
        if not isinstance(md, (TensorStorageMetadata, BytesStorageMetadata)):
            raise MalformedMetadataError(
                f"is a {type(md).__name__}", field=f"state_dict_metadata[{fqn!r}]", file=file
            )
        chunks = md.chunks if isinstance(md, TensorStorageMetadata) else [None]
        for chunk in chunks:
            if chunk is not None and not all(
                isinstance(v, torch.Size) for v in (chunk.offsets, chunk.sizes)
            ):
                raise MalformedMetadataError(
                    "chunk offsets and sizes must be torch.Size", field=f"{fqn!r}", file=file
                )
            if chunk is not None and 0 in chunk.sizes:
                continue  # an empty chunk is never read
            if MetadataIndex(fqn, None if chunk is None else chunk.offsets) not in records:
                raise MalformedMetadataError("no storage record", field=f"{fqn!r}", file=file)
    for index, info in records.items():
        name = getattr(info, "relative_path", None)
        plain = isinstance(name, str) and name not in ("", ".", "..") and len(name.encode()) <= 255
        if not plain or any(c in str(name) for c in "/\\\0"):
            raise UnsafePathError(f"{file}: item {index.fqn!r} names the data file {name!r}")
        for field in ("offset", "length"):
            value = getattr(info, field, None)
            if type(value) is not int or value < 0:
                raise MalformedMetadataError(
                    f"{field} is {value!r}", field=f"storage_data[{index.fqn!r}].{field}", file=file
                )
    spans = sorted(
        (i.relative_path, i.offset, i.length, x.fqn) for x, i in records.items() if i.length
    )
    for (f1, start, length, a), (f2, next_start, _, b) in itertools.pairwise(spans):
        if f1 == f2 and next_start < start + length:  # sorted: a shared byte shows in neighbours
            raise MalformedMetadataError(
                f"items {a!r} and {b!r} share bytes of {f1}", field="storage_data", file=file
            )
