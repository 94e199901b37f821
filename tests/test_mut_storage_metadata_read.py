"""Reading ``.metadata``: the bounded read and the build of DCP objects (issue 28).

``read_metadata_file_stat`` never reads past the cap plus one byte, however
the kernel splits the reads, and closes its descriptor whatever happens
(FMT-10). The restricted unpickler builds a DCP object from every form of
``BUILD`` state ``pickle`` accepts (a dict, or a ``(dict or None, slots)``
pair) exactly as ``pickle`` does (FMT-6).
"""

from __future__ import annotations

import os
import pickle
import struct
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from refdcp.crc.kernel import crc32c
from refdcp.storage.errors import CorruptionError, UnsafeMetadataError
from refdcp.storage.fs.metadata_file import read_metadata_file, read_metadata_file_stat
from refdcp.storage.metadata.limits import MetadataLimits
from refdcp.storage.metadata.safe import has_checksum_trailer, load_metadata, safe_loads


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.spec("FMT-10")
@pytest.mark.parametrize("piece", [1, 7, 60, 100, 101, 4096])
def test_the_read_stops_at_the_cap_plus_one_byte_whatever_the_read_sizes(
    monkeypatch: pytest.MonkeyPatch, piece: int
) -> None:
    """procfs reports size 0 for a file with content: only the read itself can stop at
    the cap. Each ``os.read`` here returns at most ``piece`` bytes."""
    real = os.read
    got: list[int] = []

    def short_reads(fd: int, n: int) -> bytes:
        data = real(fd, min(n, piece))
        got.append(len(data))
        return data

    monkeypatch.setattr(os, "read", short_reads)
    with pytest.raises(UnsafeMetadataError, match="grew past the metadata size limit of 100"):
        read_metadata_file("/proc/self/status", MetadataLimits(max_file_bytes=100))
    assert sum(got) == 101
    got.clear()
    data = read_metadata_file("/proc/self/status", MetadataLimits(max_file_bytes=1 << 20))
    assert data.startswith(b"Name:") and sum(got) == len(data)


@pytest.mark.spec("FMT-10")
def test_reading_metadata_closes_its_descriptor_whatever_the_outcome(tmp_path: Path) -> None:
    (tmp_path / "m").write_bytes(b"x" * 50)
    os.mkfifo(tmp_path / "fifo")
    before = _open_fds()
    for _ in range(3):
        data, st_ = read_metadata_file_stat(tmp_path / "m", MetadataLimits(max_file_bytes=100))
        assert data == b"x" * 50 and st_.st_size == 50
        with pytest.raises(UnsafeMetadataError, match="over the metadata size limit"):
            read_metadata_file_stat(tmp_path / "m", MetadataLimits(max_file_bytes=10))
        with pytest.raises(UnsafeMetadataError, match="grew past"):
            read_metadata_file_stat("/proc/self/status", MetadataLimits(max_file_bytes=10))
        with pytest.raises(UnsafeMetadataError, match="not a regular file"):
            read_metadata_file_stat(tmp_path / "fifo")
    assert _open_fds() == before


# -- BUILD states -------------------------------------------------------------------------

_MOD = b"torch.distributed.checkpoint.metadata"


def _str(s: str) -> bytes:
    raw = s.encode()
    return b"X" + struct.pack("<I", len(raw)) + raw


def _value(v: str | int | None) -> bytes:
    if v is None:
        return b"N"
    if isinstance(v, int):
        return b"J" + struct.pack("<i", v)
    return _str(v)


def _dict(items: dict[str, Any] | None) -> bytes:
    if items is None:
        return b"N"
    return b"}(" + b"".join(_str(k) + _value(v) for k, v in items.items()) + b"u"


def _built(cls: str, state: bytes) -> bytes:
    """``cls.__new__(cls)`` then ``BUILD`` with the pickled ``state``."""
    return b"\x80\x04c" + _MOD + b"\n" + cls.encode() + b"\n)\x81" + state + b"b."


