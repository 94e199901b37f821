"""The reference global metadata (refdcp/reference/metadata.py) on its own: each problem is
worded with its kind and the ranks that listed the FQN (META-2..4), the records it builds
(META-1)."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    TensorProperties,
    TensorStorageMetadata,
)

from refdcp.planning.local_plan import save_items
from refdcp.reference.metadata import build_metadata, chunk_problems


@pytest.mark.spec("META-4", "REF-1")
def test_an_object_written_by_two_ranks_is_a_problem_naming_them() -> None:
    plans = [save_items({"x": 1}), save_items({}), save_items({"x": 1})]
    md, problems = build_metadata(plans)
    assert isinstance(md["x"], BytesStorageMetadata)
    assert problems == [
        "'x': saved as bytes by several ranks, or as bytes and as a tensor (ranks [0, 2])"
    ]


@pytest.mark.spec("META-3", "META-1", "REF-1")
def test_overlapping_chunks_name_their_ranks_and_are_all_recorded() -> None:
    plans = [save_items({"w": torch.zeros(4)}), save_items({"w": torch.zeros(4)})]
    md, problems = build_metadata(plans)
    w = md["w"]
    assert isinstance(w, TensorStorageMetadata) and len(w.chunks) == 2
    assert problems == ["'w': chunks overlap (ranks [0, 1])"]


@pytest.mark.spec("META-4", "REF-1")
def test_an_fqn_saved_as_an_object_and_as_a_tensor_is_one_bytes_problem() -> None:
    plans = [save_items({"x": "obj"}), save_items({"x": torch.zeros(3)})]
    _, problems = build_metadata(plans)
    assert problems == [
        "'x': saved as bytes by several ranks, or as bytes and as a tensor (ranks [0, 1])"
    ]


@pytest.mark.spec("META-4", "REF-1")
def test_ranks_disagreeing_on_dtype_or_shape_are_one_problem() -> None:
    for other in (torch.zeros(2, dtype=torch.int64), torch.zeros(3)):
        plans = [save_items({"w": torch.zeros(2)}), save_items({"w": other})]
        _, problems = build_metadata(plans)
        assert problems == ["'w': ranks disagree on dtype or global shape (ranks [0, 1])"]


@pytest.mark.spec("META-2", "META-3", "REF-1")
@pytest.mark.parametrize(
    ("size", "chunks", "want"),
    [
        ((2,), [((0,), (2,)), ((1,), (0,))], []),  # an empty chunk inside a full one
        ((1,), [((0,), (1,)), ((0,), (1,))], ["overlap"]),  # one element written twice
        ((3,), [((0,), (2,)), ((2,), (1,)), ((1,), (1,))], ["overlap"]),  # not neighbours
        ((4,), [((0,), (1,)), ((2,), (2,))], ["cover"]),  # a hole
        ((2,), [((1,), (2,))], ["outside"]),
        ((2, 2), [((0, 0), (2, 1)), ((0, 1), (2, 2))], ["outside"]),
        ((), [((), ())], []),
        ((), [((), ()), ((), ())], ["cover"]),
    ],
)
def test_chunk_problems_on_small_layouts(
    size: tuple[int, ...], chunks: list[tuple[tuple[int, ...], tuple[int, ...]]], want: list[str]
) -> None:
    assert chunk_problems(size, chunks) == want


@pytest.mark.spec("META-3", "PLAN-1", "REF-1")
def test_a_tensor_no_rank_wrote_a_chunk_of_is_a_cover_problem() -> None:
    props = TensorProperties(dtype=torch.float32)
    md, problems = build_metadata([[], []], {"w": (props, torch.Size([2]))})
    assert isinstance(md["w"], TensorStorageMetadata) and md["w"].chunks == []
    assert problems == ["'w': the chunks do not cover the whole tensor (ranks [])"]
    plans = [save_items({"w": torch.zeros(2)}), []]
    assert build_metadata(plans, {"w": (props, torch.Size([2]))})[1] == []
