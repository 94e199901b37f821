"""The ``.metadata`` shape check, field by field (FMT-9, FMT-10, STORE-26; issue 13).

A valid ``Metadata`` of every kind refdcp and torch write is accepted (also at
the exact limits), and each single malformed field is refused with
``MalformedMetadataError`` (``UnsafePathError`` for data-file names) naming
that field. Both the check on its own (``check_metadata``) and the full read
path (``load_metadata(dump_metadata(md))``) are exercised.
"""

from __future__ import annotations

import copy
import pathlib
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import given, settings
from hypothesis import strategies as st
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

import refdcp
from refdcp.storage.errors import MalformedMetadataError, UnsafePathError
from refdcp.storage.fs.metadata_file import read_metadata_file
from refdcp.storage.metadata.limits import MetadataLimits
from refdcp.storage.metadata.safe import dump_metadata, load_metadata
from refdcp.storage.metadata.shape import check_metadata

SINGLE_PATH = "mutation-kill tests pinning one module of the default path (tests/MUTATION.md); the behaviour runs on both in the shared suites"

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

LIMITS = MetadataLimits()
_S = torch.Size


def _tsm(size: list[int], chunks: list[tuple[list[int], list[int]]]) -> TensorStorageMetadata:
    return TensorStorageMetadata(
        TensorProperties(dtype=torch.float32),
        _S(size),
        [ChunkStorageMetadata(_S(o), _S(n)) for o, n in chunks],
    )


def _info(name: str, offset: int, length: int, crc: int | None, data_offset: int | None) -> Any:
    info = _StorageInfo(name, offset, length)
    if crc is not None:
        info.refdcp_crc32c = crc  # type: ignore[attr-defined]
    if data_offset is not None:
        info.refdcp_data_offset = data_offset  # type: ignore[attr-defined]
    return info


def valid_md() -> Metadata:
    """A Metadata with every kind of entry refdcp writes: 2-d sharded, 0-d, empty, bytes."""
    sdm: dict[str, Any] = {
        "w": _tsm([4, 6], [([0, 0], [2, 6]), ([2, 0], [2, 6])]),
        "scalar": _tsm([], [([], [])]),
        "empty": _tsm([0, 3], [([0, 0], [0, 3])]),
        "edge": _tsm([5], [([5], [0])]),  # an empty chunk at the very end
        "step": BytesStorageMetadata(),
    }
    storage: dict[Any, Any] = {
        MetadataIndex("w", _S([0, 0]), 0): _info("__0_0.0123456789ab.distcp", 0, 200, 0, 64),
        MetadataIndex("w", _S([2, 0])): _info("__1_0.0123456789ab.distcp", 0, 200, 2**32 - 1, 0),
        MetadataIndex("scalar", _S([])): _info("__0_0.0123456789ab.distcp", 200, 80, 7, 80),
        MetadataIndex("empty", _S([0, 0])): _info("__0_0.0123456789ab.distcp", 280, 0, None, None),
        MetadataIndex("edge", _S([5])): _info("__0_0.0123456789ab.distcp", 280, 0, None, 0),
        MetadataIndex("step"): _info("__0_0.0123456789ab.distcp", 280, 5, 1, None),
    }
    return Metadata(
        sdm,
        planner_data={"w": ("w",), "nested": [{"a": (1, 2.5, None)}, {1, 2}, frozenset({3})]},
        storage_data=storage,
        storage_meta=StorageMeta(Path("/ckpt/step-1"), "0123456789ab", "load-1", ["torch"]),
        version="1.0.0",
    )


def _check(md: Metadata, limits: MetadataLimits = LIMITS, filesystem: bool = True) -> None:
    check_metadata(md, file="ckpt/.metadata", limits=limits, filesystem=filesystem)


# -- what is accepted ----------------------------------------------------------------------


@pytest.mark.spec("FMT-9")
def test_every_kind_of_valid_entry_is_accepted_alone_and_through_load_metadata() -> None:
    md = valid_md()
    _check(md)
    _check(_detailed(md))
    load_metadata(dump_metadata(_detailed(md)))
    back = load_metadata(dump_metadata(copy.deepcopy(md)))
    assert set(back.state_dict_metadata) == set(md.state_dict_metadata)
    assert len(back.storage_data) == len(md.storage_data)