_FIELDS = {
    "StorageMeta": {
        "checkpoint_id": st.none() | st.text(max_size=8),
        "save_id": st.text(max_size=8),
        "load_id": st.text(max_size=8),
    },
    "MetadataIndex": {
        "fqn": st.text(max_size=8),
        "offset": st.none(),
        "index": st.none() | st.integers(-(2**31), 2**31 - 1),
    },
}


@st.composite
def _states(draw: st.DrawFn) -> tuple[str, bytes]:
    cls = draw(st.sampled_from(sorted(_FIELDS)))
    names = draw(st.lists(st.sampled_from(sorted(_FIELDS[cls])), unique=True))
    values = {n: draw(_FIELDS[cls][n]) for n in names}
    # slot state is set with setattr, which a frozen dataclass (MetadataIndex) refuses
    slotted = names if cls == "StorageMeta" else []
    in_slots = draw(st.sets(st.sampled_from(slotted))) if slotted else set()
    plain = {n: v for n, v in values.items() if n not in in_slots}
    slots = {n: v for n, v in values.items() if n in in_slots}
    form = draw(st.sampled_from(["dict", "pair"]))
    if form == "dict":
        return cls, _dict(plain)
    first = None if not plain and draw(st.booleans()) else plain
    return cls, _dict(first) + _dict(slots) + b"\x86"


@pytest.mark.spec("FMT-6")
@settings(max_examples=80)
@given(_states())
def test_dcp_objects_are_built_from_every_form_of_state_as_pickle_builds_them(
    case: tuple[str, bytes],
) -> None:
    cls, state = case
    raw = _built(cls, state)
    expected = pickle.loads(raw)
    got = safe_loads(raw)
    assert type(got) is type(expected)
    assert vars(got) == vars(expected)


def _tuple_state_bomb(keys: int, objects: int, slots: bool) -> bytes:
    """One memoized state dict of ``keys`` entries given, as the dict or the slots part of a
    ``(dict, slots)`` pair, to ``objects`` StorageMeta objects."""
    out = bytearray(b"\x80\x04c" + _MOD + b"\nStorageMeta\nq\x00")
    out += b"}(" + b"".join(_str(f"k{k}") + b"K\x01" for k in range(keys)) + b"uq\x01]("
    pair = b"Nh\x01\x86" if slots else b"h\x01}\x86"
    for _ in range(objects):
        out += b"h\x00)\x81" + pair + b"b"
    return bytes(out + b"e.")


@pytest.mark.spec("FMT-11")
@pytest.mark.parametrize("slots", [False, True], ids=["dict-part", "slots-part"])
def test_a_memoized_pair_state_is_charged_like_a_dict_state(slots: bool) -> None:
    limits = MetadataLimits(slack_units=1)
    small = safe_loads(_tuple_state_bomb(2, 3, slots), limits)
    assert len(small) == 3 and all(vars(o)["k1"] == 1 for o in small)
    big = _tuple_state_bomb(200, 200, slots)  # 40,000 units from about 3 kB
    with pytest.raises(UnsafeMetadataError, match="memory bomb") as err:
        safe_loads(big, limits)
    assert "StorageMeta" in str(err.value)


_NOT_A_PICKLE = {
    "cut short": b"\x80\x04K\x01",
    "an unknown opcode": b"\x80\x04\xff.",
    "empty": b"",
}


@pytest.mark.spec("INTEG-2", "FMT-5")
@pytest.mark.parametrize("case", sorted(_NOT_A_PICKLE))
@pytest.mark.parametrize("trailer", [False, True], ids=["torch", "refdcp"])
def test_a_metadata_that_does_not_unpickle_is_corrupt_at_offset_0(case: str, trailer: bool) -> None:
    """With or without refdcp's trailer (its CRC matching the bad pickle): CorruptionError
    naming the file at offset 0, not an unpickling error."""
    body = _NOT_A_PICKLE[case]
    data = body + b"#refdcp-crc32c:%08x\n" % crc32c(body) if trailer else body
    with pytest.raises(CorruptionError, match="does not unpickle") as info:
        load_metadata(data, file="ckpt/.metadata")
    err = info.value
    assert (err.fqn, err.file, err.offset) == (None, "ckpt/.metadata", 0)


