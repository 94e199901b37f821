"""Storage behaviours the seed-1 mutation sample found unchecked (issue 13).

Each test pins one observable behaviour of the filesystem storage, the in-place
reader, item encoding, metadata loading or ``verify_checkpoint`` that a wrong
program could otherwise change without any test failing.
"""

from __future__ import annotations

import io
import os
import pickle
import struct
import warnings
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata
from torch.distributed.checkpoint.planner import SavePlan

import refdcp
from refdcp.planning import DefaultLoadPlanner
from refdcp.storage import FileSystemReader, FileSystemWriter
from refdcp.storage.format.items import INPLACE_MIN_BYTES, encode_tensor
from refdcp.storage.fs.inplace import locate_tensor_data
from refdcp.storage.metadata.safe import dump_metadata, load_metadata
from refdcp.storage.verify import verify_checkpoint, verify_ranges

SINGLE_PATH = "mutation-kill tests pinning one module of the default path (tests/MUTATION.md); the behaviour runs on both in the shared suites"

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _saved(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


# -- the writer: every item's stored range holds exactly its bytes ------------------------


@pytest.mark.spec("STORE-50", "INTEG-1")
def test_empty_tensors_take_their_whole_range_and_items_never_overlap(tmp_path: Path) -> None:
    """An empty tensor's archive has an empty data member between its head and its tail;
    the tail is still written, so the next item starts after it (gaps are zero bytes)."""
    big = torch.arange(INPLACE_MIN_BYTES // 4 + 5, dtype=torch.float32)  # framed, >= 1 MiB
    sd = {
        "e": torch.zeros(0),
        "big": big,
        "q": torch.zeros(3, 0, 4, dtype=torch.int16),
        "x": torch.arange(10.0),
    }
    refdcp.save(sd, checkpoint_id=tmp_path)
    md = FileSystemReader(tmp_path).read_metadata()
    assert md.storage_data is not None
    by_file: dict[str, list[tuple[int, int, str]]] = {}
    for index, info in md.storage_data.items():
        by_file.setdefault(info.relative_path, []).append((info.offset, info.length, index.fqn))
    for name, ranges in by_file.items():
        data = (tmp_path / name).read_bytes()
        end = 0
        for offset, length, fqn in sorted(ranges):
            assert offset >= end, f"{fqn} overlaps the item before it in {name}"
            assert data[end:offset] == bytes(offset - end)  # the gap belongs to no item
            item = torch.load(io.BytesIO(data[offset : offset + length]), weights_only=True)
            assert torch.equal(item, sd[fqn]), fqn
            end = offset + length
        assert end == len(data)
    report = verify_checkpoint(tmp_path)
    assert report.ok and report.items_checked == len(sd)


# -- the writer's lock: a reused writer frees the lock of its earlier, abandoned save -------


@pytest.mark.spec("STORE-29")
def test_a_reused_writer_frees_the_lock_of_its_abandoned_save(tmp_path: Path) -> None:
    writer = FileSystemWriter(tmp_path)
    writer.set_up_storage_writer(True)
    writer.prepare_local_plan(SavePlan([]))  # the coordinator takes the directory's lock
    assert (tmp_path / ".metadata.lock").exists()
    # that save is abandoned (e.g. its planner raised: torch's dcp.save calls no abort) and
    # the writer is set up for the next save, now as another rank: the old save is over
    writer.set_up_storage_writer(False, rank=1)
    assert not (tmp_path / ".metadata.lock").exists()
    refdcp.save({"w": torch.ones(3)}, checkpoint_id=tmp_path)  # not a ConcurrentSaveError
    out = {"w": torch.zeros(3)}
    refdcp.load(out, checkpoint_id=tmp_path)
    assert torch.equal(out["w"], torch.ones(3))


# -- the reader: a destination of another shape is refused, not filled ---------------------


@pytest.mark.spec("STORE-12", "STORE-11")
@pytest.mark.parametrize("verify", [None, False])
def test_a_whole_chunk_read_into_a_destination_of_another_shape_is_refused(
    tmp_path: Path, verify: bool | None
) -> None:
    """Same dtype and number of elements but another shape: the in-place read (STORE-11)
    does not apply and the size check of STORE-12 refuses the destination."""
    n = INPLACE_MIN_BYTES // 4  # a large item: read by the whole-chunk path
    refdcp.save({"w": torch.arange(n, dtype=torch.float32)}, checkpoint_id=tmp_path)

    class Reshaping(DefaultLoadPlanner):
        def resolve_tensor(self, read_item: Any) -> torch.Tensor:
            return super().resolve_tensor(read_item).view(n // 64, 64)

    dest = torch.zeros(n, dtype=torch.float32)
    with pytest.raises(BaseException, match=r"destination size \(4096, 64\) != stored size"):
        refdcp.load({"w": dest}, checkpoint_id=tmp_path, planner=Reshaping(), verify=verify)
    assert not dest.any()  # nothing was delivered


# -- the in-place reader of torch-written items (STORE-40) ---------------------------------


def _with_member_size(item: bytes, member: str, size: int) -> bytes:
    """The archive with the central directory's sizes of ``member`` set to ``size``."""
    blob = bytearray(item)
    at = blob.find(b"PK\x01\x02")
    while at != -1:
        name_len = struct.unpack_from("<H", blob, at + 28)[0]
        name = bytes(blob[at + 46 : at + 46 + name_len]).decode()
        if name.endswith(member):
            assert struct.unpack_from("<I", blob, at + 20)[0] != 0xFFFFFFFF  # not zip64
            struct.pack_into("<II", blob, at + 20, size, size)
            return bytes(blob)
        at = blob.find(b"PK\x01\x02", at + 46)
    raise AssertionError(f"no member {member}")


@pytest.mark.spec("STORE-40")
def test_a_data_member_said_to_run_past_the_item_is_not_read_in_place(tmp_path: Path) -> None:
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    good = _saved(t)
    bad = _with_member_size(good, "/data/0", 1 << 20)
    sizes = {
        i.filename.split("/", 1)[1]: i.file_size
        for i in zipfile.ZipFile(io.BytesIO(bad)).infolist()
    }
    assert sizes["data/0"] == 1 << 20  # the archive still opens; only the size is wrong
    path = tmp_path / "f"
    path.write_bytes(b"\0" * 100 + good + bad + b"\0" * (2 << 20))  # file bytes past the item
    fd = os.open(path, os.O_RDONLY)
    try:
        assert locate_tensor_data(fd, 100, len(good), t.dtype, t.shape) is not None
        assert locate_tensor_data(fd, 100 + len(good), len(bad), t.dtype, t.shape) is None
    finally:
        os.close(fd)


@pytest.mark.spec("STORE-40")
def test_locating_a_torch_written_tensor_emits_no_warning(tmp_path: Path) -> None:
    """The meta storages are built as torch's own loader builds them (internal TypedStorage),
    so a load of a torch checkpoint never shows torch's TypedStorage deprecation warning."""
    t = torch.arange(24, dtype=torch.int64).reshape(4, 6)
    item = _saved(t)
    path = tmp_path / "f"
    path.write_bytes(item)
    fd = os.open(path, os.O_RDONLY)
    try:
        torch.storage._reset_warn_typed_storage_removal()  # torch warns once per process
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            at = locate_tensor_data(fd, 0, len(item), t.dtype, t.shape)
        assert at is not None
        assert os.pread(fd, t.nbytes, at) == t.numpy().tobytes()
    finally:
        os.close(fd)
    assert [str(w.message) for w in caught] == []


# -- item encoding: quantized tensors are stored contiguous (FMT-4, FMT-22) -----------------


@pytest.mark.spec("FMT-22", "FMT-4")
@pytest.mark.parametrize("kind", ["transposed", "strided view", "view"])
def test_a_quantized_tensor_is_stored_as_its_own_elements_contiguous(kind: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        base = torch.quantize_per_tensor(torch.rand(10, 12), 0.01, 3, torch.quint8)
    t = {"transposed": base.t(), "strided view": base[:, ::3], "view": base[2:5]}[kind]
    enc = encode_tensor(t)
    blob = b"".join(bytes(p) for p in enc.parts)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        back = torch.load(io.BytesIO(blob), weights_only=True)
    assert back.is_quantized and back.is_contiguous()
    assert back.untyped_storage().nbytes() == t.numel()  # only its own elements
    assert torch.equal(back.int_repr(), t.int_repr()) and back.q_scale() == t.q_scale()


# -- metadata loading: the result is torch's own class -------------------------------------


class _CallsTheClass:
    """Pickles as a call of ``Metadata(...)`` (REDUCE) instead of NEWOBJ + BUILD."""

    def __reduce__(self) -> tuple[Any, ...]:
        return (Metadata, ({"b": BytesStorageMetadata()},))


@pytest.mark.spec("FMT-6", "FMT-1")
def test_a_metadata_built_by_a_call_of_its_class_loads_as_torchs_metadata() -> None:
    data = pickle.dumps(_CallsTheClass())
    assert b"BytesStorageMetadata" in data and pickle.loads(data) == Metadata(
        {"b": BytesStorageMetadata()}
    )
    md = load_metadata(data)
    assert type(md) is Metadata
    assert type(md.state_dict_metadata["b"]) is BytesStorageMetadata
    again = load_metadata(dump_metadata(md))  # it pickles again as torch's class
    assert type(again) is Metadata and again.state_dict_metadata == md.state_dict_metadata


# -- verify_checkpoint: an item without a checksum is looked for, not read (INTEG-10) ------


@pytest.mark.spec("INTEG-10", "INTEG-6")
def test_items_without_a_checksum_are_counted_not_read(tmp_path: Path) -> None:
    sd = {"a": torch.arange(1000.0), "b": torch.ones(3, 4, dtype=torch.int32), "o": [1, "x"]}
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(str(tmp_path)))
    asked: list[tuple[str, int, int]] = []

    def read_range(name: str, offset: int, length: int) -> bytes | None:
        asked.append((name, offset, length))
        path = tmp_path / name
        if not path.exists():
            return None
        with open(path, "rb") as f:
            f.seek(offset)
            return f.read(length)

    report = verify_ranges((tmp_path / ".metadata").read_bytes(), read_range, str(tmp_path))
    assert report.ok and report.items_checked == 0 and report.items_without_checksum == 3
    assert len(asked) == 3 and all(length == 0 for _, _, length in asked)
    # the items of a refdcp checkpoint are read whole
    ref = tmp_path / "ref"
    refdcp.save(sd, checkpoint_id=ref)
    asked.clear()

    def read_ref(name: str, offset: int, length: int) -> bytes | None:
        asked.append((name, offset, length))
        with open(ref / name, "rb") as f:
            f.seek(offset)
            return f.read(length)

    md = FileSystemReader(ref).read_metadata()
    assert md.storage_data is not None
    report = verify_ranges((ref / ".metadata").read_bytes(), read_ref, str(ref))
    assert report.ok and report.items_checked == 3
    assert sorted(length for _, _, length in asked) == sorted(
        info.length for info in md.storage_data.values()
    )
