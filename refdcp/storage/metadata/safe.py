"""Reading and writing ``.metadata`` safely (FMT-1, FMT-5, FMT-6, FMT-7, INTEG-2).

``.metadata`` is ``pickle.dumps(Metadata)`` (what torch's reader expects)
followed by a refdcp trailer ``#refdcp-crc32c:XXXXXXXX\\n`` holding the
CRC-32C of the pickle bytes.  ``pickle.load`` stops at the pickle's STOP
opcode, so torch never sees the trailer.  refdcp reads the pickle with an
unpickler that only admits DCP's metadata classes and the few torch/builtin
types they contain.
"""

from __future__ import annotations

import gc
import io
import pickle
import re
from collections import OrderedDict
from collections.abc import Callable
from operator import attrgetter
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.storage import WriteResult

from refdcp.crc.kernel import crc32c
from refdcp.storage.errors import (
    CorruptionError,
    FormatVersionError,
    MalformedMetadataError,
    UnsafeMetadataError,
)
from refdcp.storage.metadata.bounded import BASE_ATTR, restore_dcp_class
from refdcp.storage.metadata.limits import MetadataLimits, get_metadata_limits
from refdcp.storage.metadata.pickler import dumps_metadata

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

#: Names older torch wrote into ``.metadata``, read as today's class of the same meaning
#: (API-28): the ShardedTensor-era ``TensorProperties`` and its memory-format enum have
#: the same fields, state tuple and enum values as the ones that replaced them.
_LEGACY: dict[tuple[str, str], tuple[str, str]] = {
    ("torch.distributed._shard.sharded_tensor.metadata", "TensorProperties"): (
        _DCP_META,
        "TensorProperties",
    ),
    ("torch.distributed._shard.sharded_tensor.metadata", "MEM_FORMAT_ENCODING"): (
        _DCP_META,
        "_MEM_FORMAT_ENCODING",
    ),
}


class _Budget:
    """Units an unpickle may spend on constructors that copy memoized data (FMT-11).

    Pickle's memo lets a few bytes reference a large object again; a
    constructor that copies its argument (``PosixPath(*parts)`` joining a 1 MiB
    string 2,000 times, ``torch.Size(t)``, ``set(xs)``, a ``BUILD`` that copies
    a state dict) would turn that into gigabytes. Each such call is charged the
    size of what it builds; a real file is charged at most about one unit per
    byte, so the budget is the file size plus a fixed slack.
    """

    def __init__(self, units: int) -> None:
        self.left = units

    def charge(self, n: int, what: str) -> None:
        self.left -= n
        if self.left < 0:
            raise UnsafeMetadataError(
                f".metadata builds more than its size allows ({what}); refusing it as a memory bomb"
            )


_BUILD_CLASSES = frozenset(
    {
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
        "_StorageInfo",
    }
)


def _bounded_class(base: type, budget: _Budget) -> type:
    """A subclass whose ``__setstate__`` charges the state's size, then becomes ``base``."""
    base_setstate = getattr(base, "__setstate__", None)
    own_setstate = base_setstate if "__setstate__" in base.__dict__ else None

    set_class = object.__setattr__

    def __setstate__(self: Any, state: Any) -> None:
        if own_setstate is None and type(state) is dict:  # the common case, kept lean
            budget.left -= len(state)
            if budget.left < 0:
                budget.charge(0, base.__name__)
            self.__dict__.update(state)
            set_class(self, "__class__", base)
            return
        if own_setstate is not None:
            budget.charge(len(state) if isinstance(state, tuple | dict) else 1, base.__name__)
            object.__setattr__(self, "__class__", base)
            own_setstate(self, state)
            return
        dict_state, slot_state = state if isinstance(state, tuple) else (state, None)
        for part in (dict_state, slot_state):
            if part is None:
                continue
            if not isinstance(part, dict) or not all(isinstance(k, str) for k in part):
                raise UnsafeMetadataError(f".metadata gives a {base.__name__} a malformed state")
            budget.charge(len(part), base.__name__)
            self.__dict__.update(part)
        object.__setattr__(self, "__class__", base)

    return type(base.__name__, (base,), {"__setstate__": __setstate__, BASE_ATTR: base})


