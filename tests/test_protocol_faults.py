"""Exhaustive fault injection on both implementations (``impl``): no rank waits, nothing
half-committed.

A clean save or load under ``FakeWorld`` records every action each rank takes (the
``fault`` hook runs before each one, PROTO-7); then, for every rank and every action
index, the same save or load runs with a fault raised there on that rank alone. A save
goes over an earlier checkpoint, which stays as it was unless the new one commits.
"""

from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as tdcp
from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemReader
from torch.distributed.checkpoint.stateful import Stateful

from refdcp.comm import FakeWorld
from refdcp.driver import InjectedFault
from refdcp.errors import CheckpointError, ProtocolError
from refdcp.protocol import Kind


def rank_state(rank: int, generation: int = 0) -> dict[str, Any]:
    return {
        "shared": torch.arange(12, dtype=torch.float32).reshape(3, 4) + generation,
        f"own{rank}": torch.full((3,), float(rank + generation), dtype=torch.bfloat16),
        "step": 7 + generation,
    }


def load_back(path: Path, world: int) -> list[dict[str, Any]]:
    out = []
    for r in range(world):
        dest = {
            "shared": torch.zeros(3, 4),
            f"own{r}": torch.zeros(3, dtype=torch.bfloat16),
            "step": 0,
        }
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


class _Actions:
    """A fault hook that records each rank's actions (a clean run) or raises before one."""

    def __init__(self, world: int, at: tuple[int, int] | None = None) -> None:
        self.actions: list[list[Any]] = [[] for _ in range(world)]
        self.at = at
        self.lock = threading.Lock()

    def hook(self, rank: int) -> Any:
        def fault(index: int, action: Any) -> None:
            with self.lock:
                self.actions[rank].append(action)
            if self.at == (rank, index):
                raise InjectedFault("injected fault")

        return fault


def _run(world: int, body: Any, hooks: _Actions) -> list[Any]:
    """``body(comm, fault)`` on every rank; an exception takes its rank's place."""
    return FakeWorld(world, timeout=30).run(
        lambda c: body(c, hooks.hook(c.rank)), return_exceptions=True
    )


