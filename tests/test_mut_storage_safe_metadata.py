"""Reading and writing ``.metadata`` safely (FMT-1, FMT-6, FMT-7, FMT-10, FMT-11, INTEG-2; issue 13).

Hand-made pickles probe the restricted unpickler: every allowed constructor
works at its limits and refuses just past them or with odd arguments; the
trailer and format checks refuse exactly the files they must.
"""

from __future__ import annotations

import os
import pathlib
import pickle
import struct
from collections import OrderedDict
from pathlib import Path
from typing import Any

import crc32c
import pytest
import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, StorageMeta

from refdcp.storage.errors import (
    CorruptionError,
    FormatVersionError,
    MalformedMetadataError,
    UnsafeMetadataError,
)
from refdcp.storage.fs.metadata_file import read_metadata_file
from refdcp.storage.metadata.limits import MetadataLimits
from refdcp.storage.metadata.safe import (
    DCP_VERSION,
    FORMAT_ATTR,
    REFDCP_FORMAT,
    TRAILER_PREFIX,
    dump_metadata,
    has_checksum_trailer,
    load_metadata,
    safe_loads,
)


def _md(planner_data: Any = None) -> Metadata:
    return Metadata({"s": BytesStorageMetadata()}, planner_data=planner_data, storage_data={})


def _global(module: str, name: str) -> bytes:
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def _str(s: str) -> bytes:
    raw = s.encode()
    return b"X" + struct.pack("<I", len(raw)) + raw


def _call(module: str, name: str, *args: bytes) -> bytes:
    """A pickle that calls ``module.name(*args)`` (each arg already pickled) and stops."""
    return b"\x80\x04" + _global(module, name) + b"(" + b"".join(args) + b"tR."


@pytest.mark.spec("FMT-1", "INTEG-2")
def test_dump_writes_a_pickle_torch_reads_plus_the_trailer() -> None:
    md = _md()
    md.version = DCP_VERSION
    data = dump_metadata(md)
    body, trailer = data.split(TRAILER_PREFIX)
    assert trailer == b"%08x\n" % crc32c.crc32c(body)
    plain = pickle.loads(data)  # torch's reader: stops at the pickle's STOP
    assert getattr(plain, FORMAT_ATTR) == REFDCP_FORMAT == 1
    assert has_checksum_trailer(data) and not has_checksum_trailer(body)
    back = load_metadata(data)
    assert getattr(back, FORMAT_ATTR) == 1 and back.version == DCP_VERSION


@pytest.mark.spec("INTEG-2", "FMT-7")
def test_a_refdcp_metadata_without_its_trailer_is_corrupt_but_a_torch_one_loads() -> None:
    md = _md()
    data = dump_metadata(md)
    body = data[: data.index(TRAILER_PREFIX)]
    with pytest.raises(CorruptionError, match="lacks its checksum trailer"):
        load_metadata(body)
    torch_md = _md()
    torch_body = pickle.dumps(torch_md)  # no refdcp_format: torch's
    assert load_metadata(torch_body).state_dict_metadata.keys() == {"s"}
    with pytest.raises(CorruptionError, match="metadata checksum mismatch"):
        load_metadata(body + TRAILER_PREFIX + b"%08x\n" % (crc32c.crc32c(body) ^ 1))


@pytest.mark.spec("FMT-7")
@pytest.mark.parametrize("fmt", [0, 2, "1"])
def test_other_refdcp_formats_are_refused(fmt: Any) -> None:
    md = _md()
    data = dump_metadata(md)
    setattr(md, FORMAT_ATTR, fmt)
    body = pickle.dumps(md)
    with pytest.raises(FormatVersionError, match="refdcp format"):
        load_metadata(body + TRAILER_PREFIX + b"%08x\n" % crc32c.crc32c(body), file="f")
    assert data  # the valid form loads (checked above)


@pytest.mark.spec("FMT-7")
@pytest.mark.parametrize("version", ["0.9", "2.0.0"])
def test_other_dcp_versions_are_refused(version: str) -> None:
    md = _md()
    md.version = version
    with pytest.raises(FormatVersionError, match=f"DCP metadata version '{version}'"):
        load_metadata(dump_metadata(md))


