"""Exhaustive fault injection in the simulator: no rank waits, nothing half-committed."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint import (
    DefaultLoadPlanner,
    DefaultSavePlanner,
    FileSystemReader,
    FileSystemWriter,
)
from torch.distributed.checkpoint.stateful import Stateful

from refdcp.driver import Fault, InjectedFault, LoadContext, SaveContext, simulate
from refdcp.errors import CheckpointError, ProtocolError
from refdcp.protocol import LOAD, SAVE, Kind


def rank_state(rank: int) -> dict[str, Any]:
    return {
        "shared": torch.arange(12, dtype=torch.float32).reshape(3, 4),
        f"own{rank}": torch.full((3,), float(rank), dtype=torch.bfloat16),
        "step": 7,
    }


def save_contexts(path: Path, world: int, **kw: Any) -> list[SaveContext]:
    return [
        SaveContext(
            rank=r,
            world_size=world,
            coordinator=r == 0,
            state_dict=kw.get("states", [rank_state(i) for i in range(world)])[r],
            writer=FileSystemWriter(str(path), sync_files=False),
            planner=DefaultSavePlanner(),
        )
        for r in range(world)
    ]


def load_back(path: Path, world: int) -> list[dict[str, Any]]:
    out = []
    for r in range(world):
        dest = {"shared": torch.zeros(3, 4), f"own{r}": torch.zeros(3, dtype=torch.bfloat16), "step": 0}
        import torch.distributed.checkpoint as tdcp

        tdcp.load(dest, storage_reader=FileSystemReader(str(path)), no_dist=True)
        out.append(dest)
    return out


def assert_equal_state(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
        else:
            assert a[k] == b[k], k


def commit_boundary(actions: list[Any], rank: int) -> int:
    """Index of the last action at which a fault on ``rank`` must still prevent the commit."""
    names = [(a.kind, a.phase) for a in actions]
    if rank == 0:
        return names.index((Kind.LOCAL, "commit"))
    return names.index((Kind.GATHER, "gather_results"))


@pytest.mark.spec("PROTO-5", "PROTO-7", "SAVE-6", "SAVE-7", "SAVE-8", "SAVE-9", "ERR-1", "ERR-4")
@pytest.mark.parametrize("world", [1, 2, 3])
def test_save_fault_at_every_action_of_every_rank(tmp_path: Path, world: int) -> None:
    clean = simulate(SAVE, save_contexts(tmp_path / "clean", world))
    assert not clean.errors()
    assert all(m == clean.results[0] for m in clean.results)  # SAVE-8
    cases = 0
    for rank in range(world):
        n_actions = len(clean.actions[rank])
        boundary = commit_boundary(clean.actions[rank], rank)
        for index in range(n_actions):  # the last index is "after the final action"
            path = tmp_path / f"r{rank}i{index}"
            res = simulate(SAVE, save_contexts(path, world), fault=Fault(rank, index))  # no Deadlock
            committed = (path / ".metadata").exists()
            errors = res.errors()
            if index <= boundary:
                assert not committed, (rank, index)
                assert set(errors) == set(range(world)), (rank, index, res.results)
                first = errors[0]
                assert isinstance(first, CheckpointError)
                for e in errors.values():
                    assert isinstance(e, CheckpointError) and not e.committed
                    assert e.rank_failures.keys() == first.rank_failures.keys()
                    assert e.step == first.step
                assert rank in first.rank_failures
                assert isinstance(first.rank_failures[rank].exception, InjectedFault)
                msg = str(first)
                assert f"rank {rank}" in msg and first.steps[rank] in msg and "nothing was committed" in msg
            else:
                assert committed, (rank, index)
                for e in errors.values():
                    assert isinstance(e, CheckpointError) and e.committed, (rank, index, e)
                    assert "WAS committed" in str(e)
                for r, got in enumerate(load_back(path, world)):
                    assert_equal_state(got, rank_state(r))
            cases += 1
    assert cases >= world * 8


class Counter(Stateful):
    def __init__(self, value: int, fail_on_load: bool = False) -> None:
        self.value = value
        self.loaded: list[int] = []
        self.fail_on_load = fail_on_load

    def state_dict(self) -> dict[str, Any]:
        return {"value": torch.tensor(self.value)}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        if self.fail_on_load:
            raise RuntimeError("cannot apply")
        self.loaded.append(int(sd["value"]))


def load_contexts(path: Path, world: int, counters: list[Counter]) -> list[LoadContext]:
    return [
        LoadContext(
            rank=r,
            world_size=world,
            coordinator=r == 0,
            state_dict={"shared": torch.zeros(3, 4), "counter": counters[r]},
            reader=FileSystemReader(str(path)),
            planner=DefaultLoadPlanner(),
        )
        for r in range(world)
    ]


@pytest.mark.spec("PROTO-5", "PROTO-7", "LOAD-5", "LOAD-6", "ERR-1")
@pytest.mark.parametrize("world", [1, 2, 3])
def test_load_fault_at_every_action_of_every_rank(tmp_path: Path, world: int) -> None:
    src = tmp_path / "ckpt"
    states = [{"shared": torch.arange(12.0).reshape(3, 4), "counter": Counter(5)} for _ in range(world)]
    assert not simulate(SAVE, save_contexts(src, world, states=states)).errors()
    counters = [Counter(0) for _ in range(world)]
    clean = simulate(LOAD, load_contexts(src, world, counters))
    assert not clean.errors() and all(c.loaded == [5] for c in counters)
    for rank in range(world):
        names = [(a.kind, a.phase) for a in clean.actions[rank]]
        read_agreed = names.index((Kind.ALL_GATHER, "gather_read"))
        for index in range(len(clean.actions[rank])):
            counters = [Counter(0) for _ in range(world)]
            res = simulate(LOAD, load_contexts(src, world, counters), fault=Fault(rank, index))
            errors = res.errors()
            after_end = index == len(clean.actions[rank]) - 1
            assert set(errors) == ({rank} if after_end else set(range(world))), (rank, index)
            assert all(isinstance(e, CheckpointError) for e in errors.values())
            if index <= read_agreed:  # LOAD-5: failed before reads were agreed: nobody applied
                assert all(c.loaded == [] for c in counters), (rank, index)


@pytest.mark.spec("LOAD-6", "ERR-1")
def test_load_state_dict_failure_on_one_rank_fails_every_rank(tmp_path: Path) -> None:
    src = tmp_path / "ckpt"
    states = [{"shared": torch.arange(12.0).reshape(3, 4), "counter": Counter(5)} for _ in range(2)]
    assert not simulate(SAVE, save_contexts(src, 2, states=states)).errors()
    counters = [Counter(0), Counter(0, fail_on_load=True)]
    res = simulate(LOAD, load_contexts(src, 2, counters))
    errs = res.errors()
    assert set(errs) == {0, 1}
    assert all(isinstance(e, CheckpointError) and e.steps == {1: "apply"} for e in errs.values())


class Exploding(Stateful):
    def state_dict(self) -> dict[str, Any]:
        raise RuntimeError("state_dict exploded")

    def load_state_dict(self, sd: dict[str, Any]) -> None:  # pragma: no cover - never reached
        raise AssertionError


@pytest.mark.spec("SAVE-1", "ERR-1")
def test_stateful_state_dict_exception_on_one_rank_fails_all(tmp_path: Path) -> None:
    states: list[dict[str, Any]] = [rank_state(0), {**rank_state(1), "app": Exploding()}, rank_state(2)]
    res = simulate(SAVE, save_contexts(tmp_path, 3, states=states))
    errs = res.errors()
    assert set(errs) == {0, 1, 2}
    for e in errs.values():
        assert isinstance(e, CheckpointError)
        assert e.steps == {1: "set_up"} and "state_dict exploded" in str(e)
    assert not (tmp_path / ".metadata").exists()


class WrongPlanCount(DefaultSavePlanner):
    def create_global_plan(self, all_plans):  # type: ignore[no-untyped-def]
        plans, md = super().create_global_plan(all_plans)
        return plans[:-1], md


@pytest.mark.spec("PROTO-6")
def test_wrong_number_of_global_plans_is_a_protocol_failure(tmp_path: Path) -> None:
    ctxs = save_contexts(tmp_path, 2)
    ctxs[0].planner = WrongPlanCount()
    res = simulate(SAVE, ctxs)
    errs = res.errors()
    assert set(errs) == {0, 1}
    err = errs[1]
    assert isinstance(err, CheckpointError)
    assert isinstance(err.rank_failures[0].exception, ProtocolError)
    assert "PROTO-6" in str(err)
    assert not os.path.exists(tmp_path / ".metadata")
