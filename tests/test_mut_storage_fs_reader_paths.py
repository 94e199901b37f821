"""FileSystemReader's read paths and what each promises: items delivered in file order,
transformed items read one by one (a file of one item too) and named when a later one is
damaged, a verified large item still read in place, an item of exactly the in-place
threshold read in place or streamed from the file, and the streaming loader's weights-only
unpickler (STORE-40, STORE-41, STORE-42, STORE-47, FMT-24, INTEG-12, LOAD-20; issue 28's
reader survivors).
"""

from __future__ import annotations

import gc
import io
import os
import pickle
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem

import refdcp
from refdcp.planning import DefaultLoadPlanner
from refdcp.storage import CorruptionError, FileSystemReader, FileSystemWriter
from refdcp.storage.format import layout
from refdcp.storage.format.items import CRC_ATTR, DATA_OFFSET_ATTR, INPLACE_MIN_BYTES
from refdcp.storage.metadata.safe import dump_metadata, load_metadata
from tests.test_mut_storage_fs_reader_checks import _python_peak
from tests.test_stream_transforms import Xor, _registry

SINGLE_PATH = "mutation-kill tests pinning one module of the default path (tests/MUTATION.md); the behaviour runs on both in the shared suites"

pytestmark = pytest.mark.filterwarnings(
    "ignore:torch.distributed is disabled", "ignore:.*quantiz.*:UserWarning"
)


def _records(root: Path) -> dict[str, Any]:
    md = load_metadata((root / ".metadata").read_bytes())
    assert md.storage_data is not None
    return {idx.fqn: info for idx, info in md.storage_data.items()}


def _reader(root: Path, verify: bool | None = None, registry: Any = None) -> FileSystemReader:
    reader = FileSystemReader(root, _extension_registry=registry)
    reader.set_verify(verify)
    reader.set_up_storage_reader(reader.read_metadata(), True)
    return reader


def _plan(planner: Any, dest: dict[str, Any], root: Path) -> LoadPlan:
    planner.set_up_planner(dest, load_metadata((root / ".metadata").read_bytes()), True)
    plan: LoadPlan = planner.create_local_plan()
    return plan


def _flip(root: Path, info: Any, at: int) -> None:
    path = root / info.relative_path
    data = bytearray(path.read_bytes())
    data[info.offset + at] ^= 0x5A
    path.write_bytes(bytes(data))


# -- STORE-47: items are delivered in file order, whatever the plan's order ---------------------