def _path_bomb(chars: int, paths: int) -> bytes:
    """One memoized string of ``chars`` characters made into ``paths`` PosixPath objects."""
    out = bytearray(b"\x80\x04cpathlib\nPosixPath\nq\x00" + _str("p" * chars) + b"q\x01](")
    for _ in range(paths):
        out += b"h\x00(h\x01tR"
    return bytes(out + b"e.")


@pytest.mark.spec("FMT-11")
def test_paths_built_from_one_memoized_string_are_charged_their_length() -> None:
    limits = MetadataLimits(slack_units=1)
    one = safe_loads(_path_bomb(1000, 1), limits)  # 1,001 units: within the file's size
    assert [str(p) for p in one] == ["p" * 1000]
    with pytest.raises(UnsafeMetadataError, match="memory bomb") as err:
        safe_loads(_path_bomb(1000, 300), limits)  # about 300,000 units from about 3 kB
    assert "PosixPath" in str(err.value)


@pytest.mark.spec("INTEG-2")
@pytest.mark.parametrize("body_len", [0, 1, 23, 24, 25, 47, 48, 100])
def test_the_trailer_is_found_after_a_body_of_any_length(body_len: int) -> None:
    body = bytes(range(body_len))
    data = body + b"#refdcp-crc32c:%08x\n" % crc32c(body)
    assert has_checksum_trailer(data)
    assert not has_checksum_trailer(body + b"#refdcp-crc32c:%08x" % crc32c(body))


@pytest.mark.spec("FMT-6")
@pytest.mark.parametrize("keys", [1, 5])
def test_a_tensor_properties_given_a_dict_state_is_refused_as_pickle_refuses_it(
    keys: int,
) -> None:
    """TensorProperties has its own __setstate__ (a 5-tuple): a dict state is never
    written into the object directly."""
    names = ["dtype", "layout", "requires_grad", "memory_format", "pin_memory"][:keys]
    raw = _built("TensorProperties", _dict(dict.fromkeys(names, 1)))
    with pytest.raises(Exception) as expected:
        pickle.loads(raw)
    with pytest.raises(type(expected.value)):
        safe_loads(raw)


def _spent_then_tensor_properties(keys: int, objects: int) -> bytes:
    """``objects`` StorageMeta built from one memoized dict of ``keys`` entries (charged
    ``keys`` each), then a TensorProperties given the state ``5`` (charged 1; its own
    __setstate__ then refuses it with TypeError)."""
    out = bytearray(b"\x80\x04c" + _MOD + b"\nStorageMeta\nq\x00")
    out += b"}(" + b"".join(_str(f"k{k}") + b"K\x01" for k in range(keys)) + b"uq\x01]("
    out += b"h\x00)\x81h\x01b" * objects
    out += b"c" + _MOD + b"\nTensorProperties\n)\x81K\x05b"
    return bytes(out + b"e.")


@pytest.mark.spec("FMT-11")
def test_a_state_given_to_a_class_with_its_own_setstate_is_charged_one_unit() -> None:
    """Budget = file size + slack; charges = objects * keys + 1. With the budget exactly
    equal to the charges nothing is refused for size (TensorProperties' own __setstate__
    then refuses the state); one unit less and the build is refused as a memory bomb."""
    raw = _spent_then_tensor_properties(keys=50, objects=40)
    charges = 50 * 40 + 1
    slack = charges - len(raw)
    assert slack > 0
    with pytest.raises(TypeError):
        safe_loads(raw, MetadataLimits(slack_units=slack))
    with pytest.raises(
        UnsafeMetadataError, match=r"\(TensorProperties\); refusing it as a memory bomb"
    ):
        safe_loads(raw, MetadataLimits(slack_units=slack - 1))