@pytest.mark.spec("FMT-6")
def test_a_pickle_that_is_not_a_metadata_is_malformed() -> None:
    with pytest.raises(MalformedMetadataError, match="holds a list, not a Metadata"):
        load_metadata(pickle.dumps([1, 2]))


@pytest.mark.spec("FMT-10")
def test_a_file_over_the_size_limit_is_refused_before_parsing() -> None:
    data = dump_metadata(_md())
    limits = MetadataLimits(max_file_bytes=len(data))
    assert load_metadata(data, limits=limits).state_dict_metadata
    with pytest.raises(UnsafeMetadataError, match="over the metadata size limit"):
        load_metadata(data, limits=MetadataLimits(max_file_bytes=len(data) - 1))


# -- allowed constructors at their limits (FMT-6, FMT-11) --------------------------------


@pytest.mark.spec("FMT-11")
@pytest.mark.parametrize("cls", ["PosixPath", "PurePosixPath", "Path"])
def test_paths_up_to_the_string_limit_are_built_and_longer_ones_refused(cls: str) -> None:
    limits = MetadataLimits(max_string_chars=20)
    ok = _call("pathlib", cls, _str("a" * 9), _str("b" * 9))  # 2 * (9 + 1) = 20
    assert str(safe_loads(ok, limits)) == "a" * 9 + "/" + "b" * 9
    one = _call("pathlib", cls, _str("c" * 19))  # 19 + 1 = 20
    assert str(safe_loads(one, limits)) == "c" * 19
    with pytest.raises(UnsafeMetadataError, match="builds a path of 21 characters"):
        safe_loads(_call("pathlib", cls, _str("c" * 20)), limits)
    with pytest.raises(UnsafeMetadataError, match="from a non-string"):
        safe_loads(_call("pathlib", cls, b"K\x05"), limits)


@pytest.mark.spec("FMT-11", "FMT-6")
@pytest.mark.parametrize("cls", ["set", "frozenset"])
def test_sets_are_built_from_one_sequence_only(cls: str) -> None:
    built = safe_loads(_call("builtins", cls, b"](K\x01K\x02e"))
    assert built == {1, 2} and type(built).__name__ == cls
    assert safe_loads(_call("builtins", cls)) == set()
    assert safe_loads(_call("builtins", cls, b")")) == set()  # from an empty tuple
    for odd in (b"K\x05", _str("ab"), b"](K\x01e](K\x02e"):
        with pytest.raises(UnsafeMetadataError, match=f"calls {cls} with odd arguments"):
            safe_loads(_call("builtins", cls, odd))


@pytest.mark.spec("FMT-6")
def test_ordered_dicts_and_complex_numbers_are_allowed() -> None:
    od = safe_loads(pickle.dumps(OrderedDict([("a", 1), ("b", 2)])))
    assert od == OrderedDict([("a", 1), ("b", 2)]) and list(od) == ["a", "b"]
    assert safe_loads(pickle.dumps(complex(1, -2))) == complex(1, -2)
    assert safe_loads(pickle.dumps(torch.float16)) is torch.float16
    with pytest.raises(UnsafeMetadataError, match="calls OrderedDict with odd arguments"):
        safe_loads(_call("collections", "OrderedDict", b"K\x01"))


@pytest.mark.spec("FMT-11")
def test_torch_sizes_up_to_the_dimension_limit() -> None:
    limits = MetadataLimits(max_dims=4)
    assert safe_loads(pickle.dumps(torch.Size([1, 2, 3, 4])), limits) == torch.Size([1, 2, 3, 4])
    assert safe_loads(pickle.dumps(torch.Size([])), limits) == torch.Size([])
    with pytest.raises(UnsafeMetadataError, match="more than 4 dimensions"):
        safe_loads(pickle.dumps(torch.Size([1, 2, 3, 4, 5])), limits)
    with pytest.raises(UnsafeMetadataError, match="of a non-sequence"):
        safe_loads(_call("torch", "Size", b"K\x03"), limits)