@pytest.mark.spec("FMT-9")
@pytest.mark.parametrize("writer", ["refdcp", "torch"])
def test_metadata_written_by_refdcp_and_by_torch_is_accepted(tmp_path: Path, writer: str) -> None:
    sd = {
        "w": torch.arange(12.0).reshape(3, 4),
        "scalar": torch.tensor(3),
        "empty": torch.zeros(0, 2),
        "b": torch.ones(2, dtype=torch.bool),
        "obj": {"x": [1, "s"]},
        "step": 4,
    }
    if writer == "refdcp":
        refdcp.save(sd, checkpoint_id=tmp_path)
    else:
        dcp.save(sd, checkpoint_id=tmp_path, no_dist=True)
    md = load_metadata(read_metadata_file(tmp_path / ".metadata"))
    _check(md)
    _check(md, filesystem=False)
    assert {"w", "scalar", "empty", "b", "step"} <= set(md.state_dict_metadata)


def _props(**kw: Any) -> TensorProperties:
    p = TensorProperties(dtype=torch.float32)
    p.__dict__.update(kw)
    return p


def _cyclic(md: Metadata) -> None:
    a: list[Any] = [1]
    a.append(a)
    md.planner_data = {"a": a, "b": {"a": a}}


def _shared(md: Metadata) -> None:
    shared = [[0] * 3]
    md.planner_data = [shared] * 100


def _entry(md: Metadata) -> Any:
    return md.state_dict_metadata["w"]


def _rec(md: Metadata, fqn: str) -> Any:
    return next(i for k, i in md.storage_data.items() if k.fqn == fqn)


_VALID_VARIANTS: dict[str, Callable[[Metadata], None]] = {
    "version None": lambda md: setattr(md, "version", None),
    "no storage_meta": lambda md: setattr(md, "storage_meta", None),
    "no storage_data": lambda md: setattr(md, "storage_data", None),
    "checkpoint_id a str": lambda md: setattr(md.storage_meta, "checkpoint_id", "/x/y"),
    "checkpoint_id None": lambda md: setattr(md.storage_meta, "checkpoint_id", None),
    "save_id None": lambda md: setattr(md.storage_meta, "save_id", None),
    "no modules": lambda md: setattr(md.storage_meta, "modules", []),
    "index None": lambda md: md.storage_data.update(
        {MetadataIndex("w", _S([0, 0])): md.storage_data.pop(MetadataIndex("w", _S([0, 0]), 0))}
    ),
    "index 0 of a bytes item": lambda md: md.storage_data.update(
        {MetadataIndex("step", None, 0): _info("x.distcp", 0, 1, None, None)}
    ),
    "transform_descriptors": lambda md: setattr(
        _rec(md, "w"), "transform_descriptors", ["zstd", "x"]
    ),
    "transform_descriptors a tuple": lambda md: setattr(_rec(md, "w"), "transform_descriptors", ()),
    "data offset equal to length": lambda md: setattr(_rec(md, "w"), "refdcp_data_offset", 200),
    "a name of 255 bytes": lambda md: setattr(_rec(md, "w"), "relative_path", "n" * 255),
    "a name of 255 utf-8 bytes": lambda md: setattr(_rec(md, "w"), "relative_path", "é" * 127),
    "a name with spaces": lambda md: setattr(_rec(md, "w"), "relative_path", "a b.distcp"),
    "a name starting with dots": lambda md: setattr(_rec(md, "w"), "relative_path", "...x"),
    "a property missing": lambda md: _entry(md).properties.__dict__.pop("pin_memory"),
    "requires_grad True": lambda md: setattr(_entry(md).properties, "requires_grad", True),
    "channels_last": lambda md: setattr(
        _entry(md).properties, "memory_format", torch.channels_last
    ),
    "bfloat16": lambda md: setattr(_entry(md).properties, "dtype", torch.bfloat16),
    "no chunks": lambda md: setattr(_entry(md), "chunks", []),
    "chunk reaching the end": lambda md: setattr(_entry(md).chunks[1], "sizes", _S([2, 6])),
    "non-ascii fqn": lambda md: md.state_dict_metadata.update({"ü.w": BytesStorageMetadata()}),
    "a shared chunk list": lambda md: setattr(
        md.state_dict_metadata["empty"], "chunks", md.state_dict_metadata["empty"].chunks
    ),
    "a cyclic planner_data": _cyclic,
    "a shared planner_data list": _shared,
    "planner data of DCP classes": lambda md: setattr(
        md, "planner_data", [ChunkStorageMetadata(_S([1]), _S([2])), MetadataIndex("w")]
    ),
    "planner data of leaves": lambda md: setattr(
        md,
        "planner_data",
        (1, 2.0, 1j, True, None, torch.float16, torch.strided, torch.contiguous_format, _S([3])),
    ),
    "planner data of paths and bytes": lambda md: setattr(
        md, "planner_data", {pathlib.PurePosixPath("a/b"): b"xyz", "k": pathlib.Path("c")}
    ),
    "an extra attribute": lambda md: setattr(md, "extra_field", {"a": [1]}),
}


