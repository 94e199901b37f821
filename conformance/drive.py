"""Drive a backend through torch's DCP save/load protocol, one rank after another.

The suite plays every rank itself, in one thread, with torch's
``DefaultSavePlanner`` / ``DefaultLoadPlanner``: this gives it full control
over call order, arguments and fault injection (CONF-3, CONF-4, CONF-23).
The order is torch 2.13's, as spec/protocol.md's storage contracts list it
(PROTO-14, PROTO-15): set-up and local plans on every rank, the global plan on
the coordinator (rank 0), ``write_data`` on every rank, ``finish`` on the
coordinator only. A failure on any rank aborts the save before ``finish``,
as DCP does after gathering the failures.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    LoadPlanner,
    SavePlan,
    WriteItem,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from conformance.registry import tick
from refdcp.driver.steps import set_up_reader, set_up_writer

__all__ = [
    "SAVE_STEPS",
    "Fault",
    "InjectedFault",
    "SaveTrace",
    "clear_last_call",
    "last_call",
    "load_ranks",
    "save_ranks",
]

#: Save steps at which a fault can be injected, in protocol order.
SAVE_STEPS = (
    "set_up_storage_writer",
    "prepare_local_plan",
    "prepare_global_plan",
    "write_data",
    "write_data:inside",
    "finish",
    "finish:inside",
)


class InjectedFault(RuntimeError):
    """The exception the suite injects; a backend must let it surface (CONF-22)."""


@dataclass(frozen=True)
class Fault:
    """Raise :class:`InjectedFault` at ``step`` on ``rank``.

    ``write_data:inside`` raises from the planner while the backend is inside
    ``write_data``; ``finish:inside`` hands ``finish`` metadata that cannot be
    pickled; the other steps raise just before the backend's method is called.
    """

    step: str
    rank: int


@dataclass
class SaveTrace:
    """What a save returned, for the checks to inspect."""

    local_in: list[SavePlan] = field(default_factory=list)
    local_out: list[SavePlan] = field(default_factory=list)
    global_in: list[SavePlan] = field(default_factory=list)
    global_out: list[SavePlan] = field(default_factory=list)
    final_plans: list[SavePlan] = field(default_factory=list)
    futures: list[Any] = field(default_factory=list)
    results: list[list[WriteResult]] = field(default_factory=list)
    metadata: Metadata | None = None


class _Unpicklable:
    def __reduce__(self) -> Any:
        raise InjectedFault("injected: metadata cannot be serialised (finish:inside)")


class _FaultySavePlanner(DefaultSavePlanner):
    def resolve_data(self, write_item: WriteItem) -> Any:
        raise InjectedFault(f"injected: resolve_data({write_item.index.fqn}) failed")


_last = threading.local()


def _at(rank: int, call: str) -> None:
    """Note the backend call this thread is about to make, for :func:`last_call`."""
    _last.call = f"rank {rank}'s {call}"


def last_call() -> str:
    """The backend call this thread made last through the driver, e.g. "rank 1's read_data"
    (a reason names it, CONF-68); empty before any."""
    return str(getattr(_last, "call", ""))


def clear_last_call() -> None:
    """Forget this thread's last call (a new step begins)."""
    _last.call = ""


def _check(fault: Fault | None, step: str, rank: int) -> None:
    if fault is not None and fault.step == step and fault.rank == rank:
        raise InjectedFault(f"injected: {step} on rank {rank}")


