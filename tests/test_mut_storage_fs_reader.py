"""FileSystemReader driven by hand: load-plan stamps, unchecked resharded reads, the
streaming path's refusal, and the run reader in a file that also holds a large item
(LOAD-23, STORE-16, STORE-42, STORE-47; issue 28).
"""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

import refdcp
from refdcp.crc.kernel import crc32c
from refdcp.errors import RefdcpError
from refdcp.storage import FileSystemReader, FileSystemWriter
from refdcp.storage.errors import CheckpointReplacedError
from refdcp.storage.format import layout
from refdcp.storage.format.items import DATA_OFFSET_ATTR, INPLACE_MIN_BYTES
from refdcp.storage.metadata.safe import dump_metadata, load_metadata

SINGLE_PATH = "mutation-kill tests pinning one module of the default path (tests/MUTATION.md); the behaviour runs on both in the shared suites"

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


# -- LOAD-23: each rank's plan carries the stamp of the .metadata it read -----------------


def _save(root: Path, sd: dict[str, Any], writer: str) -> None:
    if writer == "refdcp":
        refdcp.save(sd, storage_writer=FileSystemWriter(root, sync_files=False), no_dist=True)
    else:
        dcp.save(sd, checkpoint_id=root, no_dist=True)


@pytest.mark.spec("LOAD-23", "INTEG-2")
@pytest.mark.parametrize("writer", ["refdcp", "torch"])
def test_ranks_that_read_different_commits_are_refused_before_any_read(
    tmp_path: Path, writer: str
) -> None:
    """Rank A reads ``.metadata``, a save commits, rank B reads the new one: their plans carry
    different stamps (the size and CRC-32C of the bytes each read) and the coordinator's
    global plan refuses them; two ranks that read the same file pass."""
    _save(tmp_path, {"w": torch.ones(4)}, writer)
    data = (tmp_path / ".metadata").read_bytes()
    a, b, c = FileSystemReader(tmp_path), FileSystemReader(tmp_path), FileSystemReader(tmp_path)
    a.read_metadata()
    c.read_metadata()
    plan_a, plan_c = a.prepare_local_plan(LoadPlan([])), c.prepare_local_plan(LoadPlan([]))
    assert plan_a.storage_data == plan_c.storage_data
    stamp = plan_a.storage_data
    assert isinstance(stamp, layout.MetadataStamp) and stamp.size == len(data)
    if writer == "torch":
        assert stamp.crc == crc32c(data)
    assert a.prepare_global_plan([plan_a, plan_c]) == [plan_a, plan_c]
    _save(tmp_path, {"w": torch.ones(4), "v": torch.zeros(2)}, writer)
    b.read_metadata()
    plan_b = b.prepare_local_plan(LoadPlan([]))
    assert plan_b.storage_data != stamp
    with pytest.raises(CheckpointReplacedError, match=r"2 different committed \.metadata files"):
        a.prepare_global_plan([plan_a, plan_b])


@pytest.mark.spec("LOAD-23")
def test_a_plan_that_carries_its_own_storage_data_is_passed_on_unchanged(tmp_path: Path) -> None:
    """A planner's own ``storage_data`` is not replaced by the stamp; a reader that read no
    metadata adds none; either way the plan comes back."""
    _save(tmp_path, {"w": torch.ones(4)}, "refdcp")
    fresh = FileSystemReader(tmp_path)
    plan = LoadPlan([])
    assert fresh.prepare_local_plan(plan) is plan and plan.storage_data is None
    reader = FileSystemReader(tmp_path)
    reader.read_metadata()
    own = LoadPlan([], storage_data={"planner": "data"})
    assert reader.prepare_local_plan(own) is own

    class Carrying(refdcp.DefaultLoadPlanner):
        def create_local_plan(self) -> LoadPlan:
            plan = super().create_local_plan()
            plan.storage_data = "the planner's"
            return plan

    out = {"w": torch.zeros(4)}
    refdcp.load(out, storage_reader=FileSystemReader(tmp_path), planner=Carrying(), no_dist=True)
    assert torch.equal(out["w"], torch.ones(4))


# -- STORE-16: an unchecked read of part of a chunk reads the right rows ------------------


class _Into:
    """A load planner for one read: the destination is a fresh tensor of the read's size."""

    def __init__(self, dtype: torch.dtype, lengths: tuple[int, ...]) -> None:
        self.dest = torch.full(lengths, -1, dtype=dtype)
        self.committed = 0

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        return self.dest

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        self.committed += 1