def _mixed(root: Path) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Small items, a large one, small items, in one file; returns the state and file order."""
    state = {f"s{i}": torch.arange(8.0) + i for i in range(3)}
    state["large"] = torch.arange(INPLACE_MIN_BYTES // 4 + 64, dtype=torch.float32)
    state.update({f"t{i}": torch.arange(8.0) - i for i in range(3)})
    refdcp.save(state, storage_writer=FileSystemWriter(root, sync_files=False), no_dist=True)
    records = _records(root)
    assert len({info.relative_path for info in records.values()}) == 1
    return state, sorted(records, key=lambda fqn: records[fqn].offset)


class _Recording(DefaultLoadPlanner):
    def __init__(self) -> None:
        super().__init__()
        self.committed: list[str] = []

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        self.committed.append(read_item.dest_index.fqn)
        super().commit_tensor(read_item, tensor)


@pytest.mark.spec("STORE-47")
@pytest.mark.parametrize("verify", [None, False, True])
def test_items_are_delivered_in_file_order_whatever_the_plans_order(
    tmp_path: Path, verify: bool | None
) -> None:
    """The plan lists the keys in the reverse of their file order: each is still committed
    in file order (small items before the large one first, those after it last)."""
    state, order = _mixed(tmp_path)
    dest = {k: torch.zeros_like(state[k]) for k in reversed(order)}
    planner = _Recording()
    plan = _plan(planner, dest, tmp_path)
    assert [r.dest_index.fqn for r in plan.items] == order[::-1]
    _reader(tmp_path, verify).read_data(plan, planner).wait()
    assert planner.committed == order
    assert all(torch.equal(dest[k], state[k]) for k in order)


@pytest.mark.spec("STORE-47", "LOAD-20")
@pytest.mark.parametrize("damaged", ["large", "t0"])
def test_a_damaged_item_names_exactly_the_items_before_it_in_the_file(
    tmp_path: Path, damaged: str
) -> None:
    """Default planner (small items batched into runs), plan in reverse file order, one item
    damaged: the items before it in the file were delivered and are named first; a later
    item is named only if it holds its stored values, else it keeps its old ones."""
    state, order = _mixed(tmp_path)
    info = _records(tmp_path)[damaged]
    _flip(tmp_path, info, getattr(info, DATA_OFFSET_ATTR) + 2)
    dest = {k: torch.full_like(state[k], 9.0) for k in reversed(order)}
    planner = DefaultLoadPlanner()
    plan = _plan(planner, dest, tmp_path)
    with pytest.raises(CorruptionError, match="checksum mismatch") as err:
        _reader(tmp_path).read_data(plan, planner)
    before, named = order[: order.index(damaged)], err.value.overwritten
    assert err.value.fqn == damaged and named[: len(before)] == tuple(before)
    assert damaged not in named
    for k in order:  # later items of the damaged one's run may be named too (STORE-54)
        if k in named:
            assert torch.equal(dest[k], state[k])
        elif k != damaged:
            assert bool((dest[k] == 9).all())


# -- FMT-24, INTEG-12: transformed items, one per file or several ------------------------------


def _save_xor(root: Path, state: dict[str, Any]) -> None:
    writer = FileSystemWriter(root, sync_files=False, _extensions=[Xor()])
    refdcp.save(state, storage_writer=writer, no_dist=True)


@pytest.mark.spec("FMT-24")
@pytest.mark.parametrize("count", [1, 2, 3])
@pytest.mark.parametrize("kind", ["tensor", "bytes"])
def test_a_transformed_file_of_any_item_count_is_read(
    tmp_path: Path, count: int, kind: str
) -> None:
    """A file holding one, two or three transformed items (tensors or bytes) loads each."""
    state: dict[str, Any] = {
        f"k{i}": torch.arange(5.0) * (i + 1) if kind == "tensor" else io.BytesIO(b"x" * (i + 3))
        for i in range(count)
    }
    _save_xor(tmp_path, state)
    records = _records(tmp_path)
    assert len({r.relative_path for r in records.values()}) == 1
    assert all(r.transform_descriptors == ["test.xor/1"] for r in records.values())
    dest: dict[str, Any] = {
        k: torch.zeros(5) if kind == "tensor" else io.BytesIO() for k in reversed(state)
    }
    planner = DefaultLoadPlanner()
    _reader(tmp_path, registry=_registry()).read_data(_plan(planner, dest, tmp_path), planner)
    for k, v in state.items():
        if kind == "tensor":
            assert torch.equal(dest[k], v)
        else:
            assert dest[k].getvalue() == v.getvalue()


@pytest.mark.spec("INTEG-12", "LOAD-20")
@pytest.mark.parametrize("damaged", [0, 1, 2])
def test_a_damaged_transformed_item_names_the_items_delivered_before_it(
    tmp_path: Path, damaged: int
) -> None:
    """Three transformed tensors in one file, one stored byte flipped: the check fails before
    the decoder runs, and the error names the keys already delivered (those before it in
    the file); the later ones keep their old values."""
    state = {f"k{i}": torch.arange(6.0) + 10 * i for i in range(3)}
    _save_xor(tmp_path, state)
    records = _records(tmp_path)
    order = sorted(records, key=lambda fqn: records[fqn].offset)
    victim = order[damaged]
    _flip(tmp_path, records[victim], records[victim].length // 2)
    dest = {k: torch.full((6,), -1.0) for k in order}
    planner = DefaultLoadPlanner()
    with pytest.raises(CorruptionError, match="checksum mismatch") as err:
        _reader(tmp_path, registry=_registry()).read_data(_plan(planner, dest, tmp_path), planner)
    assert err.value.fqn == victim and err.value.overwritten == tuple(order[:damaged])
    assert all(torch.equal(dest[k], state[k]) for k in order[:damaged])
    assert all(bool((dest[k] == -1).all()) for k in order[damaged:])


# -- STORE-41: a verified large item is still read in place ------------------------------------


@pytest.mark.spec("STORE-41", "STORE-11")
def test_a_verified_large_item_is_checked_in_bounded_memory_then_read_in_place(
    tmp_path: Path,
) -> None:
    """``verify=True``, a 12 MiB whole chunk: its check streams through at most 8 MiB, then
    its elements land in the destination; no buffer of the item's size is allocated."""
    saved = torch.arange(3 << 20, dtype=torch.float32)
    refdcp.save({"w": saved}, storage_writer=FileSystemWriter(tmp_path), no_dist=True)
    dest = {"w": torch.zeros_like(saved)}
    planner = DefaultLoadPlanner()
    plan = _plan(planner, dest, tmp_path)
    reader = _reader(tmp_path, True)
    with _python_peak() as peak_box:
        reader.read_data(plan, planner).wait()
    peak = peak_box[0]
    assert torch.equal(dest["w"], saved)
    assert peak < (8 << 20) + (1 << 20) < saved.nbytes, peak


