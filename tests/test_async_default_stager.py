"""async_save's default stager: cached, bounded, releasable, still isolated (spec/staging.md ASYNC-30, ASYNC-31)."""

from __future__ import annotations

import itertools
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.distributed.checkpoint.metadata import Metadata

import refdcp
from refdcp.asyncsave.default_stager import MAX_SETS, default_stager
from refdcp.asyncsave.save import InFlightLimiter, async_save
from refdcp.staging.machine import State

#: Why this module runs on refdcp only (REF-6).
SINGLE_PATH = (
    "ASYNC-30/31 are refdcp.async_save's cached default stager; the reference stages a fresh "
    "copy and its release_staging_buffers frees nothing (REF-10, REF-12)"
)


def _state(value: float) -> dict[str, Any]:
    return {
        "a": torch.full((64,), value),
        "n": {"b": torch.full((3, 5), value, dtype=torch.float64)},
    }


def _nbytes(sd: dict[str, Any]) -> int:
    return 64 * 4 + 15 * 8


@pytest.mark.spec("ASYNC-30")
def test_same_structure_reuses_one_buffer_set(tmp_path: Path) -> None:
    refdcp.release_staging_buffers()
    pool = default_stager().pool
    assert pool is not None
    before = pool.allocations
    src = _state(1.0)
    for i in range(3):
        src["a"].fill_(float(i))
        async_save(src, checkpoint_id=str(tmp_path / f"c{i}"), no_dist=True).result(timeout=60)
        out = _state(-1.0)
        refdcp.load(out, checkpoint_id=str(tmp_path / f"c{i}"), no_dist=True)
        assert torch.equal(out["a"], torch.full((64,), float(i)))
    assert pool.allocations - before == 1  # one set, reused by the second and third save
    assert pool.held_bytes == _nbytes(src)  # between saves: exactly one snapshot
    assert len(pool.states()) == 1


@pytest.mark.spec("ASYNC-30")
def test_a_new_structure_evicts_within_the_bound(tmp_path: Path) -> None:
    refdcp.release_staging_buffers()
    pool = default_stager().pool
    assert pool is not None
    for i in range(MAX_SETS + 2):  # a different shape each time
        async_save(
            {"w": torch.ones(8 + i)}, checkpoint_id=str(tmp_path / f"s{i}"), no_dist=True
        ).result(timeout=60)
        assert len(pool.states()) <= MAX_SETS


@pytest.mark.spec("ASYNC-30", "ASYNC-8")
@given(values=st.lists(st.integers(-5, 5), min_size=2, max_size=4), mutate=st.booleans())
def test_default_stager_isolation_with_two_saves_in_flight(
    tmp_path_factory: pytest.TempPathFactory, values: list[int], mutate: bool
) -> None:
    """Every checkpoint holds its staging-time values; two saves in flight never share a buffer."""
    refdcp.release_staging_buffers()
    root = tmp_path_factory.mktemp("iso")
    pool = default_stager().pool
    assert pool is not None
    limiter = InFlightLimiter(max_in_flight=2, wait_timeout=60)
    gates: list[threading.Event] = []
    leased_ptrs: list[set[int]] = []

    def gated(sd: dict[str, Any], **kw: Any) -> Metadata:
        gate = threading.Event()
        gates.append(gate)
        leased_ptrs.append({t.data_ptr() for t in (sd["a"], sd["n"]["b"])})
        gate.wait(30)
        return refdcp.save(sd, **kw)

    src = _state(0.0)
    handles, expected = [], []
    for i, v in enumerate(values):
        src["a"].fill_(float(v))
        src["n"]["b"].fill_(float(v) * 2)
        expected.append({"a": src["a"].clone(), "b": src["n"]["b"].clone()})
        h = async_save(
            src, checkpoint_id=str(root / f"c{i}"), no_dist=True, limiter=limiter, save_fn=gated
        )
        h.staged.result(timeout=30)
        if mutate:  # training changes the source right after staging
            src["a"].add_(100.0)
            src["n"]["b"].mul_(-3.0)
        handles.append(h)
        if len(handles) >= 2:  # two in flight: open the older one's gate
            while len(gates) < len(handles) - 1:
                time.sleep(0.001)
            states = pool.states()
            assert sum(s is not State.IDLE and s is not State.RELEASED for s in states) <= 2
            gates[len(handles) - 2].set()
    while len(gates) < len(handles):
        time.sleep(0.001)
        for g in gates:
            g.set()
    for g in gates:
        g.set()
    for h in handles:
        h.result(timeout=60)
    # save i+1 was staged while save i was still in flight (its gate closed): no shared buffer
    for a, b in itertools.pairwise(leased_ptrs):
        assert not a & b
    for i, exp in enumerate(expected):
        out = _state(-1.0)
        refdcp.load(out, checkpoint_id=str(root / f"c{i}"), no_dist=True)
        assert torch.equal(out["a"], exp["a"]) and torch.equal(out["n"]["b"], exp["b"])


@pytest.mark.spec("ASYNC-31")
def test_release_frees_idle_buffers_and_keeps_those_in_flight(tmp_path: Path) -> None:
    refdcp.release_staging_buffers()
    pool = default_stager().pool
    assert pool is not None
    src = _state(2.0)
    async_save(src, checkpoint_id=str(tmp_path / "a"), no_dist=True).result(timeout=60)
    assert pool.held_bytes == _nbytes(src)
    assert refdcp.release_staging_buffers() == 0
    assert pool.held_bytes == 0 and pool.states() == []

    gate = threading.Event()

    def gated(sd: dict[str, Any], **kw: Any) -> Metadata:
        gate.wait(30)
        return refdcp.save(sd, **kw)

    h = async_save(src, checkpoint_id=str(tmp_path / "b"), no_dist=True, save_fn=gated)
    h.staged.result(timeout=30)
    src["a"].fill_(-7.0)
    assert refdcp.release_staging_buffers() == _nbytes(src)  # leased by the save in flight
    gate.set()
    h.result(timeout=60)
    out = _state(0.0)
    refdcp.load(out, checkpoint_id=str(tmp_path / "b"), no_dist=True)
    assert torch.equal(out["a"], torch.full((64,), 2.0))
    assert refdcp.release_staging_buffers() == 0
