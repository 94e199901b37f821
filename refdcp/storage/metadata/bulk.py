"""The common case of the ``.metadata`` shape check in one vectorised pass (FMT-9, FMT-10, STORE-26).

``shape.py`` checks every entry and storage record field by field,
which at 20,000 items costs more than unpickling them. The functions here
accept exactly what those per-item checks accept, but test each rule for all
items at once with C-level ``map``/``set``/``min``/``max`` over the fields,
and check the objects the items share (META-8: one ``TensorProperties``,
``torch.Size`` or file name for many items) once each. They return False
as soon as anything is unusual; the caller then runs the per-item checks,
which name the offending field. They never raise.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Iterable, Mapping
from itertools import chain, repeat
from operator import attrgetter, itemgetter
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from refdcp.storage.errors import MetadataFieldMissing

__all__ = ["entries_ok", "properties_fields_ok", "records_ok"]

#: Names ``check_data_name`` certainly accepts (anything else goes to the per-item check).
PLAIN_NAME = re.compile(r"\A[A-Za-z0-9_.-]{1,200}\Z")
_U32 = 1 << 32


def _field(objs: list[Any], name: str) -> list[Any]:
    """``obj.name`` of every object (a required field)."""
    try:
        return list(map(attrgetter(name), objs))
    except AttributeError:
        raise MetadataFieldMissing(name) from None


def _optional(objs: list[Any], name: str) -> list[Any]:
    """``obj.name`` of every object, None where it has none (a field with a default)."""
    return list(map(getattr, objs, repeat(name), repeat(None)))


def _only(values: Iterable[Any], kind: type) -> bool:
    kinds = set(map(type, values))
    return not kinds or kinds == {kind}


def _strings_ok(values: list[Any], cap: int) -> bool:
    return _only(values, str) and (not values or max(map(len, values)) <= cap)


def _counts_ok(values: list[Any]) -> bool:
    """Every value an ``int`` (not a bool) and non-negative."""
    return _only(values, int) and (not values or min(values) >= 0)


def _unique(values: list[Any]) -> list[Any]:
    """The distinct objects of ``values`` (by identity)."""
    return list(dict(zip(map(id, values), values)).values())


def _sizes_ok(sizes: list[Any]) -> bool:
    """Every value a ``torch.Size`` without negative entries."""
    if not _only(sizes, torch.Size):
        return False
    return min(chain.from_iterable(sizes), default=0) >= 0


def properties_fields_ok(p: Mapping[str, Any]) -> bool:
    """A ``TensorProperties``' fields (its ``__dict__``) have the types torch writes (FMT-9)."""
    return (
        type(p.get("dtype")) is torch.dtype
        and type(p.get("layout")) is torch.layout
        and type(p.get("requires_grad")) is bool
        and type(p.get("memory_format")) is torch.memory_format
        and type(p.get("pin_memory")) is bool
    )


def _props_ok(props: list[Any]) -> bool:
    if not _only(props, TensorProperties):
        return False
    return all(map(properties_fields_ok, map(vars, _unique(props))))


def _boxes_ok(offsets: list[Any], sizes: list[Any], fulls: list[Any]) -> bool:
    """Each chunk's offsets and sizes: torch.Size of the tensor's rank, inside the tensor."""
    if not (_only(offsets, torch.Size) and _only(sizes, torch.Size)):
        return False
    distinct = dict(
        zip(zip(map(id, offsets), map(id, sizes), map(id, fulls)), zip(offsets, sizes, fulls))
    )
    for off, n, full in distinct.values():
        if len(off) != len(full) or len(n) != len(full):
            return False
        for o, k, f in zip(off, n, full):
            if o < 0 or k < 0 or o + k > f:
                return False
    return True


def entries_ok(sdm: dict[Any, Any], cap: int) -> bool:
    """True when every ``state_dict_metadata`` entry passes the per-item check (FMT-9, FMT-10)."""
    try:
        return _entries_ok(sdm, cap)
    except MetadataFieldMissing:
        return False


def records_ok(storage: dict[Any, Any], cap: int) -> bool:
    """True when every ``storage_data`` record passes the per-item check (FMT-9, STORE-26)."""
    try:
        return _records_ok(storage, cap)
    except MetadataFieldMissing:
        return False


def _entries_ok(sdm: dict[Any, Any], cap: int) -> bool:
    if not _strings_ok(list(sdm), cap):
        return False
    values = list(sdm.values())
    kinds = set(map(type, values))
    if not kinds <= {TensorStorageMetadata, BytesStorageMetadata}:
        return False
    tensors = (
        values
        if kinds == {TensorStorageMetadata}
        else [v for v in values if type(v) is TensorStorageMetadata]
    )
    sizes = _field(tensors, "size")
    chunk_lists = _field(tensors, "chunks")
    props = _field(tensors, "properties")
    if not (_sizes_ok(sizes) and _only(chunk_lists, list) and _props_ok(props)):
        return False
    counts = list(map(len, chunk_lists))
    if set(counts) == {1}:  # one chunk per tensor (the common case): no repeats needed
        chunks, fulls = list(map(itemgetter(0), chunk_lists)), sizes
    else:
        chunks = list(chain.from_iterable(chunk_lists))
        fulls = list(chain.from_iterable(map(repeat, sizes, counts)))
    if not _only(chunks, ChunkStorageMetadata):
        return False
    return _boxes_ok(_field(chunks, "offsets"), _field(chunks, "sizes"), fulls)


def _records_ok(storage: dict[Any, Any], cap: int) -> bool:
    keys, infos = list(storage), list(storage.values())
    if not (_only(keys, MetadataIndex) and _only(infos, _StorageInfo)):
        return False
    if not _strings_ok(_field(keys, "fqn"), cap):
        return False
    offsets = [o for o in _optional(keys, "offset") if o is not None]
    indices = [i for i in _optional(keys, "index") if i is not None]
    if not (_sizes_ok(offsets) and _counts_ok(indices)):
        return False
    names = _field(infos, "relative_path")
    if not _only(names, str):
        return False
    for name in set(names):
        if not PLAIN_NAME.match(name) or name in (".", ".."):
            return False
    lengths = _field(infos, "length")
    if not (_counts_ok(_field(infos, "offset")) and _counts_ok(lengths)):
        return False
    if any(t is not None for t in _optional(infos, "transform_descriptors")):
        return False  # rare: the per-item check looks at it
    crcs = [c for c in _optional(infos, "refdcp_crc32c") if c is not None]
    if not _counts_ok(crcs) or (crcs and max(crcs) >= _U32):
        return False
    data_offsets = _optional(infos, "refdcp_data_offset")
    present = [d for d in data_offsets if d is not None]
    if not _counts_ok(present):
        return False
    if len(present) == len(data_offsets):
        return not any(map(operator.gt, data_offsets, lengths))
    return all(d is None or d <= n for d, n in zip(data_offsets, lengths))
