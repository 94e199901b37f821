"""One rank's save or load on the reference path: the drive loop and the step bodies (REF-1).

The protocol tables (:mod:`refdcp.protocol`: ``SAVE`` and ``LOAD``) say what a
rank does next; this module does it, and nothing more (Rule 1, PROTO-2).
:func:`drive` asks the table for an action, performs it, and feeds what
happened back as the next event:

* a LOCAL action calls one step of :class:`SaveSteps` or :class:`LoadSteps`:
  what a rank does with the planner, the storage and ``Stateful`` values,
  through torch's ABCs only, so any planner or storage works (API-3);
* a collective goes through the :class:`~refdcp.comm.base.Communicator`; what
  a rank sends, what a delivered value means and what a failed collective
  reports are the protocol's answers (:mod:`refdcp.protocol.outcomes`);
* RETURN and RAISE end the run.

The steps pass values to each other and to the collectives in ``slots``, under
the names the tables use (:class:`~refdcp.protocol.names.Slot`).
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed._shard.sharded_tensor.api import ShardedTensor
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadPlanner, SavePlanner
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter

from refdcp.comm.base import Communicator
from refdcp.errors import CheckpointError, CommError, Failure, ProtocolError
from refdcp.planning.errors import LoadPolicyError
from refdcp.protocol.machine import FAN_IN, Action, Event, Kind, On, State, Table
from refdcp.protocol.names import Slot, Step

from ._outcomes_tmp import (  # TODO: refdcp.protocol.outcomes
    NOTHING,
    comm_failure,
    delivered,
    finish_failed,
    needs_payload,
    outgoing,
)
from .load_planner import ReferenceLoadPlanner

__all__ = ["FaultHook", "LoadSteps", "Observer", "SaveSteps", "Snapshot", "StepRecord", "drive"]


@dataclass(frozen=True)
class StepRecord:
    """What one rank did at its ``index``-th action, and the event that came of it (TRACE-1)."""

    rank: int
    index: int
    phase: str
    kind: Kind
    step: str
    outcome: On
    seconds: float


#: Called before action ``index`` of a rank; raising injects a fault there (PROTO-7).
FaultHook = Callable[[int, Action], None]
Observer = Callable[[StepRecord], None]


class Steps:
    """The local steps of one rank and the values they hand on, by slot (PROTO-10)."""

    def __init__(self, rank: int, world_size: int, coordinator: bool, state_dict: Any) -> None:
        self.rank, self.world_size, self.coordinator = rank, world_size, coordinator
        self.state_dict = state_dict
        self.slots: dict[Slot, Any] = {}

    def run(self, step: Step) -> None:
        """Do ``step``: the method of the step's name, ``set_up`` for ``Step.SET_UP`` (PROTO-10)."""
        getattr(self, step.value)()


def drive(
    table: Table,
    steps: Steps,
    comm: Communicator,
    *,
    fault: FaultHook | None = None,
    observer: Observer | None = None,
) -> Any:
    """Run ``table`` on this rank to its end: its result, or its CheckpointError (PROTO-2, ERR-1).

    ``fault(i, action)`` runs before the rank's ``i``-th action while the rank
    holds no failure; an exception from it is one more ``err`` event (PROTO-7).
    A ``KeyboardInterrupt`` or ``SystemExit`` travels to the peers as a failure
    and is raised again once the protocol has ended (ERR-10).
    """
    state, action = table.start(comm.rank, comm.rank == comm.coordinator_rank)
    index, interrupt = 0, None
    while True:
        event = None
        if fault is not None and state.failure is None:
            try:
                fault(index, action)
            except BaseException as exc:
                interrupt = interrupt if isinstance(exc, Exception) else exc
                failure = Failure.capture(comm.rank, action.phase, exc)  # named as ERR-4 says
                event = Event(On.ERR, failure=failure)
        start = time.perf_counter()
        if event is None:
            if action.kind in (Kind.RETURN, Kind.RAISE) and interrupt is not None:
                raise interrupt
            if action.kind is Kind.RETURN:
                return None if action.send is None else steps.slots[action.send]
            if action.kind is Kind.RAISE:
                assert action.error is not None
                raise CheckpointError.from_report(action.error)
            if action.kind is Kind.LOCAL:
                event, stopped = _local(steps, action)
                interrupt = interrupt or stopped
            else:
                event = _collective(table, state, action, steps, comm)
        if observer is not None:
            seconds = time.perf_counter() - start
            phase, name = str(action.phase), action.name
            observer(StepRecord(state.rank, index, phase, action.kind, name, event.on, seconds))
        state, action = table.transition(state, event)
        index += 1