def _detailed(md: Metadata) -> Metadata:
    """The same metadata, still valid, in a form no quick check passes: every entry's
    properties lack ``pin_memory`` and every record has empty transform descriptors."""
    md = copy.deepcopy(md)
    for entry in md.state_dict_metadata.values():
        if isinstance(entry, TensorStorageMetadata):
            entry.properties.__dict__.pop("pin_memory", None)
    for info in (md.storage_data or {}).values():
        if info.transform_descriptors is None:
            info.transform_descriptors = []
    return md


@pytest.mark.spec("FMT-9")
@pytest.mark.parametrize("case", sorted(_VALID_VARIANTS))
def test_valid_variants_are_accepted(case: str) -> None:
    md = valid_md()
    _VALID_VARIANTS[case](md)
    _check(md)
    _check(md, filesystem=False)
    _check(_detailed(md))
    _check(_detailed(md), filesystem=False)
    if case != "planner data of leaves":  # a bare memory_format is not among FMT-6's types
        load_metadata(dump_metadata(md))


# -- each single malformed field is refused and named --------------------------------------


def _setter(get: Callable[[Metadata], Any], name: str, value: Any) -> Callable[[Metadata], None]:
    return lambda md: setattr(get(md), name, value)


def _drop(get: Callable[[Metadata], Any], name: str) -> Callable[[Metadata], None]:
    return lambda md: get(md).__dict__.pop(name)


def _chunk(i: int) -> Callable[[Metadata], Any]:
    return lambda md: _entry(md).chunks[i]


def _key(md: Metadata, fqn: str) -> Any:
    return next(k for k in md.storage_data if k.fqn == fqn)


def _replace_key(fqn: str, new: Any) -> Callable[[Metadata], None]:
    def go(md: Metadata) -> None:
        md.storage_data[new] = md.storage_data.pop(_key(md, fqn))

    return go


def _raw_index(fqn: Any, offset: Any, index: Any) -> MetadataIndex:
    """A MetadataIndex holding exactly these fields (its constructor would convert them)."""
    key = MetadataIndex("x")
    key.__dict__.update(fqn=fqn, offset=offset, index=index)
    return key


def _both(*steps: Callable[[Metadata], None]) -> Callable[[Metadata], None]:
    def go(md: Metadata) -> None:
        for step in steps:
            step(md)

    return go


def _add_entry(fqn: Any, entry: Any) -> Callable[[Metadata], None]:
    return lambda md: md.state_dict_metadata.__setitem__(fqn, entry)


_W = r"state_dict_metadata\['w'\]"
_SW = r"storage_data\['w'\]"
_SS = r"storage_data\['scalar'\]"
_SM = r"storage_meta"
_R = lambda md: _rec(md, "w")  # noqa: E731
_RS = lambda md: _rec(md, "scalar")  # noqa: E731

