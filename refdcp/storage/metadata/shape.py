"""The shape check of an unpickled ``.metadata`` (FMT-9, FMT-10, STORE-26).

After the restricted unpickler ran, every field is checked: a ``Metadata`` of
the expected shape comes back, or ``MalformedMetadataError`` names the first
offending field (``state_dict_metadata['w'].chunks[0].sizes``). Strings are
capped (FMT-10), data-file names must be plain names (STORE-26), nesting is
bounded and shared or cyclic references are walked once.
"""

from __future__ import annotations

import enum
import pathlib
import re
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from refdcp.storage.errors import MalformedMetadataError
from refdcp.storage.format.layout import check_data_name
from refdcp.storage.metadata.bounded import restore_dcp_class
from refdcp.storage.metadata.bulk import entries_ok, properties_fields_ok, records_ok
from refdcp.storage.metadata.limits import MetadataLimits

__all__ = ["check_metadata"]

_MISSING = object()
#: Names ``check_data_name`` certainly accepts (the fast path; anything else is checked fully).
_PLAIN_NAME = re.compile(r"\A[A-Za-z0-9_.-]{1,200}\Z")
_LEAVES = (
    int,
    float,
    complex,
    bool,
    type(None),
    torch.dtype,
    torch.layout,
    torch.memory_format,
    enum.Enum,
    torch.Size,
)
_DCP_CLASSES = (
    Metadata,
    TensorStorageMetadata,
    BytesStorageMetadata,
    ChunkStorageMetadata,
    TensorProperties,
    MetadataIndex,
    StorageMeta,
    _StorageInfo,
)
_PROPERTY_TYPES: tuple[tuple[str, type], ...] = (
    ("dtype", torch.dtype),
    ("layout", torch.layout),
    ("requires_grad", bool),
    ("memory_format", torch.memory_format),
    ("pin_memory", bool),
)


class _At:
    """A field's dotted path, formatted only when an error names it."""

    __slots__ = ("kind", "parent", "value")

    def __init__(self, parent: _At | None, kind: str, value: Any) -> None:
        self.parent, self.kind, self.value = parent, kind, value

    def attr(self, name: str) -> _At:
        return _At(self, ".", name)

    def key(self, key: Any) -> _At:
        return _At(self, "[]", key)

    def __str__(self) -> str:
        head = "" if self.parent is None else str(self.parent)
        if self.kind == ".":
            return f"{head}.{self.value}" if head else str(self.value)
        if self.kind == "[]":
            return f"{head}[{self.value!r:.200}]"
        return f"{head}{self.value}"


_ROOT = _At(None, "", "Metadata")