# -- STORE-40, STORE-42: an item of exactly the in-place threshold -----------------------------


def _archive_of_length(make: Any, length: int) -> tuple[bytes, Any]:
    """``torch.save`` of ``make(n)`` padded to exactly ``length`` bytes with a zip comment
    (an archive any zip reader accepts): the tensor and the item's bytes."""
    n = length - 2048
    for _ in range(8):
        tensor = make(n)
        buf = io.BytesIO()
        torch.save(tensor, buf)
        data = buf.getvalue()
        pad = length - len(data)
        if 0 <= pad < 64:
            assert data[-22:-18] == b"PK\x05\x06" and data[-2:] == b"\0\0"
            return data[:-2] + struct.pack("<H", pad) + b"c" * pad, tensor
        n += pad - 32
    raise AssertionError("no archive length found")


def _crafted(root: Path, item: bytes, like: torch.Tensor) -> None:
    """A checkpoint of key ``w`` (``like``'s dtype and shape) whose record points at
    ``item`` in a data file of its own, with no data offset and no checksum."""
    refdcp.save({"w": like}, storage_writer=FileSystemWriter(root, sync_files=False), no_dist=True)
    md = load_metadata((root / ".metadata").read_bytes())
    assert md.storage_data is not None
    (info,) = md.storage_data.values()
    name = f"__0_9.{layout.new_save_token()}.distcp"
    (root / name).write_bytes(item)
    info.relative_path, info.offset, info.length = name, 0, len(item)
    for attr in (DATA_OFFSET_ATTR, CRC_ATTR):
        if hasattr(info, attr):
            delattr(info, attr)
    (root / ".metadata").write_bytes(dump_metadata(md))