#: case -> (mutation, regex the error's ``field`` must match in full, regex of the message)
_BAD: dict[str, tuple[Callable[[Metadata], None], str, str]] = {
    # Metadata itself
    "no state_dict_metadata": (
        _drop(lambda md: md, "state_dict_metadata"),
        r"Metadata\.state_dict_metadata",
        "missing",
    ),
    "state_dict_metadata a list": (
        _setter(lambda md: md, "state_dict_metadata", []),
        "state_dict_metadata",
        "expected a dict",
    ),
    "storage_data a list": (
        _setter(lambda md: md, "storage_data", []),
        "storage_data",
        "expected a dict",
    ),
    "version an int": (_setter(lambda md: md, "version", 5), "version", "expected a str"),
    "storage_meta a dict": (
        _setter(lambda md: md, "storage_meta", {}),
        "storage_meta",
        "expected a StorageMeta",
    ),
    # state_dict_metadata entries
    "fqn an int": (
        _add_entry(5, BytesStorageMetadata()),
        r"state_dict_metadata\[5\]",
        "expected a str, got int",
    ),
    "entry a StorageMeta": (
        _add_entry("x", StorageMeta()),
        r"state_dict_metadata\['x'\]",
        "expected TensorStorageMetadata or BytesStorageMetadata, got StorageMeta",
    ),
    "entry None": (_add_entry("x", None), r"state_dict_metadata\['x'\]", "got NoneType"),
    "no properties": (_drop(_entry, "properties"), _W + r"\.properties", "missing"),
    "properties a dict": (
        _setter(_entry, "properties", {}),
        _W + r"\.properties",
        "expected a TensorProperties, got dict",
    ),
    "dtype a str": (
        _setter(lambda md: _entry(md).properties, "dtype", "float32"),
        _W + r"\.properties\.dtype",
        "expected dtype",
    ),
    "layout a str": (
        _setter(lambda md: _entry(md).properties, "layout", "strided"),
        _W + r"\.properties\.layout",
        "expected layout",
    ),
    "requires_grad an int": (
        _setter(lambda md: _entry(md).properties, "requires_grad", 1),
        _W + r"\.properties\.requires_grad",
        "expected bool",
    ),
    "memory_format None": (
        _setter(lambda md: _entry(md).properties, "memory_format", None),
        _W + r"\.properties\.memory_format",
        "expected memory_format",
    ),
    "pin_memory an int": (
        _setter(lambda md: _entry(md).properties, "pin_memory", 0),
        _W + r"\.properties\.pin_memory",
        "expected bool",
    ),
    "no size": (_drop(_entry, "size"), _W + r"\.size", "missing"),
    "size a tuple": (
        _setter(_entry, "size", (4, 6)),
        _W + r"\.size",
        "expected a torch.Size, got tuple",
    ),
    "size negative": (
        _setter(_entry, "size", _S([4, -6])),
        _W + r"\.size",
        "has a negative entry -6",
    ),
    "size negative first": (
        _setter(_entry, "size", _S([-1, 6])),
        _W + r"\.size",
        "has a negative entry -1",
    ),
    "no chunks": (_drop(_entry, "chunks"), _W + r"\.chunks", "missing"),
    "chunks a tuple": (
        _setter(_entry, "chunks", ()),
        _W + r"\.chunks",
        "expected a list, got tuple",
    ),
    "chunk None": (
        lambda md: _entry(md).chunks.append(None),
        _W + r"\.chunks\[2\]",
        "expected a ChunkStorageMetadata, got NoneType",
    ),
    "chunk no offsets": (_drop(_chunk(1), "offsets"), _W + r"\.chunks\[1\]\.offsets", "missing"),
    "chunk no sizes": (_drop(_chunk(0), "sizes"), _W + r"\.chunks\[0\]\.sizes", "missing"),
    "chunk offsets a list": (
        _setter(_chunk(1), "offsets", [2, 0]),
        _W + r"\.chunks\[1\]\.offsets",
        "expected a torch.Size",
    ),
    "chunk sizes a tuple": (
        _setter(_chunk(0), "sizes", (2, 6)),
        _W + r"\.chunks\[0\]\.sizes",
        "expected a torch.Size",
    ),
    "chunk offsets 1-d": (
        _setter(_chunk(1), "offsets", _S([2])),
        _W + r"\.chunks\[1\]\.offsets",
        "has 1 dimensions, expected 2",
    ),
    "chunk sizes 3-d": (
        _setter(_chunk(1), "sizes", _S([2, 6, 1])),
        _W + r"\.chunks\[1\]\.sizes",
        "has 3 dimensions, expected 2",
    ),
    "chunk offset negative": (
        _setter(_chunk(0), "offsets", _S([0, -1])),
        _W + r"\.chunks\[0\]\.offsets",
        "negative entry -1",
    ),
    "chunk size negative": (
        _setter(_chunk(1), "sizes", _S([-2, 6])),
        _W + r"\.chunks\[1\]\.sizes",
        "negative entry -2",
    ),
    "chunk past the end, dim 0": (
        _setter(_chunk(1), "offsets", _S([3, 0])),
        _W + r"\.chunks\[1\]",
        r"offsets \[3, 0\] \+ sizes \[2, 6\] exceed \[4, 6\]",
    ),
    "chunk past the end, dim 1": (
        _setter(_chunk(0), "sizes", _S([2, 7])),
        _W + r"\.chunks\[0\]",
        r"offsets \[0, 0\] \+ sizes \[2, 7\] exceed \[4, 6\]",
    ),
    "empty chunk past the end": (
        _setter(lambda md: md.state_dict_metadata["edge"].chunks[0], "offsets", _S([6])),
        r"state_dict_metadata\['edge'\]\.chunks\[0\]",
        "exceed",
    ),
    "0-d chunk of 1 dim": (
        _setter(lambda md: md.state_dict_metadata["scalar"].chunks[0], "sizes", _S([1])),
        r"state_dict_metadata\['scalar'\]\.chunks\[0\]\.sizes",
        "has 1 dimensions, expected 0",
    ),
    # the same faults where no earlier chunk is valid (the fast path looks at chunk 0 first)
    "size negative, no chunks": (
        _both(_setter(_entry, "chunks", []), _setter(_entry, "size", _S([4, -6]))),
        _W + r"\.size",
        "has a negative entry -6",
    ),
    "the only chunk None": (
        _setter(_entry, "chunks", [None]),
        _W + r"\.chunks\[0\]",
        "expected a ChunkStorageMetadata, got NoneType",
    ),
    "first chunk offsets a list": (
        _setter(_chunk(0), "offsets", [0, 0]),
        _W + r"\.chunks\[0\]\.offsets",
        "expected a torch.Size",
    ),
    "the only chunk's offsets a list": (
        _setter(lambda md: md.state_dict_metadata["edge"].chunks[0], "offsets", [5]),
        r"state_dict_metadata\['edge'\]\.chunks\[0\]\.offsets",
        "expected a torch.Size",
    ),
    "first chunk sizes a list": (
        _setter(_chunk(0), "sizes", [2, 6]),
        _W + r"\.chunks\[0\]\.sizes",
        "expected a torch.Size",
    ),
    "first chunk offsets 1-d": (
        _setter(_chunk(0), "offsets", _S([0])),
        _W + r"\.chunks\[0\]\.offsets",
        "has 1 dimensions, expected 2",
    ),
    "first chunk sizes 3-d": (
        _setter(_chunk(0), "sizes", _S([2, 6, 1])),
        _W + r"\.chunks\[0\]\.sizes",
        "has 3 dimensions, expected 2",
    ),
    "first chunk offset negative in dim 1": (
        _setter(_chunk(0), "offsets", _S([0, -1])),
        _W + r"\.chunks\[0\]\.offsets",
        "negative entry -1",
    ),
    "first chunk size negative in dim 0": (
        _both(_setter(_chunk(0), "sizes", _S([-1, 6])), _setter(_chunk(0), "offsets", _S([1, 0]))),
        _W + r"\.chunks\[0\]\.sizes",
        "negative entry -1",
    ),
    # storage_data records
    "key a str": (
        _replace_key("w", "w"),
        r"storage_data",
        "key: expected a MetadataIndex, got str",
    ),
    "key fqn an int": (
        _replace_key("scalar", MetadataIndex(7, _S([]))),
        r"storage_data\[7\]\.key\.fqn",
        "expected a str",
    ),  # type: ignore[arg-type]
    "key offset a tuple": (
        _replace_key("scalar", _raw_index("scalar", (0,), None)),
        _SS + r"\.key\.offset",
        "expected a torch.Size",
    ),
    "key offset negative": (
        _replace_key("scalar", MetadataIndex("scalar", _S([0, -3]))),
        _SS + r"\.key\.offset",
        "negative entry -3",
    ),
    "key index negative": (
        _replace_key("scalar", MetadataIndex("scalar", _S([]), -1)),
        _SS + r"\.key\.index",
        "expected a non-negative int, got -1",
    ),
    "key index a str": (
        _replace_key("scalar", MetadataIndex("scalar", _S([]), "0")),
        _SS + r"\.key\.index",
        "non-negative int",
    ),  # type: ignore[arg-type]
    "key index a bool": (
        _replace_key("scalar", MetadataIndex("scalar", _S([]), True)),
        _SS + r"\.key\.index",
        "non-negative int",
    ),
    "key no fqn": (
        lambda md: _key(md, "scalar").__dict__.pop("fqn"),
        r"storage_data\['\?'\]\.fqn",
        "missing",
    ),
    "info a dict": (
        lambda md: md.storage_data.__setitem__(_key(md, "scalar"), {"relative_path": "x"}),
        _SS,
        "expected a _StorageInfo, got dict",
    ),
    "offset a str": (_setter(_RS, "offset", "0"), _SS + r"\.offset", "expected a non-negative int"),
    "offset negative": (
        _setter(_RS, "offset", -1),
        _SS + r"\.offset",
        "expected a non-negative int, got -1",
    ),
    "offset a float": (_setter(_RS, "offset", 1.0), _SS + r"\.offset", "non-negative int"),
    "length negative": (
        _setter(_RS, "length", -5),
        _SS + r"\.length",
        "expected a non-negative int, got -5",
    ),
    "length a bool": (_setter(_RS, "length", True), _SS + r"\.length", "non-negative int"),
    "no length": (_drop(_RS, "length"), _SS + r"\.length", "missing"),
    "no offset": (_drop(_RS, "offset"), _SS + r"\.offset", "missing"),
    "transform_descriptors a str": (
        _setter(_RS, "transform_descriptors", "zstd"),
        _SS + r"\.transform_descriptors",
        "expected a list of str",
    ),
    "transform_descriptors of ints": (
        _setter(_RS, "transform_descriptors", ["a", 1]),
        _SS + r"\.transform_descriptors",
        "expected a str, got int",
    ),
    "crc negative": (_setter(_RS, "refdcp_crc32c", -1), _SS + r"\.refdcp_crc32c", "32-bit"),
    "crc 2**32": (_setter(_RS, "refdcp_crc32c", 2**32), _SS + r"\.refdcp_crc32c", "32-bit"),
    "crc a str": (_setter(_RS, "refdcp_crc32c", "7"), _SS + r"\.refdcp_crc32c", "32-bit"),
    "crc a float": (_setter(_RS, "refdcp_crc32c", 7.0), _SS + r"\.refdcp_crc32c", "32-bit"),
    "data offset past the length": (
        _setter(_RS, "refdcp_data_offset", 81),
        _SS + r"\.refdcp_data_offset",
        "81 is past the item's length 80",
    ),
    "data offset negative": (
        _setter(_RS, "refdcp_data_offset", -1),
        _SS + r"\.refdcp_data_offset",
        "non-negative int",
    ),
    "data offset a str": (
        _setter(_RS, "refdcp_data_offset", "8"),
        _SS + r"\.refdcp_data_offset",
        "non-negative int",
    ),
    "crc on an item without data offset": (
        _setter(lambda md: _rec(md, "step"), "refdcp_crc32c", 2**32),
        r"storage_data\['step'\]\.refdcp_crc32c",
        "32-bit",
    ),
    # storage_meta
    "checkpoint_id an int": (
        _setter(lambda md: md.storage_meta, "checkpoint_id", 3),
        _SM + r"\.checkpoint_id",
        "expected a str or path, got int",
    ),
    "save_id an int": (
        _setter(lambda md: md.storage_meta, "save_id", 3),
        _SM + r"\.save_id",
        "expected a str",
    ),
    "load_id bytes": (
        _setter(lambda md: md.storage_meta, "load_id", b"x"),
        _SM + r"\.load_id",
        "expected a str",
    ),
    "modules a tuple": (
        _setter(lambda md: md.storage_meta, "modules", ("a",)),
        _SM + r"\.modules",
        "expected a list, got tuple",
    ),
    "modules holding an int": (
        _setter(lambda md: md.storage_meta, "modules", ["a", 1]),
        _SM + r"\.modules\[1\]",
        "expected a str",
    ),
    "no modules": (_drop(lambda md: md.storage_meta, "modules"), _SM + r"\.modules", "missing"),
    # any other field
    "planner data holding a function": (
        _setter(lambda md: md, "planner_data", {"a": [len]}),
        r"planner_data\['a'\]\[0\]",
        "unexpected type builtin_function_or_method",
    ),
    "planner data with an object key": (
        _setter(lambda md: md, "planner_data", {object(): 1}),
        r"planner_data\.<key>",
        "unexpected type object",
    ),
    "planner data: a DCP object with a bad field": (
        _setter(lambda md: md, "planner_data", [MetadataIndex("w", _S([1]), object())]),
        r"planner_data\[0\]\.index",
        "unexpected type object",
    ),
    "planner data: a bad object in a tuple": (
        _setter(lambda md: md, "planner_data", ((1, object()),)),
        r"planner_data\[0\]\[1\]",
        "unexpected type",
    ),
    "planner data: a bad object in a set": (
        _setter(lambda md: md, "planner_data", frozenset({(object(),)})),
        r"planner_data\[0\]\[0\]",
        "unexpected type",
    ),
    "an extra field holding a type": (
        _setter(lambda md: md, "extra", int),
        r"extra",
        "unexpected type type",
    ),
    # the walk goes on after a str, a path, a leaf and an object seen before (popped first)
    "planner data: a bad object before a str": (
        _setter(lambda md: md, "planner_data", [object(), "s"]),
        r"planner_data\[0\]",
        "unexpected type object",
    ),
    "planner data: a bad object before bytes": (
        _setter(lambda md: md, "planner_data", [object(), b"s"]),
        r"planner_data\[0\]",
        "unexpected type object",
    ),
    "planner data: a bad object before a path": (
        _setter(lambda md: md, "planner_data", [object(), pathlib.PurePosixPath("p")]),
        r"planner_data\[0\]",
        "unexpected type object",
    ),
    "planner data: a bad object before a leaf": (
        _setter(lambda md: md, "planner_data", [object(), torch.float32]),
        r"planner_data\[0\]",
        "unexpected type object",
    ),
    "planner data: a bad object before a shared list": (
        lambda md: setattr(md, "planner_data", _shared_after_bad()),
        r"planner_data\[0\]",
        "unexpected type object",
    ),
}