def _local(steps: Steps, action: Action) -> tuple[Event, BaseException | None]:
    """Run a local step: ``ok``, or ``err`` with the failure (and an interrupt to re-raise)."""
    assert action.step is not None
    try:
        steps.run(action.step)
    except Exception as exc:
        return Event(On.ERR, failure=Failure.capture(steps.rank, action.step, exc)), None
    except BaseException as exc:  # KeyboardInterrupt, SystemExit: peers hear of it (ERR-10)
        return Event(On.ERR, failure=Failure.capture(steps.rank, action.step, exc)), exc
    return Event(On.OK), None


def _collective(
    table: Table, state: State, action: Action, steps: Steps, comm: Communicator
) -> Event:
    """Send what the protocol says this rank sends; turn what arrives into the event (PROTO-4)."""
    assert action.send is not None and action.recv is not None  # every collective row names both
    coordinator = comm.rank == comm.coordinator_rank
    sends = action.kind in FAN_IN or coordinator  # at a fan-out only the coordinator sends
    payload = steps.slots[action.send] if sends and needs_payload(action) else None
    sent = outgoing(action, comm.world_size, payload) if sends else None
    collective = {
        Kind.GATHER: comm.gather,
        Kind.ALL_GATHER: comm.all_gather,
        Kind.SCATTER: comm.scatter,
        Kind.BROADCAST: comm.broadcast,
    }[action.kind]
    try:
        received = collective(sent)
    except CommError as exc:  # the collective itself failed: this rank ends now (COMM-5)
        report = comm_failure(table, state, action, comm.rank, comm.coordinator_rank, exc)
        raise CheckpointError.from_report(report) from exc
    receives = action.kind is not Kind.GATHER or coordinator
    event, value = delivered(state, action, received, receives)
    if value is not NOTHING:
        steps.slots[action.recv] = value
    return event


def unwrap_stateful(state_dict: dict[Any, Any]) -> dict[Any, Any]:
    """Top-level ``Stateful`` values replaced by their ``state_dict()``, in key order (SAVE-1, LOAD-1)."""
    return {k: v.state_dict() if isinstance(v, Stateful) else v for k, v in state_dict.items()}


def _takes_kwargs(method: Callable[..., Any]) -> bool:
    """torch 2.13 passes ``rank`` and ``use_collectives`` only to a storage taking ``**kwargs``."""
    params = inspect.signature(method).parameters.values()
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def _one_per_rank(plans: Any, world_size: int, who: str) -> list[Any]:
    """A global plan step must return one plan per rank (PROTO-6)."""
    if not isinstance(plans, list) or len(plans) != world_size:
        got = len(plans) if isinstance(plans, list) else type(plans).__name__
        raise ProtocolError(
            "PROTO-6", f"{who} must return one plan per rank ({world_size}), got {got}"
        )
    return plans


