"""A read item's box must lie inside the saved chunk it names (STORE-62): for generated chunk
shapes and boxes, inside or crossing an edge in any dimension, refdcp's reader delivers
exactly the box's elements or refuses the read naming the key, the box and the data file,
leaving the destination as it was; on checkpoints written by refdcp (plain and with a zstd
stream transform) and by torch, small and large chunks, every verify mode."""

from __future__ import annotations

import tempfile
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as tdcp
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

import refdcp
from refdcp.errors import RefdcpError
from refdcp.storage import FileSystemReader, FileSystemWriter
from tests.test_mut_storage_fs_reader_checks import _Fixed, _save

SINGLE_PATH = "mutation-kill tests pinning one module of the default path (tests/MUTATION.md); the behaviour runs on both in the shared suites"


def _write(root: Path, saved: torch.Tensor, writer: str) -> None:
    if writer == "refdcp":
        _save(root, {"w": saved})
    elif writer == "refdcp, zstd":  # the transformed read path (FMT-24)
        from refdcp.storage.fs import transforms

        fs_writer = FileSystemWriter(root, sync_files=False, _extensions=[transforms.zstd()])
        refdcp.save({"w": saved}, storage_writer=fs_writer, no_dist=True)
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tdcp.save({"w": saved}, storage_writer=tdcp.FileSystemWriter(str(root)), no_dist=True)


@st.composite
def _cases(draw: st.DrawFn) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """A chunk shape and a box: each dimension's box inside it (possibly empty), or (in one
    dimension at least, sometimes) starting inside and ending past its edge."""
    shape = tuple(draw(st.lists(st.integers(1, 5), min_size=1, max_size=3)))
    offsets, lengths = [], []
    for size in shape:
        o = draw(st.integers(0, size - 1))
        offsets.append(o)
        lengths.append(draw(st.integers(0, size - o)))  # an empty box inside is a box too
    if draw(st.booleans()):
        dim = draw(st.integers(0, len(shape) - 1))
        lengths[dim] = shape[dim] - offsets[dim] + draw(st.integers(1, 2))
        if draw(st.booleans()) and offsets[dim] == 0:  # the whole length, shifted
            offsets[dim], lengths[dim] = 1, shape[dim]
    return shape, tuple(offsets), tuple(lengths)


@pytest.mark.spec("STORE-62", "STORE-47", "STORE-16")
@settings(max_examples=40, deadline=None)
@example(case=((3, 2), (1, 0), (0, 2)), writer="refdcp", verify=None, large=False)  # empty box
@example(case=((6, 5), (0, 1), (6, 5)), writer="refdcp", verify=None, large=False)  # shifted
@example(case=((6, 5), (1, 0), (6, 5)), writer="refdcp, zstd", verify=None, large=False)
@given(
    case=_cases(),
    writer=st.sampled_from(["refdcp", "refdcp, zstd", "torch"]),
    verify=st.sampled_from([None, True, False]),
    large=st.booleans(),
)
def test_a_box_outside_its_saved_chunk_is_refused_and_named(
    case: tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]],
    writer: str,
    verify: bool | None,
    large: bool,
) -> None:
    shape, offsets, lengths = case
    if writer == "torch" and verify:
        verify = None  # torch records no checksum: verify=True refuses it whole (INTEG-5)
    if large:  # a chunk past the 1 MiB in-place threshold: the same box in its first rows
        shape = (shape[0] * 65536, *shape[1:])
    inside = all(o + n <= s for o, n, s in zip(offsets, lengths, shape))
    saved = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        _write(root, saved, writer)
        reader = FileSystemReader(root)
        reader.set_verify(verify)
        reader.set_up_storage_reader(reader.read_metadata(), True)
        zero = torch.Size([0] * len(shape))
        req = ReadItem(
            type=LoadItemType.TENSOR,
            dest_index=MetadataIndex("w", zero),
            dest_offsets=zero,
            storage_index=MetadataIndex("w", zero, 0),
            storage_offsets=torch.Size(offsets),
            lengths=torch.Size(lengths),
        )
        dest = torch.full(lengths, -1.0)
        planner: Any = _Fixed({"w": dest})
        if inside:
            reader.read_data(LoadPlan([req]), planner).wait()
            box = saved[tuple(slice(o, o + n) for o, n in zip(offsets, lengths))]
            assert torch.equal(dest, box)
            return
        with pytest.raises(RefdcpError) as err:
            reader.read_data(LoadPlan([req]), planner).wait()
    text = str(err.value)
    assert text.startswith("w: ") and str(list(offsets)) in text and ".distcp" in text
    assert bool((dest == -1.0).all()) and planner.committed == []