class _Checker:
    def __init__(self, file: str, limits: MetadataLimits, filesystem: bool) -> None:
        self.file = file
        self.filesystem = filesystem
        self.limits = limits
        self.seen: set[int] = set()

    def fail(self, where: _At, message: str) -> MalformedMetadataError:
        return MalformedMetadataError(message, field=str(where), file=self.file)

    def field(self, obj: Any, name: str, where: _At) -> Any:
        value = getattr(obj, name, _MISSING)
        if value is _MISSING:
            raise self.fail(where.attr(name), "missing")
        return restore_dcp_class(value)

    def string(self, value: Any, where: _At, *, optional: bool = False) -> None:
        if optional and value is None:
            return
        if not isinstance(value, str):
            raise self.fail(where, f"expected a str, got {type(value).__name__}")
        if len(value) > self.limits.max_string_chars:
            raise self.fail(
                where,
                f"string of {len(value)} characters is over the limit of "
                f"{self.limits.max_string_chars} (REFDCP_MAX_METADATA_STRING)",
            )

    def count(self, value: Any, where: _At, *, optional: bool = False) -> None:
        if optional and value is None:
            return
        if type(value) is not int or value < 0:
            raise self.fail(where, f"expected a non-negative int, got {value!r:.80}")

    def size(self, value: Any, where: _At, ndim: int | None = None) -> None:
        if type(value) is not torch.Size:
            raise self.fail(where, f"expected a torch.Size, got {type(value).__name__}")
        if ndim is not None and len(value) != ndim:
            raise self.fail(where, f"has {len(value)} dimensions, expected {ndim}")
        for d in value:
            if d < 0:
                raise self.fail(where, f"has a negative entry {d}")

    def instance(self, value: Any, cls: type, where: _At) -> Any:
        value = restore_dcp_class(value)
        if type(value) is not cls:
            raise self.fail(where, f"expected a {cls.__name__}, got {type(value).__name__}")
        return value

    def dict_of(self, value: Any, where: _At) -> dict[Any, Any]:
        if type(value) is not dict:
            raise self.fail(where, f"expected a dict, got {type(value).__name__}")
        return value

    # -- the parts of a Metadata ------------------------------------------------------------
    def metadata(self, md: Metadata) -> None:
        at = _At(None, ".", "")
        sdm = self.dict_of(
            self.field(md, "state_dict_metadata", _ROOT), at.attr("state_dict_metadata")
        )
        cap = self.limits.max_string_chars
        if not entries_ok(sdm, cap):  # one pass over all; else item by item (FMT-9)
            for fqn, entry in sdm.items():
                if not self.entry_ok(fqn, entry):  # the detailed check names what is wrong
                    self.entry(fqn, entry, at.attr("state_dict_metadata").key(fqn))
        self.string(self.field(md, "version", _ROOT), at.attr("version"), optional=True)
        sm = self.field(md, "storage_meta", _ROOT)
        if sm is not None:
            self.storage_meta(self.instance(sm, StorageMeta, at.attr("storage_meta")))
        storage = self.field(md, "storage_data", _ROOT)
        if storage is not None:
            sw = at.attr("storage_data")
            if not records_ok(self.dict_of(storage, sw), cap):
                for key, info in storage.items():
                    if not self.record_ok(key, info):
                        self.storage_record(key, info, sw)
        skip = {"state_dict_metadata", "version", "storage_meta", "storage_data"}
        for name, value in list(vars(md).items()):
            if name == "planner_data" and type(value) is dict:
                self.planner_data(value, at.attr(name))
            elif name not in skip:
                self.generic(value, at.attr(name))

    def planner_data(self, data: dict[Any, Any], where: _At) -> None:
        """torch's ``planner_data`` (fqn -> path tuple): the common entries checked in one
        tight pass, anything else by :meth:`generic`, with the same rules (FMT-9, FMT-10)."""
        cap = self.limits.max_string_chars
        if self.limits.max_depth < 2:  # the fast pass below assumes two levels are allowed
            self.generic(data, where)
            return
        self.seen.add(id(data))
        for k, v in data.items():
            if type(k) is str and len(k) <= cap and type(v) is tuple:
                for part in v:
                    kind = type(part)
                    if not ((kind is str and len(part) <= cap) or kind is int):
                        break
                else:
                    continue
            self.generic(k, where.attr("<key>"), 1)
            self.generic(v, where.key(k), 1)

    # -- fast paths: True only for what the detailed checks accept (no settling needed) -----
    def entry_ok(self, fqn: Any, entry: Any) -> bool:
        if type(fqn) is not str or len(fqn) > self.limits.max_string_chars:
            return False
        kind = type(entry)
        if kind is BytesStorageMetadata:
            return True
        if kind is not TensorStorageMetadata:
            return False
        d = entry.__dict__
        props, size, chunks = d.get("properties"), d.get("size"), d.get("chunks")
        if type(props) is not TensorProperties or type(size) is not torch.Size:
            return False
        if type(chunks) is not list or (size and min(size) < 0):
            return False
        if not properties_fields_ok(props.__dict__):
            return False
        ndim = len(size)
        for chunk in chunks:
            if type(chunk) is not ChunkStorageMetadata:
                return False
            c = chunk.__dict__
            offsets, sizes = c.get("offsets"), c.get("sizes")
            if type(offsets) is not torch.Size or type(sizes) is not torch.Size:
                return False
            if len(offsets) != ndim or len(sizes) != ndim:
                return False
            for o, n, full in zip(offsets, sizes, size, strict=True):
                if o < 0 or n < 0 or o + n > full:
                    return False
        return True

    def record_ok(self, key: Any, info: Any) -> bool:
        if type(key) is not MetadataIndex or type(info) is not _StorageInfo:
            return False
        k = key.__dict__
        fqn, offset, index = k.get("fqn"), k.get("offset"), k.get("index")
        if type(fqn) is not str or len(fqn) > self.limits.max_string_chars:
            return False
        if offset is not None and (type(offset) is not torch.Size or (offset and min(offset) < 0)):
            return False
        if index is not None and (type(index) is not int or index < 0):
            return False
        d = info.__dict__
        name, start, length = d.get("relative_path"), d.get("offset"), d.get("length")
        if type(name) is not str or not _PLAIN_NAME.match(name) or name in (".", ".."):
            return False
        if type(start) is not int or start < 0 or type(length) is not int or length < 0:
            return False
        if d.get("transform_descriptors") is not None:
            return False  # rare: the detailed check looks at it
        crc, data_offset = d.get("refdcp_crc32c"), d.get("refdcp_data_offset")
        if crc is not None and (type(crc) is not int or not 0 <= crc < 1 << 32):
            return False
        return data_offset is None or (type(data_offset) is int and 0 <= data_offset <= length)

    def entry(self, fqn: Any, entry: Any, where: _At) -> None:
        self.string(fqn, where)
        entry = restore_dcp_class(entry)
        if type(entry) is BytesStorageMetadata:
            return
        if type(entry) is not TensorStorageMetadata:
            raise self.fail(
                where,
                "expected TensorStorageMetadata or BytesStorageMetadata, "
                f"got {type(entry).__name__}",
            )
        pw = where.attr("properties")
        props = self.instance(self.field(entry, "properties", where), TensorProperties, pw)
        for name, kind in _PROPERTY_TYPES:
            value = getattr(props, name, _MISSING)
            if value is not _MISSING and not isinstance(value, kind):
                raise self.fail(pw.attr(name), f"expected {kind.__name__}")
        size = self.field(entry, "size", where)
        self.size(size, where.attr("size"))
        chunks = self.field(entry, "chunks", where)
        cl = where.attr("chunks")
        if type(chunks) is not list:
            raise self.fail(cl, f"expected a list, got {type(chunks).__name__}")
        for i, chunk in enumerate(chunks):
            cw = _At(cl, "", f"[{i}]")
            chunk = self.instance(chunk, ChunkStorageMetadata, cw)
            offsets = self.field(chunk, "offsets", cw)
            sizes = self.field(chunk, "sizes", cw)
            self.size(offsets, cw.attr("offsets"), len(size))
            self.size(sizes, cw.attr("sizes"), len(size))
            for o, n, full in zip(offsets, sizes, size, strict=True):
                if o + n > full:
                    raise self.fail(
                        cw, f"offsets {list(offsets)} + sizes {list(sizes)} exceed {list(size)}"
                    )

    def storage_meta(self, sm: StorageMeta) -> None:
        at = _At(None, ".", "storage_meta")
        cid = self.field(sm, "checkpoint_id", at)
        if cid is not None and not isinstance(cid, str | pathlib.PurePath):
            raise self.fail(
                at.attr("checkpoint_id"), f"expected a str or path, got {type(cid).__name__}"
            )
        if cid is not None:
            self.string(str(cid), at.attr("checkpoint_id"))
        for name in ("save_id", "load_id"):
            self.string(self.field(sm, name, at), at.attr(name), optional=True)
        modules = self.field(sm, "modules", at)
        if type(modules) is not list:
            raise self.fail(at.attr("modules"), f"expected a list, got {type(modules).__name__}")
        for i, m in enumerate(modules):
            self.string(m, _At(at.attr("modules"), "", f"[{i}]"))

    def storage_record(self, key: Any, info: Any, where: _At) -> None:
        key = restore_dcp_class(key)
        if type(key) is not MetadataIndex:
            raise self.fail(where, f"key: expected a MetadataIndex, got {type(key).__name__}")
        kw = where.key(getattr(key, "fqn", "?"))
        fqn = self.field(key, "fqn", kw)
        self.string(fqn, kw.attr("key.fqn"))
        offset = self.field(key, "offset", kw)
        if offset is not None:
            self.size(offset, kw.attr("key.offset"))
        self.count(self.field(key, "index", kw), kw.attr("key.index"), optional=True)
        if not self.filesystem and type(restore_dcp_class(info)) is not _StorageInfo:
            self.generic(info, kw)  # another backend's record: allowed types, bounded
            return
        info = self.instance(info, _StorageInfo, kw)
        check_data_name(self.field(info, "relative_path", kw), file=self.file, fqn=fqn)
        self.count(self.field(info, "offset", kw), kw.attr("offset"))
        length = self.field(info, "length", kw)
        self.count(length, kw.attr("length"))
        td = self.field(info, "transform_descriptors", kw)
        if td is not None:
            if type(td) not in (list, tuple):
                raise self.fail(kw.attr("transform_descriptors"), "expected a list of str")
            for t in td:
                self.string(t, kw.attr("transform_descriptors"))
        crc = getattr(info, "refdcp_crc32c", None)
        if crc is not None and (type(crc) is not int or not 0 <= crc < 1 << 32):
            raise self.fail(kw.attr("refdcp_crc32c"), "expected a 32-bit unsigned int")
        data_offset = getattr(info, "refdcp_data_offset", None)
        self.count(data_offset, kw.attr("refdcp_data_offset"), optional=True)
        if data_offset is not None and data_offset > length:
            raise self.fail(
                kw.attr("refdcp_data_offset"), f"{data_offset} is past the item's length {length}"
            )

    def generic(self, value: Any, where: _At, depth: int = 0) -> None:
        """Any other field (planner data, future fields): allowed types only, bounded."""
        stack: list[tuple[Any, _At, int]] = [(value, where, depth)]
        while stack:
            obj, at, depth = stack.pop()
            obj = restore_dcp_class(obj)
            if isinstance(obj, str | bytes):
                if len(obj) > self.limits.max_string_chars:
                    raise self.fail(at, f"string of {len(obj)} characters is over the limit")
                continue
            if isinstance(obj, pathlib.PurePath):
                self.string(str(obj), at)
                continue
            if isinstance(obj, _LEAVES):
                continue
            if id(obj) in self.seen:
                continue
            self.seen.add(id(obj))
            if depth >= self.limits.max_depth:
                raise self.fail(at, f"nested deeper than {self.limits.max_depth} levels")
            if isinstance(obj, dict):
                for k, v in obj.items():
                    stack.append((k, at.attr("<key>"), depth + 1))
                    stack.append((v, at.key(k), depth + 1))
            elif isinstance(obj, list | tuple | set | frozenset):
                stack.extend((v, _At(at, "", f"[{i}]"), depth + 1) for i, v in enumerate(obj))
            elif isinstance(obj, _DCP_CLASSES):
                stack.extend((v, at.attr(k), depth + 1) for k, v in vars(obj).items())
            else:
                raise self.fail(at, f"unexpected type {type(obj).__name__}")


def check_metadata(
    md: Metadata, *, file: str, limits: MetadataLimits, filesystem: bool = True
) -> None:
    """Raise ``MalformedMetadataError`` naming the first bad field, else return (FMT-9).

    ``filesystem=False`` (``refdcp inspect``) also admits storage records of
    other backends (any allowed, bounded types) besides ``_StorageInfo``.
    """
    _Checker(file, limits, filesystem).metadata(md)