@pytest.mark.spec("FMT-6")
@pytest.mark.parametrize(
    ("module", "name"),
    [
        ("os", "system"),
        ("builtins", "eval"),
        ("torch", "load"),
        ("torch", "nn"),
        ("pathlib", "Path2"),
        ("collections", "defaultdict"),
        ("torch.distributed.checkpoint.metadata", "Other"),
    ],
)
def test_every_other_global_is_refused(module: str, name: str) -> None:
    with pytest.raises(UnsafeMetadataError, match=f"references {module}.{name}, which is not"):
        safe_loads(b"\x80\x04" + _global(module, name) + b".")


@pytest.mark.spec("FMT-6")
def test_persistent_ids_are_refused() -> None:
    with pytest.raises(UnsafeMetadataError, match="persistent ids"):
        safe_loads(b"\x80\x04" + _str("x") + b"Q.")


@pytest.mark.spec("FMT-11")
def test_dcp_objects_with_a_malformed_state_are_refused() -> None:
    dcp_mod = "torch.distributed.checkpoint.metadata"
    new = b"\x80\x04" + _global(dcp_mod, "StorageMeta") + b")\x81"
    with pytest.raises(UnsafeMetadataError, match="gives a StorageMeta a malformed state"):
        safe_loads(new + b"N}K\x01K\x02s\x86b.")  # slots with an int key
    with pytest.raises(UnsafeMetadataError, match="malformed state"):
        safe_loads(new + b"K\x05b.")  # not a dict
    slots = safe_loads(new + b"N}" + _str("save_id") + _str("s1") + b"s\x86b.")
    assert type(slots) is StorageMeta and slots.save_id == "s1"


@pytest.mark.spec("FMT-11")
def test_building_past_the_budget_is_refused_for_every_kind_of_state() -> None:
    """One memoized state dict given to many objects: refused once over file size + slack."""
    limits = MetadataLimits(slack_units=1)

    def bomb(cls: str, keys: int, objects: int) -> bytes:
        out = bytearray(b"\x80\x04")
        out += _global("torch.distributed.checkpoint.metadata", cls) + b"q\x00"
        out += b"}("
        for k in range(keys):
            out += _str(f"k{k}") + b"K\x01"
        out += b"uq\x01]("
        for _ in range(objects):
            out += b"h\x00)\x81h\x01b"
        out += b"e."
        return bytes(out)

    for cls in ("BytesStorageMetadata", "ChunkStorageMetadata", "StorageMeta", "MetadataIndex"):
        small = bomb(cls, 2, 3)
        assert len(safe_loads(small, limits)) == 3
        big = bomb(cls, 200, 200)  # 40,000 units from ~3 kB
        with pytest.raises(UnsafeMetadataError, match="memory bomb") as err:
            safe_loads(big, limits)
        assert cls in str(err.value)


@pytest.mark.spec("FMT-6")
def test_pathlib_paths_of_a_real_metadata_round_trip() -> None:
    md = _md()
    md.storage_meta = StorageMeta(pathlib.Path("/ckpt/run/step-1"), "id", "load")
    back = load_metadata(dump_metadata(md))
    assert back.storage_meta is not None
    assert back.storage_meta.checkpoint_id == pathlib.Path("/ckpt/run/step-1")


def _memo_sizes(dims: int, count: int) -> bytes:
    """``count`` torch.Size objects built from one memoized ``dims``-tuple."""
    out = bytearray(b"\x80\x04" + _global("torch", "Size") + b"q\x00(")
    out += b"K\x01" * dims + b"tq\x01]("
    out += b"h\x00h\x01\x85R" * count
    return bytes(out + b"e.")


def _memo_builds(keys: int, count: int) -> bytes:
    """``count`` BytesStorageMetadata objects each BUILD with one memoized ``keys``-entry dict."""
    out = bytearray(b"\x80\x04")
    out += _global("torch.distributed.checkpoint.metadata", "BytesStorageMetadata") + b"q\x00}("
    for k in range(keys):
        out += _str(f"k{k}") + b"K\x01"
    out += b"uq\x01]("
    out += b"h\x00)\x81h\x01b" * count
    return bytes(out + b"e.")