class SaveSteps(Steps):
    """One rank's save: set up, plan, write, commit (SAVE-1..SAVE-6)."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        coordinator: bool,
        state_dict: dict[str, Any],
        writer: StorageWriter,
        planner: SavePlanner,
        checkpoint_id: Any = None,
    ) -> None:
        super().__init__(rank, world_size, coordinator, state_dict)
        self.writer, self.planner, self.checkpoint_id = writer, planner, checkpoint_id

    def set_up(self) -> None:
        """``Stateful`` values become their state dicts; the planner and the writer learn
        this rank's role, with torch 2.13's calls (SAVE-1, API-2, API-5)."""
        state_dict = unwrap_stateful(self.state_dict)
        if self.checkpoint_id is not None:
            self.writer.reset(self.checkpoint_id)
        if "storage_meta" in inspect.signature(self.planner.set_up_planner).parameters:
            self.planner.set_up_planner(
                state_dict=state_dict,
                storage_meta=self.writer.storage_meta(),
                is_coordinator=self.coordinator,
            )
        else:  # a planner written before torch added storage_meta
            self.planner.set_up_planner(state_dict, self.coordinator)  # type: ignore[arg-type]
        if _takes_kwargs(self.writer.set_up_storage_writer):
            self.writer.set_up_storage_writer(
                self.coordinator, rank=self.rank, use_collectives=True
            )
        else:
            self.writer.set_up_storage_writer(self.coordinator)

    def local_plan(self) -> None:
        """This rank's plan, as the planner and then the writer make it (SAVE-2)."""
        plan = self.planner.create_local_plan()
        self.slots[Slot.LOCAL_PLAN] = self.writer.prepare_local_plan(plan)

    def global_plan(self) -> None:
        """Coordinator: every rank's plan and the metadata, from the planner, then the
        writer's global step (SAVE-3)."""
        plans, metadata = self.planner.create_global_plan(self.slots[Slot.ALL_PLANS])
        plans = _one_per_rank(plans, self.world_size, "SavePlanner.create_global_plan")
        plans = self.writer.prepare_global_plan(plans)
        who = "StorageWriter.prepare_global_plan"
        self.slots[Slot.GLOBAL_PLANS] = _one_per_rank(plans, self.world_size, who)
        self.slots[Slot.METADATA] = metadata

    def finish_plan(self) -> None:
        """The plan the coordinator sent this rank, finished by its planner (SAVE-4)."""
        self.slots[Slot.FINAL_PLAN] = self.planner.finish_plan(self.slots[Slot.CENTRAL_PLAN])

    def write(self) -> None:
        """This rank's items written; its write results kept for the coordinator (SAVE-5)."""
        written = self.writer.write_data(self.slots[Slot.FINAL_PLAN], self.planner)
        written.wait()
        self.slots[Slot.WRITE_RESULTS] = written.value()

    def commit(self) -> None:
        """Coordinator: ``StorageWriter.finish``; its return is the commit point (SAVE-6).
        If it raises, it may have passed the point first: the status is the writer's
        declared one, else unknown (SAVE-16)."""
        try:
            self.writer.finish(
                metadata=self.slots[Slot.METADATA], results=self.slots[Slot.ALL_RESULTS]
            )
        except BaseException as exc:
            finish_failed(exc)
            raise