@pytest.mark.spec("STORE-40", "STORE-11")
def test_a_torch_item_of_exactly_the_threshold_is_read_in_place(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A plain uint8 tensor archive exactly 1 MiB long: located and read in place, never
    through ``torch.load``."""
    item, tensor = _archive_of_length(
        lambda n: torch.arange(n, dtype=torch.int64).remainder(251).to(torch.uint8),
        INPLACE_MIN_BYTES,
    )
    _crafted(tmp_path, item, torch.zeros_like(tensor))
    dest = {"w": torch.zeros_like(tensor)}
    planner = DefaultLoadPlanner()
    plan = _plan(planner, dest, tmp_path)
    reader = _reader(tmp_path)

    def no_load(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("an in-place item went through torch.load")

    monkeypatch.setattr(torch, "load", no_load)
    reader.read_data(plan, planner).wait()
    assert torch.equal(dest["w"], tensor)


@pytest.mark.spec("STORE-42")
def test_a_quantized_item_of_exactly_the_threshold_is_streamed_from_the_file(
    tmp_path: Path,
) -> None:
    """A quantized tensor archive exactly 1 MiB long cannot be read in place: torch.load
    reads it from the file, and no copy of the whole item is made in memory first."""
    item, tensor = _archive_of_length(
        lambda n: torch.quantize_per_tensor(torch.linspace(-3, 3, n), 0.05, 0, torch.qint8),
        INPLACE_MIN_BYTES,
    )
    _crafted(tmp_path, item, tensor)
    dest = {"w": torch.quantize_per_tensor(torch.zeros(tensor.shape), 0.05, 0, torch.qint8)}
    planner = DefaultLoadPlanner()
    plan = _plan(planner, dest, tmp_path)
    reader = _reader(tmp_path)
    with _python_peak() as peak_box:
        reader.read_data(plan, planner).wait()
    peak = peak_box[0]
    assert torch.equal(dest["w"].int_repr(), tensor.int_repr())
    assert peak < INPLACE_MIN_BYTES // 2, peak


# -- STORE-42: the streaming loader unpickles weights only -------------------------------------


class _Negated:
    """Unpickles to ``torch.neg(base)``: a tensor, but only by calling a function that
    torch's weights-only unpickler does not allow."""

    def __init__(self, base: torch.Tensor) -> None:
        self.base = base

    def __reduce__(self) -> tuple[Any, ...]:
        return (torch.neg, (self.base,))


@pytest.mark.spec("STORE-42")
def test_a_large_item_is_unpickled_weights_only(tmp_path: Path) -> None:
    """A large item whose pickle calls ``torch.neg`` would unpickle to a tensor of the
    chunk's shape; the weights-only unpickler refuses it and the destination is untouched."""
    n = INPLACE_MIN_BYTES // 4 + 64
    buf = io.BytesIO()
    torch.save(_Negated(torch.ones(n)), buf)
    assert len(buf.getvalue()) >= INPLACE_MIN_BYTES
    _crafted(tmp_path, buf.getvalue(), torch.zeros(n))
    dest = {"w": torch.zeros(n)}
    planner = DefaultLoadPlanner()
    plan = _plan(planner, dest, tmp_path)
    with pytest.raises(pickle.UnpicklingError, match=r"[Ww]eights only load failed"):
        _reader(tmp_path).read_data(plan, planner)
    assert not dest["w"].any()


# -- STORE-61: read_data closes every data file it opened, returning or raising ----------------


def _open_fds() -> int:
    gc.collect()  # descriptors of collectable garbage are closed before counting
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.spec("STORE-61", "FMT-24")
@pytest.mark.parametrize("transformed", [False, True])
@pytest.mark.parametrize("outcome", ["loads", "damaged", "truncated"])
def test_read_data_leaves_no_data_file_open(
    tmp_path: Path, transformed: bool, outcome: str
) -> None:
    """Two data files (two threads), plain or transformed, loaded whole, with one item
    damaged or its file truncated: the process holds as many descriptors after
    ``read_data`` as before it."""
    state = {f"k{i}": torch.arange(6.0) + i for i in range(4)}
    extensions = [Xor()] if transformed else None
    writer = FileSystemWriter(tmp_path, sync_files=False, thread_count=2, _extensions=extensions)
    refdcp.save(state, storage_writer=writer, no_dist=True)
    records = _records(tmp_path)
    assert len({r.relative_path for r in records.values()}) == 2
    last = max(records.values(), key=lambda r: (r.relative_path, r.offset))
    if outcome == "damaged":
        _flip(tmp_path, last, last.length - 1)
    elif outcome == "truncated":
        os.truncate(tmp_path / last.relative_path, last.offset + 1)
    dest = {k: torch.zeros(6) for k in state}
    planner = DefaultLoadPlanner()
    plan = _plan(planner, dest, tmp_path)
    reader = _reader(tmp_path, registry=_registry())
    before = _open_fds()
    if outcome == "loads":
        reader.read_data(plan, planner).wait()
        assert all(torch.equal(dest[k], v) for k, v in state.items())
    else:
        with pytest.raises(CorruptionError):
            reader.read_data(plan, planner)
    assert _open_fds() == before