@pytest.mark.spec("FMT-11")
@pytest.mark.parametrize("kind", ["sizes", "builds"])
def test_the_budget_is_the_file_size_plus_slack_exactly(kind: str) -> None:
    """Charges of exactly file size + slack pass; one unit more is refused."""
    per, count = 50, 200
    data = _memo_sizes(per, count) if kind == "sizes" else _memo_builds(per, count)
    slack = per * count - len(data)
    assert slack > 0
    assert len(safe_loads(data, MetadataLimits(slack_units=slack))) == count
    with pytest.raises(UnsafeMetadataError, match="memory bomb"):
        safe_loads(data, MetadataLimits(slack_units=slack - 1))


@pytest.mark.spec("FMT-11")
def test_a_state_with_some_non_str_keys_is_refused() -> None:
    new = b"\x80\x04" + _global("torch.distributed.checkpoint.metadata", "StorageMeta") + b")\x81"
    mixed = b"N}(" + _str("save_id") + _str("s") + b"K\x01K\x02u\x86b."
    with pytest.raises(UnsafeMetadataError, match="gives a StorageMeta a malformed state"):
        safe_loads(new + mixed)


def _memo_calls(parts: list[tuple[str, str, bytes, int]]) -> bytes:
    """A list of calls: for each (module, name, pickled argument tuple, count), ``count``
    calls of that global with one memoized argument tuple."""
    out = bytearray(b"\x80\x04")
    memo = 0
    refs = []
    for module, name, args, count in parts:
        out += _global(module, name) + b"q" + bytes([memo])
        out += args + b"q" + bytes([memo + 1])
        refs.append((memo, memo + 1, count))
        memo += 2
    out += b"]("
    for f, a, count in refs:
        out += (b"h" + bytes([f]) + b"h" + bytes([a]) + b"R") * count
    return bytes(out + b"e.")


@pytest.mark.spec("FMT-11")
@pytest.mark.parametrize("cls", ["set", "frozenset"])
def test_sets_are_charged_their_size_and_empty_ones_nothing(cls: str) -> None:
    per, count = 40, 100
    one_list = b"(](" + b"K\x01" * per + b"e\x85"  # the argument tuple ([1]*per,)
    data = _memo_calls(
        [("builtins", cls, one_list, count), ("builtins", cls, b")", 50)]  # 50 empty sets
    )
    slack = per * count - len(data)
    assert slack > 0
    assert len(safe_loads(data, MetadataLimits(slack_units=slack))) == count + 50
    with pytest.raises(
        UnsafeMetadataError, match=f"allows \\({cls}\\); refusing it as a memory bomb"
    ):
        safe_loads(data, MetadataLimits(slack_units=slack - 1))


@pytest.mark.spec("FMT-10")
def test_a_file_whose_size_fstat_understates_is_still_capped(tmp_path: Path) -> None:
    """procfs files report size 0 but have content: the read itself stops at the cap."""
    with pytest.raises(UnsafeMetadataError, match="grew past the metadata size limit of 100"):
        read_metadata_file("/proc/self/status", MetadataLimits(max_file_bytes=100))
    data = read_metadata_file("/proc/self/status", MetadataLimits(max_file_bytes=1 << 20))
    assert data.startswith(b"Name:")


@pytest.mark.spec("FMT-10")
def test_a_fifo_named_metadata_is_refused_without_blocking(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / ".metadata")
    with pytest.raises(UnsafeMetadataError, match="is not a regular file"):
        read_metadata_file(tmp_path / ".metadata")
    (tmp_path / "d").mkdir()
    with pytest.raises(UnsafeMetadataError, match="is not a regular file"):
        read_metadata_file(tmp_path / "d")


@pytest.mark.spec("FMT-10")
def test_a_file_of_exactly_the_cap_is_read_and_one_byte_more_refused(tmp_path: Path) -> None:
    (tmp_path / "m").write_bytes(b"x" * 100)
    assert read_metadata_file(tmp_path / "m", MetadataLimits(max_file_bytes=100)) == b"x" * 100
    with pytest.raises(UnsafeMetadataError, match="101 bytes is over the metadata size limit"):
        (tmp_path / "m").write_bytes(b"x" * 101)
        read_metadata_file(tmp_path / "m", MetadataLimits(max_file_bytes=100))