def _part(fqn: str, offsets: tuple[int, ...], lengths: tuple[int, ...]) -> ReadItem:
    zero = torch.Size([0] * len(offsets))
    return ReadItem(
        type=LoadItemType.TENSOR,
        dest_index=MetadataIndex(fqn, zero),
        dest_offsets=zero,
        storage_index=MetadataIndex(fqn, zero, 0),
        storage_offsets=torch.Size(offsets),
        lengths=torch.Size(lengths),
    )


@st.composite
def _boxes(draw: st.DrawFn) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    shape = tuple(draw(st.lists(st.integers(1, 6), min_size=1, max_size=3)))
    offsets = tuple(draw(st.integers(0, n - 1)) for n in shape)
    lengths = tuple(draw(st.integers(1, n - o)) for n, o in zip(shape, offsets))
    return shape, offsets, lengths


@pytest.mark.spec("STORE-16")
@settings(max_examples=25, deadline=None)
@given(box=_boxes(), writer=st.sampled_from(["refdcp", "torch"]))
def test_an_unchecked_part_read_delivers_exactly_that_box(
    tmp_path_factory: pytest.TempPathFactory,
    box: tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]],
    writer: str,
) -> None:
    """Verification off (refdcp's checkpoint read with ``set_verify(False)``) or a torch
    checkpoint (no checksums): the rows the box overlaps are read and narrowed to the box."""
    shape, offsets, lengths = box
    root = tmp_path_factory.mktemp("part")
    saved = torch.arange(int(torch.tensor(shape).prod()), dtype=torch.float64).reshape(shape)
    _save(root, {"w": saved}, writer)
    reader = FileSystemReader(root)
    if writer == "refdcp":
        reader.set_verify(False)
    reader.set_up_storage_reader(reader.read_metadata(), True)
    planner = _Into(saved.dtype, lengths)
    reader.read_data(LoadPlan([_part("w", offsets, lengths)]), planner).wait()  # type: ignore[arg-type]
    expected = saved[tuple(slice(o, o + n) for o, n in zip(offsets, lengths))]
    assert torch.equal(planner.dest, expected) and planner.committed == 1


# -- STORE-42: a large item that unpickles to something else is refused by name ------------


@pytest.mark.spec("STORE-42")
def test_a_large_item_that_is_not_a_tensor_is_refused(tmp_path: Path) -> None:
    """The record of tensor ``w`` points at a data file holding a large pickled dict (no
    data offset, no checksum): the streaming loader finds no tensor and says so."""
    n = INPLACE_MIN_BYTES // 4 + 16
    refdcp.save({"w": torch.ones(n)}, checkpoint_id=tmp_path, no_dist=True)
    md = load_metadata((tmp_path / ".metadata").read_bytes())
    assert md.storage_data is not None
    (_, info), *_ = md.storage_data.items()
    buf = io.BytesIO()
    torch.save({"not": torch.ones(n)}, buf)
    name = f"__0_9.{layout.new_save_token()}.distcp"
    (tmp_path / name).write_bytes(buf.getvalue())
    info.relative_path, info.offset, info.length = name, 0, len(buf.getvalue())
    for attr in (DATA_OFFSET_ATTR, "refdcp_crc32c"):
        if hasattr(info, attr):
            delattr(info, attr)
    (tmp_path / ".metadata").write_bytes(dump_metadata(md))
    dest = torch.zeros(n)
    with pytest.raises(BaseException) as err:
        refdcp.load({"w": dest}, checkpoint_id=tmp_path, no_dist=True)
    text = str(err.value) + "".join(
        str(f.exception) for f in getattr(err.value, "rank_failures", {}).values()
    )
    assert f"w: {name} holds <class 'dict'>, not a tensor" in text
    assert isinstance(
        next(iter(getattr(err.value, "rank_failures", {0: None}).values())).exception, RefdcpError
    )
    assert not dest.any()


# -- STORE-47: small items share one read even beside a large item of the same file -------


@pytest.mark.spec("STORE-47")
def test_small_items_beside_a_large_one_are_still_read_in_one_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    small = {f"s{i}": torch.arange(16, dtype=torch.float32) + i for i in range(6)}
    state = {**small, "z_large": torch.arange(INPLACE_MIN_BYTES // 4 + 8, dtype=torch.float32)}
    refdcp.save(state, storage_writer=FileSystemWriter(tmp_path, sync_files=False), no_dist=True)
    calls: list[int] = []
    real = os.preadv

    def counting(fd: int, buffers: Any, offset: int) -> int:
        calls.append(len(buffers))
        return real(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", counting)
    dest = {k: torch.zeros_like(v) for k, v in state.items()}
    refdcp.load(dest, storage_reader=FileSystemReader(tmp_path), no_dist=True)
    assert all(torch.equal(dest[k], v) for k, v in state.items())
    assert calls.count(2 * len(small) + 1) == 1  # the run of the six small items, one read
