"""Reading and writing ``.metadata`` safely (FMT-1, FMT-5, FMT-6, FMT-7, INTEG-2).

``.metadata`` is ``pickle.dumps(Metadata)`` (what torch's reader expects)
followed by a refdcp trailer ``#refdcp-crc32c:XXXXXXXX\\n`` holding the
CRC-32C of the pickle bytes.  ``pickle.load`` stops at the pickle's STOP
opcode, so torch never sees the trailer.  refdcp reads the pickle with an
unpickler that only admits DCP's metadata classes and the few torch/builtin
types they contain.
"""

from __future__ import annotations

import io
import pickle
import re
from typing import Any

import crc32c
import torch
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.storage import WriteResult

from refdcp.storage.errors import CorruptionError, FormatVersionError, UnsafeMetadataError

__all__ = [
    "DCP_VERSION",
    "FORMAT_ATTR",
    "KNOWN_DCP_VERSIONS",
    "REFDCP_FORMAT",
    "dump_metadata",
    "finalize_metadata",
    "has_checksum_trailer",
    "load_metadata",
    "safe_loads",
]

#: Extra attribute refdcp sets on the pickled Metadata: its own format number.
FORMAT_ATTR = "refdcp_format"
REFDCP_FORMAT = 1
#: The ``Metadata.version`` refdcp writes (torch 2.13's).
DCP_VERSION = "1.0.0"
#: ``Metadata.version`` values this reader understands (None: pre-2.4 torch).
KNOWN_DCP_VERSIONS = frozenset({None, DCP_VERSION})

#: ``.metadata`` ends with this prefix, 8 hex digits of CRC-32C and a newline (INTEG-2).
TRAILER_PREFIX = b"#refdcp-crc32c:"
_TRAILER = re.compile(re.escape(TRAILER_PREFIX) + rb"([0-9a-f]{8})\n\Z")
_TRAILER_LEN = len(TRAILER_PREFIX) + 9

_DCP_META = "torch.distributed.checkpoint.metadata"
_ALLOWED: dict[str, frozenset[str]] = {
    _DCP_META: frozenset(
        {
            "Metadata",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "MetadataIndex",
            "StorageMeta",
            "_MEM_FORMAT_ENCODING",
        }
    ),
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo"}),
    "torch.serialization": frozenset({"_get_layout"}),
    "pathlib": frozenset({"Path", "PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"}),
    "collections": frozenset({"OrderedDict"}),
    "builtins": frozenset({"set", "frozenset", "complex"}),
}


class _RestrictedUnpickler(pickle.Unpickler):
    """Admits only the allowlisted globals (FMT-6)."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch":
            if name == "Size":
                return torch.Size
            value = getattr(torch, name, None)
            if isinstance(value, torch.dtype):
                return value
        elif name in _ALLOWED.get(module, frozenset()):
            return super().find_class(module, name)
        raise UnsafeMetadataError(
            f".metadata references {module}.{name}, which is not an allowed DCP metadata type; "
            "refusing to unpickle it (refdcp reads .metadata with a restricted unpickler)"
        )

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeMetadataError(".metadata uses pickle persistent ids; refusing it")


def safe_loads(data: bytes) -> Any:
    """Unpickle ``data`` admitting only DCP metadata types (FMT-6)."""
    return _RestrictedUnpickler(io.BytesIO(data)).load()


def dump_metadata(metadata: Metadata) -> bytes:
    """The bytes of a refdcp ``.metadata`` file: pickle + CRC-32C trailer (FMT-1, INTEG-2)."""
    setattr(metadata, FORMAT_ATTR, REFDCP_FORMAT)
    body = pickle.dumps(metadata)
    return body + TRAILER_PREFIX + b"%08x\n" % crc32c.crc32c(body)


def has_checksum_trailer(data: bytes) -> bool:
    """Whether ``.metadata`` bytes end with refdcp's checksum trailer (not whether it matches)."""
    return _TRAILER.search(data[-_TRAILER_LEN:]) is not None


def finalize_metadata(
    metadata: Metadata, results: list[list[WriteResult]], storage_meta: StorageMeta | None
) -> dict[Any, Any]:
    """What ``finish`` records before committing, for every refdcp storage (FMT-1, STORE-1).

    Sets the DCP version, the merged per-item storage data of every rank's
    write results and the storage meta; returns the storage data.
    """
    metadata.version = DCP_VERSION
    storage_md: dict[Any, Any] = {}
    for rank_results in results:
        for wr in rank_results:
            storage_md[wr.index] = wr.storage_data
    metadata.storage_data = storage_md
    metadata.storage_meta = storage_meta
    return storage_md


def load_metadata(data: bytes, *, file: str = ".metadata") -> Metadata:
    """Parse ``.metadata`` bytes written by refdcp or torch (FMT-5, FMT-7, INTEG-2).

    A refdcp file's trailer is checked; a file whose Metadata says it was
    written by refdcp but has no valid trailer is corrupt.  Unknown format
    versions are refused.
    """
    match = _TRAILER.search(data[-_TRAILER_LEN:]) if len(data) >= _TRAILER_LEN else None
    body = data[: len(data) - _TRAILER_LEN] if match else data
    if match is not None and crc32c.crc32c(body) != int(match.group(1), 16):
        raise CorruptionError("metadata checksum mismatch", fqn=None, file=file, offset=0)
    try:
        metadata = safe_loads(body)
    except UnsafeMetadataError:
        raise
    except Exception as exc:
        raise CorruptionError(
            f"metadata does not unpickle: {type(exc).__name__}: {exc}",
            fqn=None,
            file=file,
            offset=0,
        ) from exc
    if not isinstance(metadata, Metadata):
        raise CorruptionError(
            f"metadata holds a {type(metadata).__name__}, not a Metadata",
            fqn=None,
            file=file,
            offset=0,
        )
    fmt = getattr(metadata, FORMAT_ATTR, None)
    if fmt is not None and fmt != REFDCP_FORMAT:
        raise FormatVersionError(
            f"{file}: refdcp format {fmt!r} is not supported (this refdcp reads format {REFDCP_FORMAT})"
        )
    if metadata.version not in KNOWN_DCP_VERSIONS:
        raise FormatVersionError(
            f"{file}: DCP metadata version {metadata.version!r} is not supported "
            f"(known: {sorted(v for v in KNOWN_DCP_VERSIONS if v)})"
        )
    if fmt is not None and match is None:
        raise CorruptionError(
            "refdcp metadata lacks its checksum trailer (truncated?)",
            fqn=None,
            file=file,
            offset=len(data),
        )
    return metadata