class _RestrictedUnpickler(pickle.Unpickler):
    """Admits only the allowlisted globals (FMT-6), each bounded by a budget (FMT-11)."""

    def __init__(self, file: Any, budget: _Budget, limits: MetadataLimits) -> None:
        super().__init__(file)
        self._budget = budget
        self._limits = limits
        self._classes: dict[tuple[str, str], Any] = {}

    def find_class(self, module: str, name: str) -> Any:
        key = (module, name)
        if key not in self._classes:
            self._classes[key] = self._admit(module, name)
        return self._classes[key]

    def _admit(self, module: str, name: str) -> Any:
        module, name = _LEGACY.get((module, name), (module, name))
        if module == "torch":
            if name == "Size":
                return self._size
            value = getattr(torch, name, None)
            if isinstance(value, torch.dtype):
                return value
        elif name in _ALLOWED.get(module, frozenset()):
            found = super().find_class(module, name)
            if module == "pathlib":
                return self._path_maker(found)
            if (module, name) in (("builtins", "set"), ("builtins", "frozenset")):
                return self._copier(found)
            if (module, name) == ("collections", "OrderedDict"):
                return self._copier(OrderedDict)
            if name in _BUILD_CLASSES:
                return _bounded_class(found, self._budget)
            return found
        raise UnsafeMetadataError(
            f".metadata references {module}.{name}, which is not an allowed DCP metadata type; "
            "refusing to unpickle it (refdcp reads .metadata with a restricted unpickler)"
        )

    def _size(self, dims: Any = ()) -> torch.Size:
        if not isinstance(dims, tuple | list) or len(dims) > self._limits.max_dims:
            raise UnsafeMetadataError(
                f".metadata holds a torch.Size of more than {self._limits.max_dims} dimensions "
                "or of a non-sequence; refusing it"
            )
        budget = self._budget
        budget.left -= len(dims)
        if budget.left < 0:
            budget.charge(0, "torch.Size")
        return torch.Size(dims)

    def _path_maker(self, cls: Any) -> Callable[..., Any]:
        def make(*parts: Any) -> Any:
            total = 0
            for part in parts:
                if not isinstance(part, str):
                    raise UnsafeMetadataError(".metadata builds a path from a non-string")
                total += len(part) + 1
            if total > self._limits.max_string_chars:
                raise UnsafeMetadataError(
                    f".metadata builds a path of {total} characters "
                    f"(limit {self._limits.max_string_chars}); refusing it"
                )
            self._budget.charge(total, cls.__name__)
            return cls(*parts)

        return make

    def _copier(self, cls: Any) -> Callable[..., Any]:
        def make(*args: Any) -> Any:
            if len(args) > 1 or (args and not isinstance(args[0], list | tuple | dict | set)):
                raise UnsafeMetadataError(f".metadata calls {cls.__name__} with odd arguments")
            self._budget.charge(len(args[0]) if args else 0, cls.__name__)
            return cls(*args)

        return make

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeMetadataError(".metadata uses pickle persistent ids; refusing it")


def safe_loads(data: bytes, limits: MetadataLimits | None = None) -> Any:
    """Unpickle ``data`` admitting only DCP metadata types, bounded (FMT-6, FMT-11).

    Objects of DCP classes come back as their real classes once ``BUILD`` ran;
    call ``shape.check_metadata`` (``load_metadata`` does) to restore
    and check the rest.
    """
    limits = limits or get_metadata_limits()
    budget = _Budget(len(data) + limits.slack_units)
    unpickler = _RestrictedUnpickler(io.BytesIO(data), budget, limits)
    try:
        return unpickler.load()
    finally:
        # its makers (memoized by the pickle too) refer back to it: left in that cycle, the
        # memo would keep every object of the metadata alive until the cyclic collector ran
        unpickler.memo.clear()
        unpickler._classes.clear()


