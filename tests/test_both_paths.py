"""The shared property suites, run against both ``refdcp`` and ``refdcp.reference`` (REF-6).

As CPython runs one decimal test suite over ``_decimal`` and ``_pydecimal``,
every property here takes the ``impl`` fixture (tests/conftest.py) and is checked
on the fast default path and on the readable reference path: round trips across
world sizes with resharding, dedup (exactly one writer per replicated chunk),
replicas that disagree, staging isolation and corruption detection. A failure on any rank at any step is checked
exhaustively, on both, in test_protocol_faults.py.
"""

from __future__ import annotations

import math
import os
import tempfile
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import refdcp
from refdcp.comm import FakeWorld
from refdcp.errors import CheckpointError

from ._both import Entry, check_loaded, models, state_for


def _save(impl: ModuleType, model: list[Entry], world: int, path: str, **kw: Any) -> list[Any]:
    return FakeWorld(world).run(
        lambda c: impl.save(state_for(model, world, c.rank), checkpoint_id=path, comm=c, **kw)
    )


def _load(
    impl: ModuleType, model: list[Entry], world: int, path: str, **kw: Any
) -> list[dict[str, Any]]:

    def one(c: Any) -> dict[str, Any]:
        sd = state_for(model, world, c.rank, zeros=True)
        impl.load(sd, checkpoint_id=path, comm=c, **kw)
        return sd

    return FakeWorld(world).run(one)


@pytest.mark.spec("REF-6", "RESHARD-4", "API-2", "FLAT-1", "PLAN-1")
@given(model=models(), w_save=st.integers(1, 4), w_load=st.integers(1, 4))
def test_round_trip_across_world_sizes(
    impl: ModuleType, model: list[Entry], w_save: int, w_load: int
) -> None:
    with tempfile.TemporaryDirectory() as path:
        _save(impl, model, w_save, path)
        for rank, sd in enumerate(_load(impl, model, w_load, path)):
            check_loaded(model, w_load, rank, sd)


def _writers(path: str) -> dict[tuple[str, tuple[int, ...]], list[str]]:
    """For every stored chunk, the files holding it, read back from the committed metadata."""
    md = refdcp.FileSystemReader(path).read_metadata()
    out: dict[tuple[str, tuple[int, ...]], list[str]] = {}
    for index, info in md.storage_data.items():
        out.setdefault((index.fqn, tuple(index.offset or ())), []).append(info.relative_path)
    return out


@pytest.mark.spec("REF-6", "DEDUP-1", "DEDUP-5", "META-1")
@given(model=models(), world=st.integers(1, 4))
def test_each_chunk_is_stored_once_by_one_rank(
    impl: ModuleType, model: list[Entry], world: int
) -> None:
    with tempfile.TemporaryDirectory() as path:
        _save(impl, model, world, path)
        md = refdcp.FileSystemReader(path).read_metadata()
        stored = _writers(path)
        chunks = {
            (fqn, tuple(c.offsets))
            for fqn, m in md.state_dict_metadata.items()
            for c in getattr(m, "chunks", [])
        }
        assert chunks <= set(stored)
        assert all(len(files) == 1 for files in stored.values())
        for e in (e for e in model if e.kind == "rows"):
            for (fqn, offsets), files in stored.items():
                if fqn == f"s{e.seed}":  # a shard is written by the rank that holds it
                    rank = offsets[0] // max(1, -(-e.rows // world))
                    assert files[0].startswith(f"__{rank}_"), (fqn, offsets, files)


@pytest.mark.spec("REF-6", "DEDUP-13", "SAVE-7", "STORE-3")
@given(world=st.integers(2, 4), odd=st.integers(0, 3), tensor=st.booleans())
def test_replicas_that_differ_fail_the_save_and_keep_the_old_checkpoint(
    impl: ModuleType, world: int, odd: int, tensor: bool
) -> None:
    odd %= world
    model = [Entry("replicated", torch.float32, 3, 2, 0)]
    with tempfile.TemporaryDirectory() as path:
        _save(impl, model, world, path)
        before = sorted(os.listdir(path))

        def differing(c: Any) -> Any:
            value: Any = torch.full((3, 2), float(c.rank == odd)) if tensor else [c.rank == odd, 1]
            sd = {"r0": torch.ones(3, 2), "x": value}
            return impl.save(sd, checkpoint_id=path, comm=c)

        with pytest.raises(CheckpointError) as info:  # the same error on every rank (ERR-1)
            FakeWorld(world).run(differing)
        error = info.value
        assert "'x'" in str(error) and "differ" in str(error)
        assert error.committed is False
        assert sorted(os.listdir(path)) == before  # nothing of the failed save is left
        for rank, sd in enumerate(_load(impl, model, world, path)):
            check_loaded(model, world, rank, sd)


@pytest.mark.spec("REF-6", "STAGE-6")
@given(model=models(max_entries=3))
def test_a_staged_copy_is_what_gets_saved(impl: ModuleType, model: list[Entry]) -> None:
    source = state_for(model, 1, 0)
    staged = refdcp.CpuStager().stage(source)
    for value in source.values():  # the training step changes the source after staging
        for t in _tensors(value):
            t.zero_() if t.dtype is not torch.bool else t.logical_not_()
    with tempfile.TemporaryDirectory() as path:
        impl.save(staged, checkpoint_id=path, comm=refdcp.comm.SingleRank())
        sd = state_for(model, 1, 0, zeros=True)
        impl.load(sd, checkpoint_id=path, comm=refdcp.comm.SingleRank())
        check_loaded(model, 1, 0, sd)


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, refdcp.LocalShards):
        return [t for _, t in value.chunks]
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    if hasattr(value, "state_dict"):
        return _tensors(value.state_dict())
    return []


@pytest.mark.spec("REF-6", "INTEG-3", "LOAD-10", "ERR-1")
@given(model=models(max_entries=3), world=st.integers(1, 3), where=st.integers(0, 10**6))
def test_a_flipped_byte_fails_the_load_on_every_rank(
    impl: ModuleType, model: list[Entry], world: int, where: int
) -> None:
    with tempfile.TemporaryDirectory() as path:
        _save(impl, model, world, path)
        md = refdcp.FileSystemReader(path).read_metadata()
        infos = [  # the items a load reads: objects and tensors with elements (RESHARD-3)
            info
            for index, info in md.storage_data.items()
            if math.prod(getattr(md.state_dict_metadata[index.fqn], "size", (1,))) > 0
        ]
        if not infos:
            return  # nothing is read, so nothing can be damaged
        info = infos[where % len(infos)]
        file = Path(path) / info.relative_path
        data = bytearray(file.read_bytes())
        data[info.offset + where % info.length] ^= 0x40
        file.write_bytes(bytes(data))
        with pytest.raises(CheckpointError) as err:  # the same error on every rank (ERR-1)
            _load(impl, model, world, path)
        text = str(err.value)
        assert "CorruptionError" in text and info.relative_path in text
