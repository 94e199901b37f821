"""The protocol tables against the code that runs them: steps, slots, literal rows (PROTO-10..12)."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint import DefaultSavePlanner

from refdcp.comm import SingleRank
from refdcp.driver import LoadContext, SaveContext, simulate
from refdcp.driver.run import drive
from refdcp.errors import CheckpointError, Failure, FailureReport, ProtocolError
from refdcp.protocol import LOAD, SAVE, Kind, On, State
from refdcp.protocol import load as load_module
from refdcp.protocol import save as save_module
from refdcp.protocol.machine import Event, Row, Table
from refdcp.protocol.names import Phase, Slot, Step
from refdcp.storage import MemoryStorage

PAIRS = [(SAVE, SaveContext), (LOAD, LoadContext)]


@pytest.mark.spec("PROTO-10")
@pytest.mark.parametrize(("table", "context"), PAIRS, ids=["save", "load"])
def test_table_steps_and_context_handlers_are_the_same_set(table: Table, context: type) -> None:
    assert set(context.HANDLERS) == set(table.steps)
    for step, handler in context.HANDLERS.items():
        assert isinstance(step, Step) and handler.__name__ == f"step_{step.value}"
    for row in table.rows:
        assert isinstance(row.phase, Phase) and isinstance(row.next, Phase)
        for slot in (row.send, row.recv):
            assert slot is None or isinstance(slot, Slot)


@pytest.mark.spec("PROTO-10")
def test_an_unknown_step_is_a_protocol_error() -> None:
    ctx = LoadContext(rank=0, world_size=1, coordinator=True, state_dict={})
    with pytest.raises(ProtocolError, match="PROTO-10"):
        ctx.run(Step.WRITE)


@pytest.mark.spec("PROTO-11")
def test_sending_an_empty_slot_raises_protocol_error_naming_it() -> None:
    ctx = SaveContext(rank=3, world_size=4, coordinator=False, state_dict={})
    with pytest.raises(ProtocolError, match="PROTO-11") as info:
        ctx.payload(Slot.WRITE_RESULTS)
    assert "write_results" in str(info.value) and "rank 3" in str(info.value)


class _ForgetsResults(SaveContext):
    """A context whose write step forgets to fill its slot: the gather must not send None."""

    def step_write(self) -> None:
        pass

    HANDLERS = {**SaveContext.HANDLERS, Step.WRITE: step_write}


@pytest.mark.spec("PROTO-11")
def test_a_step_that_leaves_its_slot_empty_fails_at_the_collective() -> None:
    ctx = _ForgetsResults(
        rank=0,
        world_size=1,
        coordinator=True,
        state_dict={"w": torch.ones(2)},
        writer=MemoryStorage().writer(),
        planner=DefaultSavePlanner(),
    )
    with pytest.raises(ProtocolError, match="write_results"):
        drive(SAVE, ctx, SingleRank())


@pytest.mark.spec("PROTO-12")
@pytest.mark.parametrize("module", [save_module, load_module], ids=["save", "load"])
def test_every_row_is_written_literally_one_per_line(module: Any) -> None:
    """The table is a list display of Row(...) calls in the module's source, one per line."""
    tree = ast.parse(Path(inspect.getsourcefile(module) or "").read_text(encoding="utf-8"))
    table, name = (SAVE, "SAVE_ROWS") if module is save_module else (LOAD, "LOAD_ROWS")
    lists = [
        node.value
        for node in tree.body
        if isinstance(node, ast.Assign)
        and isinstance(node.value, ast.List)
        and getattr(node.targets[0], "id", "") == name
    ]
    assert len(lists) == 1
    calls = lists[0].elts
    assert all(isinstance(c, ast.Call) and getattr(c.func, "id", "") == "Row" for c in calls)
    assert len({c.lineno for c in calls}) == len(calls) == len(table.rows)
    assert all(c.lineno == c.end_lineno for c in calls)


@pytest.mark.spec("PROTO-12", "SAVE-9", "PROTO-13")
@pytest.mark.parametrize("table", [SAVE, LOAD], ids=lambda t: t.name)
def test_fault_after_the_last_action_is_a_row_of_the_table(table: Table) -> None:
    row = table.lookup(Phase.DONE, On.ERR, True)
    assert row == table.lookup(Phase.DONE, On.ERR, False)
    assert row.kind is Kind.RAISE and row.next is Phase.FAILED
    failure = Failure(1, "done", RuntimeError("late"), "tb")
    state, action = table.transition(
        State(Phase.DONE, 1, False, committed=True), Event(On.ERR, failure=failure)
    )
    assert state.phase is Phase.FAILED and action.kind is Kind.RAISE and action.error is not None
    assert action.error.committed and dict(action.error.rank_failures) == {1: failure}


@pytest.mark.spec("PROTO-12")
def test_a_failed_rank_raises_where_the_row_says_return() -> None:
    failure = Failure(2, "broadcast_outcome", RuntimeError("x"), "tb")
    state = State(Phase.BROADCAST_OUTCOME, 2, False, failure=failure)
    _, action = SAVE.transition(state, Event(On.GOT_OK))
    assert SAVE.lookup(Phase.BROADCAST_OUTCOME, On.GOT_OK, False).kind is Kind.RETURN
    assert action.kind is Kind.RAISE and action.error is not None and action.error.committed


@pytest.mark.spec("PROTO-12", "PROTO-7", "PROTO-13")
def test_both_drivers_end_a_fault_after_the_last_action_the_same_way() -> None:
    def contexts() -> list[SaveContext]:
        return [
            SaveContext(
                rank=0,
                world_size=1,
                coordinator=True,
                state_dict={"w": torch.ones(2)},
                writer=MemoryStorage().writer(),
                planner=DefaultSavePlanner(),
            )
        ]

    clean = simulate(SAVE, contexts())
    last = len(clean.actions[0]) - 1
    assert clean.actions[0][last].kind is Kind.RETURN
    from refdcp.driver import Fault

    sim = simulate(SAVE, contexts(), fault=Fault(0, last)).results[0]

    def hook(index: int, action: Any) -> None:
        if index == last:
            raise RuntimeError("late")

    with pytest.raises(CheckpointError) as info:
        drive(SAVE, contexts()[0], SingleRank(), fault=hook)
    for err in (sim, info.value):
        assert isinstance(err, CheckpointError) and err.committed
        assert err.step == "done" and set(err.rank_failures) == {0}


def test_rows_reject_a_local_action_without_a_step() -> None:
    with pytest.raises(ValueError, match="malformed"):
        Row(Phase.IDLE, On.START, SAVE.rows[0].role, Phase.SET_UP, Kind.LOCAL)


@pytest.mark.spec("PROTO-12", "PROTO-13")
@pytest.mark.parametrize("table", [SAVE, LOAD], ids=lambda t: t.name)
def test_a_fault_on_a_rank_about_to_raise_joins_its_error(table: Table) -> None:
    agreed = FailureReport("write", {0: Failure(0, "write", OSError("disk"), "tb")})
    late = Failure(2, "failed", RuntimeError("late"), "tb")
    state = State(Phase.FAILED, 2, False, error=agreed)
    new, action = table.transition(state, Event(On.ERR, failure=late))
    assert new.phase is Phase.FAILED and action.kind is Kind.RAISE and action.error is not None
    assert dict(action.error.rank_failures) == {0: agreed.rank_failures[0], 2: late}
    assert action.error.step == "write"
