"""The reference path against the default path and torch (REF-2, REF-3, REF-4).

For random state dicts and worlds, ``refdcp`` and ``refdcp.reference`` choose the
same writer for every stored chunk and commit equal metadata; each loads the
other's checkpoint and torch's, torch loads the reference's, and the loaded
values are equal. The fast functions that replace reference ones are compared
directly: the resharding reads and the replica checksums (the dedup and
metadata rules are compared in test_planning_dedup_reference.py and
test_planning_metadata_reference.py).
"""

from __future__ import annotations

import tempfile
import warnings
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as tdcp
from hypothesis import given
from hypothesis import strategies as st
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    TensorProperties,
    TensorStorageMetadata,
)

import refdcp
import refdcp.reference
from refdcp.comm import FakeWorld, SingleRank
from refdcp.planning.local_plan import object_checksum, tensor_checksum
from refdcp.planning.resharding import read_items_for_chunks
from refdcp.reference.load_planner import reads_for_chunk
from refdcp.reference.save_planner import value_checksum

from ._both import IMPLS, Entry, check_loaded, models, state_for
from .strategies import expected, tensors
from .test_properties_reshard_bytes import cases


def _save(impl: str, model: list[Entry], world: int, path: str) -> None:
    api = IMPLS[impl]
    FakeWorld(world).run(
        lambda c: api.save(state_for(model, world, c.rank), checkpoint_id=path, comm=c)
    )


def _load(impl: str, model: list[Entry], world: int, path: str) -> list[dict[str, Any]]:
    def one(c: Any) -> dict[str, Any]:
        sd = state_for(model, world, c.rank, zeros=True)
        IMPLS[impl].load(sd, checkpoint_id=path, comm=c)
        return sd

    return FakeWorld(world).run(one)


def _writers(md: Any) -> dict[Any, str]:
    """Stored chunk -> the rank prefix of the file holding it (``__{rank}_``)."""
    return {
        (i.fqn, tuple(i.offset or ())): info.relative_path.split("_")[2]
        for i, info in md.storage_data.items()
    }


@pytest.mark.spec("REF-3", "REF-2", "DEDUP-2")
@given(model=models(), w_save=st.integers(1, 4), w_load=st.integers(1, 4))
def test_same_writers_equal_metadata_and_each_loads_the_other(
    model: list[Entry], w_save: int, w_load: int
) -> None:
    with tempfile.TemporaryDirectory() as fast, tempfile.TemporaryDirectory() as ref:
        _save("fast", model, w_save, fast)
        _save("reference", model, w_save, ref)
        a = refdcp.FileSystemReader(fast).read_metadata()
        b = refdcp.reference.ReferenceReader(ref).read_metadata()
        assert a.state_dict_metadata == b.state_dict_metadata
        assert a.planner_data == b.planner_data
        assert _writers(a) == _writers(b)
        for loader, path in (("reference", fast), ("fast", ref)):
            for rank, sd in enumerate(_load(loader, model, w_load, path)):
                check_loaded(model, w_load, rank, sd)


@pytest.mark.spec("REF-2", "API-7")
@given(model=models(max_entries=4), world=st.integers(1, 4))
def test_torch_loads_the_reference_and_the_reference_loads_torch(
    model: list[Entry], world: int
) -> None:
    with tempfile.TemporaryDirectory() as ref, tempfile.TemporaryDirectory() as torch_dir:
        _save("reference", model, world, ref)
        sd = state_for(model, 1, 0, zeros=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tdcp.load(sd, checkpoint_id=ref, no_dist=True)
            check_loaded(model, 1, 0, sd)
            tdcp.save(state_for(model, 1, 0), checkpoint_id=torch_dir, no_dist=True)
        for rank, loaded in enumerate(_load("reference", model, world, torch_dir)):
            check_loaded(model, world, rank, loaded)


@st.composite
def _disagreeing(draw: st.DrawFn) -> tuple[int, int, str]:
    world = draw(st.integers(2, 4))
    return (
        world,
        draw(st.integers(0, world - 1)),
        draw(st.sampled_from(("dtype", "shape", "kind", "value"))),
    )


@pytest.mark.spec("REF-3", "DEDUP-4", "DEDUP-13", "META-4", "META-5")
@given(case=_disagreeing())
def test_both_refuse_the_same_disagreeing_replicas(case: tuple[int, int, str]) -> None:
    world, odd, how = case

    def state(rank: int) -> dict[str, Any]:
        x: Any = torch.ones(2, 3)
        if rank == odd:
            x = {
                "dtype": torch.ones(2, 3, dtype=torch.float64),
                "shape": torch.ones(3, 2),
                "kind": "not a tensor",
                "value": torch.zeros(2, 3),
            }[how]
        return {"ok": torch.ones(4), "x": x}

    messages = {}
    for impl, api in IMPLS.items():
        with tempfile.TemporaryDirectory() as path:
            with pytest.raises(refdcp.CheckpointError) as info:
                FakeWorld(world).run(
                    lambda c, api=api, path=path: api.save(
                        state(c.rank), checkpoint_id=path, comm=c
                    )
                )
            assert info.value.committed is False
            (failure,) = info.value.rank_failures.values()
            assert isinstance(failure.exception, refdcp.planning.PlanValidationError)
            messages[impl] = failure.exception.problems
    named = {impl: {"'x'" in p for p in problems} for impl, problems in messages.items()}
    assert named["fast"] == named["reference"] == {True}


@pytest.mark.spec("REF-4", "RESHARD-1", "RESHARD-2", "RESHARD-3")
@given(cases())
def test_reference_reads_equal_the_default_planners(case: Any) -> None:
    shape, saved, targets = case
    md = TensorStorageMetadata(
        TensorProperties(dtype=torch.float32),
        torch.Size(shape),
        [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in saved],
    )
    wanted = [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in targets]

    def boxes(reads: list[Any]) -> set[Any]:
        return {
            (
                r.dest_index.index,
                tuple(r.dest_offsets),
                tuple(r.storage_index.offset),
                tuple(r.storage_offsets),
                tuple(r.lengths),
            )
            for r in reads
        }

    fast = read_items_for_chunks("t", md, wanted)
    ref = [r for i, t in enumerate(wanted) for r in reads_for_chunk("t", i, t, md.chunks)]
    assert boxes(ref) == boxes(fast)
    assert len(ref) == len(fast)


@pytest.mark.spec("REF-4", "DEDUP-6")
@given(t=tensors())
def test_tensor_checksums_equal(t: torch.Tensor) -> None:
    assert value_checksum(t) == tensor_checksum(t)
    assert value_checksum(expected(t)) == tensor_checksum(t)


_objects = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=4) | st.floats(allow_nan=False),
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(st.text(max_size=3), inner, max_size=3)
        | st.frozensets(st.integers(), max_size=3)
    ),
    max_leaves=8,
)


