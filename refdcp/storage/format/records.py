"""torch's per-item write records built directly from their field values (INTEG-1, STORE-8).

``WriteResult`` is a frozen dataclass and ``_StorageInfo`` a plain one; a
save of many small tensors builds one of each per item, and their generated
``__init__`` (plus refdcp's two extra attributes on ``_StorageInfo``) costs
more than the item's framing. These builders set the same fields in the same
order (``_StorageInfo``'s ``transform_descriptors`` stays at its class default
None, which its ``__getstate__`` leaves out of the pickle anyway). They are
used only while the installed torch's classes have the fields they know;
otherwise they call the constructors.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.storage import WriteResult

from refdcp.storage.format.items import CRC_ATTR, DATA_OFFSET_ATTR

__all__ = ["fields_are", "small_write_result", "storage_info", "write_result"]

_new = object.__new__
_set = object.__setattr__


def fields_are(cls: type, names: tuple[str, ...]) -> bool:
    """True when ``cls`` is still the plain dataclass with these fields that a fast builder
    fills by setting ``__dict__`` (no ``__post_init__``, no slots)."""
    return (
        dataclasses.is_dataclass(cls)
        and tuple(f.name for f in dataclasses.fields(cls)) == names
        and not hasattr(cls, "__post_init__")
        and "__slots__" not in vars(cls)
    )


FAST = (
    fields_are(_StorageInfo, ("relative_path", "offset", "length", "transform_descriptors"))
    and getattr(_StorageInfo, "transform_descriptors", 0) is None
    and fields_are(WriteResult, ("index", "size_in_bytes", "storage_data"))
)


def storage_info(
    relative_path: str, offset: int, length: int, crc: int, data_offset: int | None
) -> _StorageInfo:
    """``_StorageInfo(relative_path, offset, length)`` with refdcp's CRC-32C and data offset
    (INTEG-1, FMT-3); the same object :func:`refdcp.storage.format.items.make_storage_info` builds."""
    if not FAST:
        info = _StorageInfo(relative_path, offset, length)
        setattr(info, CRC_ATTR, crc)
        if data_offset is not None:
            setattr(info, DATA_OFFSET_ATTR, data_offset)
        return info
    info = _new(_StorageInfo)
    state: dict[str, Any] = {
        "relative_path": relative_path,
        "offset": offset,
        "length": length,
        CRC_ATTR: crc,
    }
    if data_offset is not None:
        state[DATA_OFFSET_ATTR] = data_offset
    _set(info, "__dict__", state)
    return info


#: The attribute of a ``WriteResult`` (never of the stored ``_StorageInfo``) holding the
#: tensor's value digest the writer computed on the way (DEDUP-17).
VALUE_CRC_ATTR = "refdcp_value_crc32c"


def write_result(
    index: MetadataIndex, size_in_bytes: int, data: Any, value_crc: int | None = None
) -> WriteResult:
    """``WriteResult(index=..., size_in_bytes=..., storage_data=...)``, carrying ``value_crc``."""
    if not FAST:
        result = WriteResult(index=index, size_in_bytes=size_in_bytes, storage_data=data)
        if value_crc is not None:
            _set(result, VALUE_CRC_ATTR, value_crc)
        return result
    result = _new(WriteResult)
    state = {"index": index, "size_in_bytes": size_in_bytes, "storage_data": data}
    if value_crc is not None:
        state[VALUE_CRC_ATTR] = value_crc
    _set(result, "__dict__", state)
    return result


def small_write_result(
    index: MetadataIndex, relative_path: str, offset: int, parts: tuple[Any, ...]
) -> WriteResult:
    """The ``WriteResult`` of an item written from
    :func:`~refdcp.storage.format.small_tensors.small_tensor_parts`' ``parts`` at ``offset``:
    ``write_result(index, length, storage_info(relative_path, offset, length, crc,
    data_offset), value_crc)``, built in one call (it runs once per small item)."""
    _, _, _, length, crc, data_offset, value_crc = parts
    if not FAST:
        info = storage_info(relative_path, offset, length, crc, data_offset)
        return write_result(index, length, info, value_crc)
    info = _new(_StorageInfo)
    _set(
        info,
        "__dict__",
        {
            "relative_path": relative_path,
            "offset": offset,
            "length": length,
            CRC_ATTR: crc,
            DATA_OFFSET_ATTR: data_offset,
        },
    )
    result = _new(WriteResult)
    _set(
        result,
        "__dict__",
        {"index": index, "size_in_bytes": length, "storage_data": info, VALUE_CRC_ATTR: value_crc},
    )
    return result


def value_crc_of(result: WriteResult) -> int | None:
    """The value digest a refdcp writer recorded on ``result``, or None (DEDUP-17)."""
    value = getattr(result, VALUE_CRC_ATTR, None)
    return value if isinstance(value, int) else None