def _files(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


def commit_boundary(actions: list[Any], rank: int) -> int:
    """Index of the last action at which a fault on ``rank`` must still prevent the commit."""
    names = [(a.kind, a.phase) for a in actions]
    if rank == 0:
        return names.index((Kind.LOCAL, "commit"))
    return names.index((Kind.GATHER, "gather_results"))


def _saver(
    impl: ModuleType, path: Path, states: list[dict[str, Any]] | None = None, generation: int = 0
) -> Any:
    def body(comm: Any, fault: Any) -> Any:
        state = states[comm.rank] if states else rank_state(comm.rank, generation)
        return impl.save(state, checkpoint_id=path, comm=comm, fault=fault)

    return body


@pytest.mark.spec(
    "REF-6",
    "PROTO-5",
    "PROTO-7",
    "SAVE-6",
    "SAVE-7",
    "SAVE-8",
    "SAVE-9",
    "ERR-1",
    "ERR-4",
    "STORE-3",
    "STORE-31",
)
@pytest.mark.parametrize("world", [1, 2, 3])
def test_save_fault_at_every_action_of_every_rank(
    impl: ModuleType, tmp_path: Path, world: int
) -> None:
    old = tmp_path / "old"  # the earlier checkpoint every faulty save goes over
    clean = _Actions(world)
    results = _run(world, _saver(impl, old, generation=1), clean)
    assert all(m == results[0] for m in results)  # SAVE-8
    cases = 0
    for rank in range(world):
        boundary = commit_boundary(clean.actions[rank], rank)
        for index in range(len(clean.actions[rank])):
            path = tmp_path / f"r{rank}i{index}"
            shutil.copytree(old, path)
            before = _files(path)
            out = _run(world, _saver(impl, path), _Actions(world, (rank, index)))  # no hang
            errors = {r: e for r, e in enumerate(out) if isinstance(e, BaseException)}
            if index <= boundary:
                assert _files(path) == before, (rank, index)  # the old checkpoint, untouched
                assert set(errors) == set(range(world)), (rank, index, out)
                first = errors[0]
                assert isinstance(first, CheckpointError)
                for e in errors.values():
                    assert isinstance(e, CheckpointError) and not e.committed
                    assert e.rank_failures.keys() == first.rank_failures.keys()
                    assert e.step == first.step
                assert rank in first.rank_failures
                assert isinstance(first.rank_failures[rank].exception, InjectedFault)
                msg = str(first)
                assert f"rank {rank}" in msg and first.steps[rank] in msg
                assert "nothing was committed" in msg
            else:
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


def _loader(impl: ModuleType, path: Path, counters: list[Counter]) -> Any:
    def body(comm: Any, fault: Any) -> None:
        sd = {"shared": torch.zeros(3, 4), "counter": counters[comm.rank]}
        impl.load(sd, checkpoint_id=path, comm=comm, fault=fault)

    return body


def _saved(impl: ModuleType, path: Path, world: int) -> None:
    states = [{"shared": torch.arange(12.0).reshape(3, 4), "counter": Counter(5)}] * world
    out = _run(world, _saver(impl, path, states), _Actions(world))
    assert not any(isinstance(e, BaseException) for e in out), out


@pytest.mark.spec("PROTO-5", "PROTO-7", "LOAD-5", "LOAD-6", "ERR-1")
@pytest.mark.parametrize("world", [1, 2, 3])
def test_load_fault_at_every_action_of_every_rank(
    impl: ModuleType, tmp_path: Path, world: int
) -> None:
    src = tmp_path / "ckpt"
    _saved(impl, src, world)
    counters = [Counter(0) for _ in range(world)]
    clean = _Actions(world)
    out = _run(world, _loader(impl, src, counters), clean)
    assert out == [None] * world and all(c.loaded == [5] for c in counters)
    for rank in range(world):
        names = [(a.kind, a.phase) for a in clean.actions[rank]]
        read_agreed = names.index((Kind.ALL_GATHER, "gather_read"))
        for index in range(len(clean.actions[rank])):
            counters = [Counter(0) for _ in range(world)]
            out = _run(world, _loader(impl, src, counters), _Actions(world, (rank, index)))
            errors = {r: e for r, e in enumerate(out) if isinstance(e, BaseException)}
            after_end = index == len(clean.actions[rank]) - 1
            assert set(errors) == ({rank} if after_end else set(range(world))), (rank, index)
            assert all(isinstance(e, CheckpointError) for e in errors.values())
            if index <= read_agreed:  # LOAD-5: failed before reads were agreed: nobody applied
                assert all(c.loaded == [] for c in counters), (rank, index)


@pytest.mark.spec("LOAD-6", "ERR-1")
def test_load_state_dict_failure_on_one_rank_fails_every_rank(
    impl: ModuleType, tmp_path: Path
) -> None:
    src = tmp_path / "ckpt"
    _saved(impl, src, 2)
    counters = [Counter(0), Counter(0, fail_on_load=True)]
    errs = _run(2, _loader(impl, src, counters), _Actions(2))
    assert all(isinstance(e, CheckpointError) and e.steps == {1: "apply"} for e in errs), errs


class Exploding(Stateful):
    def state_dict(self) -> dict[str, Any]:
        raise RuntimeError("state_dict exploded")

    def load_state_dict(self, sd: dict[str, Any]) -> None:  # pragma: no cover - never reached
        raise AssertionError


@pytest.mark.spec("SAVE-1", "ERR-1")
def test_stateful_state_dict_exception_on_one_rank_fails_all(
    impl: ModuleType, tmp_path: Path
) -> None:
    states: list[dict[str, Any]] = [
        rank_state(0),
        {**rank_state(1), "app": Exploding()},
        rank_state(2),
    ]
    errs = _run(3, _saver(impl, tmp_path, states), _Actions(3))
    for e in errs:
        assert isinstance(e, CheckpointError)
        assert e.steps == {1: "set_up"} and "state_dict exploded" in str(e)
    assert not (tmp_path / ".metadata").exists()


class WrongPlanCount(DefaultSavePlanner):
    def create_global_plan(self, all_plans):  # type: ignore[no-untyped-def]
        plans, md = super().create_global_plan(all_plans)
        return plans[:-1], md


@pytest.mark.spec("PROTO-6")
def test_wrong_number_of_global_plans_is_a_protocol_failure(
    impl: ModuleType, tmp_path: Path
) -> None:
    def body(comm: Any, fault: Any) -> Any:
        planner = WrongPlanCount() if comm.rank == 0 else DefaultSavePlanner()
        state = rank_state(comm.rank)
        return impl.save(state, checkpoint_id=tmp_path, comm=comm, planner=planner, fault=fault)

    errs = _run(2, body, _Actions(2))
    assert all(isinstance(e, CheckpointError) for e in errs), errs
    err = errs[1]
    assert isinstance(err.rank_failures[0].exception, ProtocolError)
    assert "PROTO-6" in str(err)
    assert not os.path.exists(tmp_path / ".metadata")
