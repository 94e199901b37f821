"""Which ranks raise when a save or load fails at each point (ERR-1, SAVE-9, PROTO-13).

The rule docs/guarantees.md states, checked at every fault point of every rank
in the simulator (worlds 2 and 3):

* a failure on any rank up to the coordinator's commit makes every rank raise,
  ``committed=False`` (ERR-1, SAVE-7);
* the coordinator's failure after the commit and before it broadcasts the
  outcome makes every rank raise, ``committed=True`` (SAVE-9);
* a peer's failure after it sent its write results, and any rank's fault after
  its own last action (the ``done --err--> failed`` row), raise on that rank
  alone, ``committed=True``; the others return (PROTO-13);
* a load failing at any point up to its last collective raises on every rank;
  a fault after a rank's last action raises on that rank alone.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner

from refdcp.driver import Fault, LoadContext, SaveContext, simulate
from refdcp.errors import CheckpointError
from refdcp.protocol import LOAD, SAVE, Kind
from refdcp.storage import MemoryStorage


def _state(rank: int) -> dict[str, Any]:
    return {"shared": torch.arange(6.0), f"own{rank}": torch.full((2,), float(rank)), "step": 3}


def _save_contexts(storage: MemoryStorage, world: int) -> list[SaveContext]:
    return [
        SaveContext(
            rank=r,
            world_size=world,
            coordinator=r == 0,
            state_dict=_state(r),
            writer=storage.writer(),
            planner=DefaultSavePlanner(),
        )
        for r in range(world)
    ]


def _load_contexts(storage: MemoryStorage, world: int) -> list[LoadContext]:
    return [
        LoadContext(
            rank=r,
            world_size=world,
            coordinator=r == 0,
            state_dict={"shared": torch.zeros(6), f"own{r}": torch.zeros(2), "step": 0},
            reader=storage.reader(),
            planner=DefaultLoadPlanner(),
        )
        for r in range(world)
    ]


def _expected_save(rank: int, index: int, actions: list[Any], world: int) -> tuple[set[int], bool]:
    """The ranks that raise and their commit status for a fault before ``actions[index]``."""
    names = [(a.kind, a.phase) for a in actions]
    everyone = set(range(world))
    if rank == 0:
        if index <= names.index((Kind.LOCAL, "commit")):
            return everyone, False
        if index <= names.index((Kind.BROADCAST, "broadcast_outcome")):
            return everyone, True  # the failure travels in the outcome broadcast (SAVE-9)
        return {0}, True  # after its last action: the done --err--> failed row (PROTO-13)
    if index <= names.index((Kind.GATHER, "gather_results")):
        return everyone, False
    return {rank}, True  # its results are sent: nobody else can learn of it (PROTO-13)


@pytest.mark.spec("ERR-1", "SAVE-9", "PROTO-13")
@pytest.mark.parametrize("world", [2, 3])
def test_who_raises_for_a_save_fault_at_every_point(world: int) -> None:
    clean = simulate(SAVE, _save_contexts(MemoryStorage(), world))
    assert not clean.errors()
    seen = set()
    for rank in range(world):
        actions = clean.actions[rank]
        for index in range(len(actions)):
            res = simulate(SAVE, _save_contexts(MemoryStorage(), world), fault=Fault(rank, index))
            raising, committed = _expected_save(rank, index, actions, world)
            errors = res.errors()
            assert set(errors) == raising, (rank, index, actions[index])
            for e in errors.values():
                assert isinstance(e, CheckpointError) and e.committed is committed, (rank, index)
            for r in set(range(world)) - raising:
                assert not isinstance(res.results[r], BaseException), (rank, index, r)
            seen.add((len(raising) == world, committed))
    assert seen == {(True, False), (True, True), (False, True)}


@pytest.mark.spec("ERR-1", "PROTO-13")
@pytest.mark.parametrize("world", [2, 3])
def test_who_raises_for_a_load_fault_at_every_point(world: int) -> None:
    storage = MemoryStorage()
    assert not simulate(SAVE, _save_contexts(storage, world)).errors()
    clean = simulate(LOAD, _load_contexts(storage, world))
    assert not clean.errors()
    for rank in range(world):
        last = len(clean.actions[rank]) - 1
        assert clean.actions[rank][last].kind is Kind.RETURN
        for index in range(last + 1):
            res = simulate(LOAD, _load_contexts(storage, world), fault=Fault(rank, index))
            expected = {rank} if index == last else set(range(world))
            assert set(res.errors()) == expected, (rank, index)