def save_ranks(
    writers: Sequence[StorageWriter],
    state_dicts: Sequence[dict[str, Any]],
    *,
    checkpoint_id: Any = None,
    reset: bool = True,
    fault: Fault | None = None,
    before_finish: Callable[[], None] | None = None,
    trace: SaveTrace | None = None,
    save_planners: Sequence[DefaultSavePlanner] | None = None,
) -> Metadata:
    """Save ``state_dicts[r]`` through ``writers[r]`` for every rank r; return the metadata.

    With ``reset``, each writer first receives ``reset(checkpoint_id)``.
    ``before_finish`` runs after every rank's data is written and before the
    coordinator's ``finish`` (CONF-21). ``save_planners`` replaces torch's
    ``DefaultSavePlanner`` per rank (the coverage cases add chunk items, CONF-61).
    """
    tr = trace if trace is not None else SaveTrace()
    planners: list[DefaultSavePlanner] = []
    for rank, (writer, sd) in enumerate(zip(writers, state_dicts, strict=True)):
        coord = rank == 0
        tick()  # every call into the backend is progress for the watchdog (CONF-51)
        if reset:
            _at(rank, "reset")
            writer.reset(checkpoint_id)
        planner: DefaultSavePlanner
        if fault is not None and fault.step == "write_data:inside" and fault.rank == rank:
            planner = _FaultySavePlanner()
        elif save_planners is not None:
            planner = save_planners[rank]
        else:
            planner = DefaultSavePlanner()
        # torch 2.13's order (spec/protocol.md, writer contract): storage_meta, the
        # planner's set-up, then the writer's
        _at(rank, "storage_meta")
        storage_meta = writer.storage_meta()
        planner.set_up_planner(sd, storage_meta=storage_meta, is_coordinator=coord)
        _check(fault, "set_up_storage_writer", rank)
        _at(rank, "set_up_storage_writer")
        set_up_writer(writer, coord, rank)
        plan = planner.create_local_plan()
        tr.local_in.append(plan)
        _check(fault, "prepare_local_plan", rank)
        _at(rank, "prepare_local_plan")
        tr.local_out.append(writer.prepare_local_plan(plan))
        tick()
        planners.append(planner)
    global_plans, metadata = planners[0].create_global_plan(tr.local_out)
    tr.global_in = list(global_plans)
    _check(fault, "prepare_global_plan", 0)
    _at(0, "prepare_global_plan")
    tr.global_out = writers[0].prepare_global_plan(list(global_plans))
    tick()
    for rank, writer in enumerate(writers):
        final = planners[rank].finish_plan(tr.global_out[rank])
        tr.final_plans.append(final)
        _check(fault, "write_data", rank)
        tick()
        _at(rank, "write_data")
        fut = writer.write_data(final, planners[rank])
        tr.futures.append(fut)
        tr.results.append(fut.wait())
        tick()
    if before_finish is not None:
        before_finish()
    _check(fault, "finish", 0)
    if fault is not None and fault.step == "finish:inside":
        metadata.planner_data = _Unpicklable()
    tick()
    _at(0, "finish")
    writers[0].finish(metadata=metadata, results=tr.results)
    tick()
    tr.metadata = metadata
    return metadata


def load_ranks(
    readers: Sequence[StorageReader],
    state_dicts: Sequence[dict[str, Any]],
    *,
    checkpoint_id: Any = None,
    reset: bool = True,
    planners: Sequence[LoadPlanner] | None = None,
    plans_seen: list[tuple[list[LoadPlan], list[LoadPlan]]] | None = None,
) -> None:
    """Load into ``state_dicts[r]`` through ``readers[r]`` for every rank r, in place."""
    used: list[LoadPlanner] = []
    local: list[LoadPlan] = []
    local_in: list[LoadPlan] = []
    for rank, (reader, sd) in enumerate(zip(readers, state_dicts, strict=True)):
        coord = rank == 0
        tick()
        if reset:
            _at(rank, "reset")
            reader.reset(checkpoint_id)
        _at(rank, "read_metadata")
        metadata = reader.read_metadata()
        planner = planners[rank] if planners is not None else DefaultLoadPlanner()
        planner.set_up_planner(sd, metadata, coord)  # torch 2.13's order: planner, then reader
        _at(rank, "set_up_storage_reader")
        set_up_reader(reader, metadata, coord, rank)
        plan = planner.create_local_plan()
        local_in.append(plan)
        _at(rank, "prepare_local_plan")
        local.append(reader.prepare_local_plan(plan))
        tick()
        used.append(planner)
    global_in = used[0].create_global_plan(local)
    _at(0, "prepare_global_plan")
    global_out = readers[0].prepare_global_plan(list(global_in))
    if plans_seen is not None:
        plans_seen.append((local_in, local))
        plans_seen.append((list(global_in), list(global_out)))
    for rank, reader in enumerate(readers):
        final = used[rank].finish_plan(global_out[rank])
        tick()
        _at(rank, "read_data")
        fut: Future[None] = reader.read_data(final, used[rank])
        fut.wait()
        tick()