def _shared_after_bad() -> list[Any]:
    shared = [1]
    return [object(), shared, shared]


def _field_of(exc: BaseException) -> str:
    assert isinstance(exc, MalformedMetadataError)
    return exc.field


@pytest.mark.spec("FMT-9")
def test_another_backends_records_are_walked_for_allowed_types() -> None:
    md = valid_md()
    md.storage_data[_key(md, "scalar")] = {"path": "x", "bad": [object()]}
    with pytest.raises(MalformedMetadataError, match="unexpected type object") as err:
        _check(md, filesystem=False)
    assert err.value.field == "storage_data['scalar']['bad'][0]"


@pytest.mark.spec("FMT-9")
@pytest.mark.parametrize("case", sorted(_BAD))
def test_each_single_malformed_field_is_refused_and_named(case: str) -> None:
    mutate, field, message = _BAD[case]
    md = valid_md()
    mutate(md)
    for filesystem in (True, False):
        if case == "info a dict" and not filesystem:
            _check(md, filesystem=False)  # another backend's record of allowed types
            continue
        with pytest.raises(MalformedMetadataError) as err:
            _check(md, filesystem=filesystem)
        assert re.fullmatch(field, _field_of(err.value)), (err.value.field, field)
        assert re.search(message, str(err.value)), str(err.value)
        assert err.value.file == "ckpt/.metadata"
        assert str(err.value).startswith(err.value.field + ": ")