def dump_metadata(metadata: Metadata) -> bytes:
    """The bytes of a refdcp ``.metadata`` file: pickle + CRC-32C trailer (FMT-1, INTEG-2)."""
    setattr(metadata, FORMAT_ATTR, REFDCP_FORMAT)
    body = dumps_metadata(metadata)  # pickle.dumps(metadata), byte for byte
    return body + TRAILER_PREFIX + b"%08x\n" % crc32c(body)


def has_checksum_trailer(data: bytes) -> bool:
    """Whether ``.metadata`` bytes end with refdcp's checksum trailer (not whether it matches)."""
    return _TRAILER.search(data[-_TRAILER_LEN:]) is not None


_index = attrgetter("index")
_storage_data = attrgetter("storage_data")


def finalize_metadata(
    metadata: Metadata, results: list[list[WriteResult]], storage_meta: StorageMeta | None
) -> dict[Any, Any]:
    """What ``finish`` records before committing, for every refdcp storage (FMT-1, STORE-1).

    Sets the DCP version, the merged per-item storage data of every rank's
    write results and the storage meta; returns the storage data.
    """
    metadata.version = DCP_VERSION
    storage_md: dict[Any, Any] = {}
    for rank_results in results:  # later results win, as in a loop of assignments
        storage_md.update(zip(map(_index, rank_results), map(_storage_data, rank_results)))
    metadata.storage_data = storage_md
    metadata.storage_meta = storage_meta
    return storage_md


def load_metadata(
    data: bytes,
    *,
    file: str = ".metadata",
    limits: MetadataLimits | None = None,
    filesystem: bool = True,
) -> Metadata:
    """Parse ``.metadata`` bytes written by refdcp or torch (FMT-5, FMT-7, INTEG-2).

    A refdcp file's trailer is checked; a file whose Metadata says it was
    written by refdcp but has no valid trailer is corrupt.  Unknown format
    versions are refused. Every field's type is checked (FMT-9) and the caps
    of ``limits`` apply (FMT-10, FMT-11).
    """
    # millions of small acyclic objects: the cyclic GC would otherwise dominate the time
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        return _load_metadata(data, file=file, limits=limits, filesystem=filesystem)
    finally:
        if gc_was_enabled:
            gc.enable()


def _load_metadata(
    data: bytes, *, file: str, limits: MetadataLimits | None, filesystem: bool
) -> Metadata:
    from refdcp.storage.metadata.shape import check_metadata

    limits = limits or get_metadata_limits()
    if len(data) > limits.max_file_bytes:
        raise UnsafeMetadataError(
            f"{file}: {len(data)} bytes is over the metadata size limit of {limits.max_file_bytes}"
        )
    match = _TRAILER.search(data[-_TRAILER_LEN:]) if len(data) >= _TRAILER_LEN else None
    body = data[: len(data) - _TRAILER_LEN] if match else data
    if match is not None and crc32c(body) != int(match.group(1), 16):
        raise CorruptionError("metadata checksum mismatch", fqn=None, file=file, offset=0)
    try:
        metadata = safe_loads(body, limits)
    except UnsafeMetadataError as exc:
        raise UnsafeMetadataError(f"{file}: {exc}") from None
    except Exception as exc:
        raise CorruptionError(
            f"metadata does not unpickle: {type(exc).__name__}: {exc}",
            fqn=None,
            file=file,
            offset=0,
        ) from exc
    restore_dcp_class(metadata)
    if not isinstance(metadata, Metadata):
        raise MalformedMetadataError(
            f"holds a {type(metadata).__name__}, not a Metadata", field="<root>", file=file
        )
    check_metadata(metadata, file=file, limits=limits, filesystem=filesystem)
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