class LoadSteps(Steps):
    """One rank's load: set up, plan, read, apply (LOAD-1..LOAD-6)."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        coordinator: bool,
        state_dict: dict[Any, Any],
        reader: StorageReader,
        planner: LoadPlanner,
        checkpoint_id: Any = None,
        verify: bool | None = None,
        atomic: bool = False,
    ) -> None:
        super().__init__(rank, world_size, coordinator, state_dict)
        self.reader, self.planner, self.checkpoint_id = reader, planner, checkpoint_id
        self.verify, self.atomic = verify, atomic
        self.snapshot: Snapshot | None = None
        self.applied: list[Any] = []  # top-level keys whose load_state_dict ran (LOAD-21)

    def set_up(self) -> None:
        """Destinations (``Stateful`` values' state dicts), the metadata, then the planner and
        the reader told this rank's role, with torch 2.13's calls (LOAD-1, API-2, API-6)."""
        state_dict = unwrap_stateful(self.state_dict)
        self.slots[Slot.FLAT_STATE_DICT] = state_dict
        if self.atomic:  # all or nothing: keep what the load may change (LOAD-21)
            self.snapshot = Snapshot(self.state_dict, state_dict)
        if self.checkpoint_id is not None:
            self.reader.reset(self.checkpoint_id)
        set_verify = getattr(self.reader, "set_verify", None)  # a reader that checks (API-6)
        if set_verify is not None:
            set_verify(self.verify)
        elif self.verify:
            name = type(self.reader).__name__
            raise ValueError(f"verify=True needs a reader with checksums; {name} has none")
        if isinstance(self.planner, ReferenceLoadPlanner):
            self.planner.defer_nested_values = True  # placed by apply (LOAD-19, REF-9)
        metadata = self.reader.read_metadata()
        self.slots[Slot.METADATA] = metadata
        self.planner.set_up_planner(state_dict, metadata, self.coordinator)
        if _takes_kwargs(self.reader.set_up_storage_reader):
            self.reader.set_up_storage_reader(
                metadata, self.coordinator, rank=self.rank, use_collectives=True
            )
        else:
            self.reader.set_up_storage_reader(metadata, self.coordinator)

    def local_plan(self) -> None:
        """This rank's reads, as the planner and then the reader make them (LOAD-2); a refused
        load names the checkpoint it was checked against (API-23)."""
        try:
            plan = self.planner.create_local_plan()
        except LoadPolicyError as exc:
            if exc.checkpoint is None and self.checkpoint_id is not None:
                exc.name_checkpoint(str(self.checkpoint_id))
            raise
        self.slots[Slot.LOCAL_PLAN] = self.reader.prepare_local_plan(plan)

    def global_plan(self) -> None:
        """Coordinator: the planner's, then the reader's global step (LOAD-3)."""
        plans = self.planner.create_global_plan(self.slots[Slot.ALL_PLANS])
        plans = _one_per_rank(plans, self.world_size, "LoadPlanner.create_global_plan")
        plans = self.reader.prepare_global_plan(plans)
        who = "StorageReader.prepare_global_plan"
        self.slots[Slot.GLOBAL_PLANS] = _one_per_rank(plans, self.world_size, who)

    def finish_plan(self) -> None:
        """The plan the coordinator sent this rank, finished by its planner (LOAD-4)."""
        self.slots[Slot.FINAL_PLAN] = self.planner.finish_plan(self.slots[Slot.CENTRAL_PLAN])

    def read(self) -> None:
        """This rank's items read into its destinations (LOAD-4)."""
        self.reader.read_data(self.slots[Slot.FINAL_PLAN], self.planner).wait()
        self.slots[Slot.READ_OUTCOME] = True

    def apply(self) -> None:
        """Every rank read all: nested values placed (LOAD-19), ``Stateful`` values given
        theirs, other top-level values replaced (LOAD-5, LOAD-6, API-2)."""
        loaded = self.slots[Slot.FLAT_STATE_DICT]
        if isinstance(self.planner, ReferenceLoadPlanner):
            self.planner.apply_loaded_values()
        for key, value in self.state_dict.items():
            if isinstance(value, Stateful):
                self.applied.append(key)
                value.load_state_dict(loaded[key])
            else:
                self.state_dict[key] = loaded[key]
        self.slots[Slot.APPLY_OUTCOME] = True

    def roll_back(self) -> list[str]:
        """After a failed all-or-nothing load, every destination as it was (LOAD-21); a line
        for each ``Stateful`` that refused its old state."""
        if self.snapshot is None:
            return []
        return self.snapshot.restore(self.state_dict, self.applied)


class Snapshot:
    """What a load may change, copied before anything is read (LOAD-21): a copy of every
    tensor it can write and of every dict's and list's contents, from the caller's state
    dict and its ``Stateful`` values' state dicts."""

    def __init__(self, state_dict: dict[Any, Any], destinations: dict[Any, Any]) -> None:
        self.tensors: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.containers: list[tuple[Any, Any]] = []
        self.destinations = destinations
        self.keep(state_dict)
        self.keep(destinations)

    def keep(self, value: Any) -> None:
        """Copy what a load may change in ``value``: its tensors' bytes, its containers'
        contents (a tensor or container reached twice is copied twice, and restored alike)."""
        if isinstance(value, dict):
            self.containers.append((value, dict(value)))
            inner = list(value.values())
        elif isinstance(value, list):
            self.containers.append((value, list(value)))
            inner = list(value)
        elif isinstance(value, tuple):
            inner = list(value)
        else:
            self.tensors += [(t, t.detach().clone()) for t in _written_memory(value)]
            inner = []
        for v in inner:
            self.keep(v)

    def restore(self, state_dict: dict[Any, Any], applied: list[Any]) -> list[str]:
        """Put every tensor and container back, then give each applied ``Stateful`` its
        restored state dict again; a line for each that refused it."""
        with torch.no_grad():
            for tensor, copy in self.tensors:
                tensor.detach().copy_(copy)
        for container, contents in self.containers:
            if isinstance(container, dict):
                container.clear()
                container.update(contents)
            else:
                container[:] = contents
        refused = []
        for key in applied:
            try:
                state_dict[key].load_state_dict(self.destinations[key])
            except Exception as exc:
                refused.append(f"atomic load: restoring {key!r} failed: {exc!r}")
        return refused


def _written_memory(value: Any) -> list[torch.Tensor]:
    """The tensors a load writes for ``value``: its chunks (torch's chunk protocol: DTensor,
    ``LocalShards``), its local shards, or the tensor itself (LOAD-21)."""
    if hasattr(value, "__create_chunk_list__"):
        chunks = value.__create_chunk_list__()
        return [
            value.__get_tensor_shard__(MetadataIndex("", c.offsets, i))
            for i, c in enumerate(chunks)
        ]
    if isinstance(value, ShardedTensor):
        return [s.tensor for s in value.local_shards()]
    return [value] if isinstance(value, torch.Tensor) else []