# -- data-file names (STORE-26) --------------------------------------------------------------


_BAD_NAMES = [
    "",
    ".",
    "..",
    "../x",
    "/abs/x",
    "a/b",
    "a\\b",
    "x\x00y",
    "n" * 256,
    "é" * 128,
    7,
    None,
]


@pytest.mark.spec("STORE-26")
@pytest.mark.parametrize("name", _BAD_NAMES, ids=[f"name{i}" for i in range(len(_BAD_NAMES))])
def test_a_data_file_name_that_is_not_plain_is_refused_naming_the_item(name: Any) -> None:
    md = valid_md()
    _rec(md, "scalar").relative_path = name
    with pytest.raises(
        UnsafePathError, match=r"ckpt/\.metadata: data-file name.*\(item 'scalar'\)"
    ):
        _check(md)


# -- limits (FMT-10) ------------------------------------------------------------------------


def _limited(n: int, **kw: int) -> MetadataLimits:
    return MetadataLimits(max_string_chars=n, **kw)


@pytest.mark.spec("FMT-10")
@pytest.mark.parametrize(
    "where",
    [
        "fqn",
        "version",
        "key fqn",
        "checkpoint_id",
        "module",
        "save_id",
        "planner str",
        "planner bytes",
        "planner path",
        "transform",
    ],
)
def test_strings_exactly_at_the_limit_pass_and_one_more_is_refused(where: str) -> None:
    n = 40

    def build(length: int) -> tuple[Metadata, str]:
        md = valid_md()
        s = "s" * length
        if where == "fqn":
            md.state_dict_metadata[s] = _tsm([2], [([0], [2])])
            return md, rf"state_dict_metadata\['{s}'\]"
        if where == "version":
            md.version = s
            return md, "version"
        if where == "key fqn":
            md.storage_data[MetadataIndex(s, _S([0]))] = _info("a.distcp", 0, 1, None, None)
            return md, rf"storage_data\['{s}'\]\.key\.fqn"
        if where == "checkpoint_id":
            md.storage_meta.checkpoint_id = Path(s)  # type: ignore[union-attr]
            return md, r"storage_meta\.checkpoint_id"
        if where == "module":
            md.storage_meta.modules = ["a", s]  # type: ignore[union-attr]
            return md, r"storage_meta\.modules\[1\]"
        if where == "save_id":
            md.storage_meta.save_id = s  # type: ignore[union-attr]
            return md, r"storage_meta\.save_id"
        if where == "planner str":
            md.planner_data = {"k": [s]}
            return md, r"planner_data\['k'\]\[0\]"
        if where == "planner bytes":
            md.planner_data = {"k": s.encode()}
            return md, r"planner_data\['k'\]"
        if where == "planner path":
            md.planner_data = {"k": pathlib.PurePosixPath(s)}
            return md, r"planner_data\['k'\]"
        _rec(md, "w").transform_descriptors = ["a", s]
        return md, r"storage_data\['w'\]\.transform_descriptors"

    md, _ = build(n)
    _check(md, _limited(n))
    _check(md, _limited(n), filesystem=False)
    md, field = build(n + 1)
    for filesystem in (True, False):
        with pytest.raises(MalformedMetadataError, match="over the limit") as err:
            _check(md, _limited(n), filesystem=filesystem)
        assert re.fullmatch(field, err.value.field), err.value.field


