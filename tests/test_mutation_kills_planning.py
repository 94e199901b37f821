"""Planning behaviour that the default mutation sample found untested (issue 13).

Each test pins one rule the code states and a wrong program could break while the
rest of the suite passes:

* the block dedup treats an empty cut of a non-empty plan as no blocks, so no item
  is lost (DEDUP-14);
* the global metadata of a plan whose chunk offsets or sizes are plain tuples still
  shares one object per distinct value (META-8);
* the whole-tensor read is the sweep's read for a number of dims seen for the
  first time (its zero-offsets cache is built then, RESHARD-1, RESHARD-5);
* a value's own load error is quoted whole after torch's marker (SAVE-12).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

import refdcp.planning.resharding as resharding
from refdcp.planning.dedup.blocks import valid_blocks
from refdcp.planning.dedup.classes import dedup_items
from refdcp.planning.loadable import loadability_problem
from refdcp.planning.local_plan import block_digests, save_items
from refdcp.planning.metadata.build import build_state_dict_metadata
from refdcp.reference.dedup import reference_dedup

# -- DEDUP-14: an empty cut of a non-empty plan is not a valid cut ------------------------


@pytest.mark.spec("DEDUP-14")
def test_an_empty_cut_is_valid_only_for_an_empty_plan() -> None:
    assert valid_blocks(([], []), 0)
    assert not valid_blocks(([], []), 1)
    assert not valid_blocks(([], []), 3)


@pytest.mark.spec("DEDUP-14", "DEDUP-9")
def test_a_rank_sending_an_empty_cut_of_its_items_still_writes_them() -> None:
    shared = {"a": torch.zeros(4), "b": torch.zeros(2)}
    plans = [
        save_items({"x": torch.zeros(3)}),  # one item, but an empty cut: no valid blocks
        save_items({**shared, "own1": torch.zeros(1)}),
        save_items({**shared, "own2": torch.zeros(5)}),
    ]
    blocks: list[Any] = [([], []), block_digests(plans[1], None, [2, 3])]
    blocks.append(block_digests(plans[2], None, [2, 3]))
    assert blocks[1][1][0] == blocks[2][1][0]  # the block of a and b is shared: the block path
    fast = dedup_items(plans, blocks=blocks)
    kept, problems, _ = reference_dedup(plans)
    assert fast.plans == kept and fast.problems == problems
    assert [i.index.fqn for i in fast.plans[0]] == ["x"]


# -- META-8: tuples among the chunk offsets and sizes ----------------------------------------


def _item(fqn: str, off: Any, sz: Any, size: Any) -> WriteItem:
    return WriteItem(
        index=MetadataIndex(fqn, torch.Size(off)),
        type=WriteItemType.SHARD,
        tensor_data=TensorWriteData(
            chunk=ChunkStorageMetadata(off, sz),
            properties=TensorProperties(dtype=torch.float32),
            size=size,
        ),
    )


@pytest.mark.spec("META-8", "META-1")
def test_tuple_offsets_and_sizes_still_share_one_object_per_value() -> None:
    # offsets and sizes as plain tuples (another planner's items), mixed with torch.Size
    plans = [
        [_item("w", (0, 0), (2, 4), torch.Size([4, 4])), _item("v", (0,), (4,), torch.Size([4]))],
        [_item("w", torch.Size([2, 0]), (2, 4), torch.Size([4, 4]))],
        [_item("u", (0,), torch.Size([4]), torch.Size([4]))],
    ]
    md, problems = build_state_dict_metadata(plans, {})
    assert problems == []
    w, v, u = md["w"], md["v"], md["u"]
    assert isinstance(w, TensorStorageMetadata)
    assert isinstance(v, TensorStorageMetadata) and isinstance(u, TensorStorageMetadata)
    # the values are unchanged
    assert tuple(w.size) == (4, 4) and tuple(v.size) == (4,) and tuple(u.size) == (4,)
    got = sorted((tuple(c.offsets), tuple(c.sizes)) for c in w.chunks)
    assert got == [((0, 0), (2, 4)), ((2, 0), (2, 4))]
    assert [(tuple(c.offsets), tuple(c.sizes)) for c in v.chunks] == [((0,), (4,))]
    assert [(tuple(c.offsets), tuple(c.sizes)) for c in u.chunks] == [((0,), (4,))]
    # one object per distinct value, across tensors and across offsets / sizes / global sizes
    values = [w.size, v.size, u.size]
    for entry in (w, v, u):
        for c in entry.chunks:
            values += [c.offsets, c.sizes]
    for a in values:
        for b in values:
            if a == b:
                assert a is b, (a, b)


# -- RESHARD-1, RESHARD-5: the whole-tensor read for dims not seen before --------------------


@pytest.mark.spec("RESHARD-1", "RESHARD-5", "POLICY-4")
@pytest.mark.parametrize("shape", [[3], [2, 5], [1, 2, 3], [2, 1, 2, 2], [1, 1, 1, 1, 2]])
def test_the_whole_tensor_read_of_a_fresh_rank_is_the_sweeps_read(
    monkeypatch: pytest.MonkeyPatch, shape: list[int]
) -> None:
    monkeypatch.setattr(resharding, "_ZEROS", {})  # as in a fresh process: nothing cached
    size = torch.Size(shape)
    zeros = torch.Size([0] * len(shape))
    md = TensorStorageMetadata(
        TensorProperties(dtype=torch.float32), size, [ChunkStorageMetadata(zeros, size)]
    )
    fast = resharding.whole_tensor_read("w", md)
    assert fast is not None
    (sweep,) = resharding.read_items_for_chunks("w", md, [ChunkStorageMetadata(zeros, size)])
    assert dataclasses.astuple(fast) == dataclasses.astuple(sweep)
    assert tuple(fast.dest_offsets) == tuple(fast.storage_offsets) == tuple(zeros)
    # a single full-size chunk that does not start at the origin is not a whole tensor
    ones = torch.Size([1] * len(shape))
    moved = TensorStorageMetadata(
        TensorProperties(dtype=torch.float32), size, [ChunkStorageMetadata(ones, size)]
    )
    monkeypatch.setattr(resharding, "_ZEROS", {})
    assert resharding.whole_tensor_read("w", moved) is None


# -- SAVE-12: the cause is quoted whole ------------------------------------------------------


class _QuotesTorch:
    """Allowed by the caller; at load it fails quoting a nested weights-only refusal."""

    def __getstate__(self) -> dict[str, int]:
        return {"x": 1}

    def __setstate__(self, state: dict[str, int]) -> None:
        raise ValueError(
            "WeightsUnpickler error: inner blob refused "
            "(WeightsUnpickler error: Unsupported global: GLOBAL a.B)"
        )


@pytest.mark.spec("SAVE-12")
def test_the_cause_after_torchs_marker_is_quoted_whole() -> None:
    problem = loadability_problem(_QuotesTorch(), [_QuotesTorch])
    assert problem is not None
    want = "(inner blob refused (WeightsUnpickler error: Unsupported global: GLOBAL a.B)); "
    assert want in problem, problem


@pytest.mark.spec("DEDUP-14", "PLAN-15")
def test_a_cut_with_an_empty_block_is_not_valid() -> None:
    """Blocks are non-empty runs: an end repeated (a block of no items) is refused, as is
    an end past the plan or ends out of order."""
    d = [b"a" * 16, b"b" * 16, b"c" * 16]
    assert valid_blocks(([1, 2, 3], d), 3)
    assert not valid_blocks(([1, 1, 3], d), 3)
    assert not valid_blocks(([2, 1, 3], d), 3)
    assert not valid_blocks(([1, 2, 4], d), 3)
    assert not valid_blocks(([0, 3], d[:2]), 3)