@pytest.mark.spec("REF-4", "DEDUP-6")
@given(obj=_objects)
def test_object_checksums_equal(obj: Any) -> None:
    assert value_checksum(obj) == object_checksum(obj)


@pytest.mark.spec("REF-1", "API-2")
def test_a_single_rank_save_needs_no_world() -> None:
    model = [Entry("stateful", torch.float32, 2, 2, 0), Entry("nested", torch.int64, 3, 1, 1)]
    with tempfile.TemporaryDirectory() as path:
        refdcp.reference.save(state_for(model, 1, 0), checkpoint_id=path)
        sd = state_for(model, 1, 0, zeros=True)
        refdcp.reference.load(sd, checkpoint_id=path, comm=SingleRank())
        check_loaded(model, 1, 0, sd)


# -- planted bugs: each side's own mistake is caught (REF-3, REF-6) ---------------------------

_UNEVEN = [
    Entry("rows", torch.float32, 8, 3, 0),  # each rank's own bytes: unequal loads
    Entry("replicated", torch.float32, 4, 2, 1),
    Entry("replicated", torch.float64, 3, 3, 2),
    Entry("replicated", torch.int64, 2, 2, 3),
]


@pytest.mark.spec("REF-3", "DEDUP-2")
def test_a_most_loaded_holder_rule_planted_in_the_reference_is_caught(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from refdcp.reference import dedup

    def most_loaded(item: Any, ranks: list[int], loads: list[int], *_: Any) -> tuple[int, str]:
        return max(ranks, key=lambda r: (loads[r], -r)), "planted: most loaded"

    with tempfile.TemporaryDirectory() as fast, tempfile.TemporaryDirectory() as ref:
        _save("fast", _UNEVEN, 3, fast)
        _save("reference", _UNEVEN, 3, ref)
        a = refdcp.FileSystemReader(fast).read_metadata()
        assert _writers(a) == _writers(refdcp.reference.ReferenceReader(ref).read_metadata())
    monkeypatch.setattr(dedup, "_choose_writer", most_loaded)
    with tempfile.TemporaryDirectory() as ref:
        _save("reference", _UNEVEN, 3, ref)
        b = refdcp.reference.ReferenceReader(ref).read_metadata()
        assert _writers(a) != _writers(b)  # the differential test's comparison sees it


@pytest.mark.spec("REF-6", "RESHARD-4")
def test_a_shifted_row_planted_in_the_fast_resharding_is_caught(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from refdcp.planning import resharding

    real = resharding._read

    def shifted(
        fqn: str, toff: Any, ti: int, soff: Any, si: int, dest: Any, stor: Any, n: Any
    ) -> Any:
        if stor and stor[0] > 0:
            stor = [stor[0] + 1, *stor[1:]]
        return real(fqn, toff, ti, soff, si, dest, stor, n)

    model = [Entry("rows", torch.float32, 9, 2, 0)]
    monkeypatch.setattr(resharding, "_read", shifted)
    with tempfile.TemporaryDirectory() as path:
        _save("fast", model, 2, path)
        for rank, sd in enumerate(_load("reference", model, 3, path)):  # the rule is untouched
            check_loaded(model, 3, rank, sd)
        with pytest.raises((AssertionError, refdcp.CheckpointError)):
            for rank, sd in enumerate(_load("fast", model, 3, path)):
                check_loaded(model, 3, rank, sd)