@pytest.mark.spec("FMT-10")
def test_a_long_fqn_is_refused_in_a_record_with_a_valid_entry() -> None:
    md = valid_md()
    s = "q" * 41
    md.storage_data[MetadataIndex(s, None)] = _info("a.distcp", 0, 1, None, None)
    with pytest.raises(MalformedMetadataError, match="41 characters is over the limit of 40"):
        _check(md, _limited(40))


@pytest.mark.spec("FMT-9")
@pytest.mark.parametrize("depth", [1, 2, 5])
def test_nesting_up_to_the_depth_limit_passes_and_deeper_is_refused(depth: int) -> None:
    def nested(levels: int) -> Any:
        value: Any = 1
        for i in range(levels):
            value = [value] if i % 2 else {"k": value}
        return value

    limits = MetadataLimits(max_depth=depth)
    md = valid_md()
    md.planner_data = nested(depth)
    _check(md, limits)
    md.planner_data = nested(depth + 1)
    with pytest.raises(MalformedMetadataError, match=f"nested deeper than {depth} levels"):
        _check(md, limits)


@pytest.mark.spec("FMT-9")
def test_dcp_objects_in_other_fields_count_towards_the_depth() -> None:
    """A TensorStorageMetadata as planner data: its chunk list at depth 1, a chunk at 2."""
    md = valid_md()
    md.planner_data = _tsm([4], [([0], [4])])
    _check(md, MetadataLimits(max_depth=3))
    with pytest.raises(MalformedMetadataError, match="nested deeper than 2 levels") as err:
        _check(md, MetadataLimits(max_depth=2))
    assert err.value.field == "planner_data.chunks[0]"


@pytest.mark.spec("FMT-9")
def test_a_tuple_used_as_a_dict_key_counts_towards_the_depth() -> None:
    md = valid_md()
    md.planner_data = {(1, "a"): 0}
    _check(md, MetadataLimits(max_depth=2))
    with pytest.raises(MalformedMetadataError, match="nested deeper than 1 levels") as err:
        _check(md, MetadataLimits(max_depth=1))
    assert err.value.field == "planner_data.<key>"


@pytest.mark.spec("FMT-9")
def test_a_cycle_is_walked_once_even_at_a_small_depth_limit() -> None:
    md = valid_md()
    a: list[Any] = []
    a.append(a)
    md.planner_data = a
    _check(md, MetadataLimits(max_depth=2))


# -- a property: random valid tensors pass, one corrupted chunk is named --------------------


@st.composite
def _tensor_entry(draw: st.DrawFn) -> tuple[list[int], list[tuple[list[int], list[int]]]]:
    ndim = draw(st.integers(0, 3))
    size = [draw(st.integers(0, 5)) for _ in range(ndim)]
    chunks = []
    for _ in range(draw(st.integers(0, 3))):
        offs, sizes = [], []
        for full in size:
            o = draw(st.integers(0, full))
            offs.append(o)
            sizes.append(draw(st.integers(0, full - o)))
        chunks.append((offs, sizes))
    return size, chunks


@pytest.mark.spec("FMT-9")
@settings(max_examples=60, deadline=None)
@given(
    entry=_tensor_entry(),
    which=st.integers(0, 2),
    dim=st.integers(0, 2),
    how=st.sampled_from(["past", "negative offset", "negative size"]),
)
def test_random_chunks_inside_the_tensor_pass_and_one_moved_outside_is_named(
    entry: tuple[list[int], list[tuple[list[int], list[int]]]], which: int, dim: int, how: str
) -> None:
    size, chunks = entry
    md = valid_md()
    md.state_dict_metadata["t"] = _tsm(size, chunks)
    md.storage_data[MetadataIndex("t", _S([0] * len(size)))] = _info(
        "__0_0.0123456789ab.distcp", 0, 8, 3, 8
    )
    _check(md)
    if not chunks or not size:
        return
    i, d = which % len(chunks), dim % len(size)
    offs, sizes = (list(x) for x in chunks[i])
    if how == "past":
        sizes[d] = size[d] - offs[d] + 1
    elif how == "negative offset":
        offs[d] = -1
    else:
        sizes[d] = -1
    chunk = md.state_dict_metadata["t"].chunks[i]  # type: ignore[union-attr]
    chunk.offsets, chunk.sizes = _S(offs), _S(sizes)
    with pytest.raises(MalformedMetadataError) as err:
        _check(md)
    assert err.value.field.startswith(f"state_dict_metadata['t'].chunks[{i}]")


@pytest.mark.spec("FMT-9")
@pytest.mark.parametrize("where", ["first", "later"])
def test_a_long_string_inside_a_planner_data_tuple_is_refused_wherever_it_sits(where: str) -> None:
    """The quick pass over planner_data's ``{str: (str | int, ...)}`` entries must hand a tuple
    with an over-long string to the detailed check, and must go on to the entries after a
    well-formed one."""
    cap = LIMITS.max_string_chars
    md = valid_md()
    bad = ("ok", "x" * (cap + 1))
    md.planner_data = (
        {"a": bad, "b": ("fine", 1)} if where == "first" else {"a": ("fine", 1), "b": bad}
    )
    with pytest.raises(MalformedMetadataError):
        _check(md)
