"""The local steps of the save and load protocols: calls into planners, storage and Stateful.

Each protocol rank owns one context object. The machine names a
:class:`~refdcp.protocol.names.Step`; the driver calls ``ctx.run(step)``, which
calls the handler its class's ``HANDLERS`` map names for it (PROTO-10).
Collectives read payloads with ``ctx.payload(slot)`` (a missing slot is a
:class:`~refdcp.errors.ProtocolError`, PROTO-11) and store results with
``ctx.store(slot, value)``.
Planner and storage objects are any implementations of torch's ABCs
(API-3): refdcp's own, torch's, or a third party's.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadPlanner, SavePlan, SavePlanner
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult

from refdcp.driver.rollback import Snapshot
from refdcp.errors import ProtocolError
from refdcp.planning import LoadPolicyError
from refdcp.protocol.names import Slot, Step
from refdcp.protocol.outcomes import finish_failed
from refdcp.storage.shared import shared_storage

__all__ = [
    "LoadContext",
    "RankResults",
    "SaveContext",
    "set_up_reader",
    "set_up_writer",
    "unwrap_stateful",
]


#: Exact types that are never ``Stateful``: checking them skips the runtime-protocol
#: ``isinstance``, which costs about 10 µs a value (every top-level value is checked).
_PLAIN_TYPES = frozenset(
    {torch.Tensor, torch.nn.Parameter, int, float, bool, str, bytes, type(None), dict, list, tuple}
)


def is_stateful(value: object) -> bool:
    """``isinstance(value, Stateful)``, answered at once for plain tensors and builtins (SAVE-1)."""
    return type(value) not in _PLAIN_TYPES and isinstance(value, Stateful)


def unwrap_stateful(state_dict: dict[Any, Any]) -> dict[Any, Any]:
    """Top-level ``Stateful`` values replaced by their ``state_dict()``, in key order (SAVE-1, LOAD-1)."""
    return {k: (v.state_dict() if is_stateful(v) else v) for k, v in state_dict.items()}


def _accepts_kwargs(fn: Callable[..., Any]) -> bool:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def set_up_writer(
    writer: StorageWriter, coordinator: bool, rank: int, use_collectives: bool = True
) -> None:
    """torch 2.13's call: rank and ``use_collectives`` only to writers taking ``**kwargs`` (SAVE-1)."""
    if _accepts_kwargs(writer.set_up_storage_writer):
        writer.set_up_storage_writer(coordinator, rank=rank, use_collectives=use_collectives)
    else:
        writer.set_up_storage_writer(coordinator)


def set_up_reader(reader: StorageReader, metadata: Metadata, coordinator: bool, rank: int) -> None:
    """The reader's counterpart of :func:`set_up_writer` (LOAD-1)."""
    if _accepts_kwargs(reader.set_up_storage_reader):
        reader.set_up_storage_reader(metadata, coordinator, rank=rank, use_collectives=True)
    else:
        reader.set_up_storage_reader(metadata, coordinator)


def _has_param(fn: Callable[..., Any], name: str) -> bool:
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def _expect_plans(plans: Any, world_size: int, who: str) -> list[Any]:
    if not isinstance(plans, list) or len(plans) != world_size:
        n = len(plans) if isinstance(plans, list) else type(plans).__name__
        raise ProtocolError(
            "PROTO-6", f"{who} must return one plan per rank ({world_size}), got {n}"
        )
    return plans


@dataclass(frozen=True)
class RankResults:
    """What a rank sends the coordinator once it has written (SAVE-5): its write
    results and, when its planner deferred them, its replica digests (DEDUP-17)."""

    results: list[WriteResult]
    replica_digests: Any = None  # what the planner's replica_digests_after_write returned


@dataclass
class _Base:
    rank: int
    world_size: int
    coordinator: bool
    state_dict: dict[str, Any]
    slots: dict[Slot, Any] = field(default_factory=dict)

    #: Step -> the method that runs it; the test checks it matches the table exactly (PROTO-10).
    HANDLERS: ClassVar[Mapping[Step, Callable[[Any], None]]] = {}

    def payload(self, slot: Slot) -> Any:
        """The value in ``slot``; a slot no step has filled is a ProtocolError (PROTO-11)."""
        try:
            return self.slots[slot]
        except KeyError:
            raise ProtocolError(
                "PROTO-11",
                f"rank {self.rank}: slot {str(slot)!r} holds no value "
                f"(filled so far: {sorted(map(str, self.slots))})",
            ) from None

    def store(self, slot: Slot, value: Any) -> None:
        self.slots[slot] = value

    def run(self, step: Step) -> None:
        handler = self.HANDLERS.get(step)
        if handler is None:
            raise ProtocolError("PROTO-10", f"{type(self).__name__} has no step {str(step)!r}")
        handler(self)

    def result(self, slot: Slot | None) -> Any:
        """What the machine's RETURN row names: a slot's value, or None (SAVE-8, LOAD-6)."""
        return None if slot is None else self.payload(slot)


@dataclass
class SaveContext(_Base):
    """One rank's save: the writer, the planner and the values that flow between steps."""

    writer_factory: Callable[[], StorageWriter] | None = None
    writer: StorageWriter | None = None
    planner: SavePlanner | None = None
    checkpoint_id: Any = None
    use_collectives: bool = True

    def step_set_up(self) -> None:
        """Stateful values, storage selection, planner and writer set-up (SAVE-1, API-2)."""
        sd = unwrap_stateful(self.state_dict)
        self.slots[Slot.FLAT_STATE_DICT] = sd
        if self.writer is None:
            assert self.writer_factory is not None
            self.writer = self.writer_factory()
        elif self.checkpoint_id is not None:
            self.writer.reset(self.checkpoint_id)
        assert self.planner is not None
        meta = self.writer.storage_meta()
        if _has_param(self.planner.set_up_planner, "storage_meta"):
            self.planner.set_up_planner(sd, meta, self.coordinator)
        else:
            self.planner.set_up_planner(sd, self.coordinator)  # type: ignore[arg-type]
        defer = getattr(self.planner, "defer_replica_digests", None)
        if defer is not None:  # this driver compares them before the commit (DEDUP-17)
            defer()
        set_up_writer(self.writer, self.coordinator, self.rank, self.use_collectives)

    def step_local_plan(self) -> None:
        assert self.planner is not None and self.writer is not None
        plan = self.planner.create_local_plan()
        self.slots[Slot.LOCAL_PLAN] = self.writer.prepare_local_plan(plan)

    def step_global_plan(self) -> None:
        """Coordinator: global plan and metadata, then the writer's global step (SAVE-3)."""
        assert self.planner is not None and self.writer is not None
        all_plans: list[SavePlan] = self.slots[Slot.ALL_PLANS]
        plans, metadata = self.planner.create_global_plan(all_plans)
        plans = _expect_plans(plans, self.world_size, "SavePlanner.create_global_plan")
        plans = _expect_plans(
            self.writer.prepare_global_plan(plans),
            self.world_size,
            "StorageWriter.prepare_global_plan",
        )
        self.slots[Slot.GLOBAL_PLANS] = plans
        self.slots[Slot.METADATA] = metadata

    def step_finish_plan(self) -> None:
        assert self.planner is not None
        self.slots[Slot.FINAL_PLAN] = self.planner.finish_plan(self.slots[Slot.CENTRAL_PLAN])

    def step_write(self) -> None:
        """Write this rank's items and wait for the results and the replica digests
        computed meanwhile (SAVE-5, DEDUP-17)."""
        assert self.planner is not None and self.writer is not None
        digests = getattr(self.planner, "replica_digests_after_write", None)
        try:
            fut = self.writer.write_data(self.slots[Slot.FINAL_PLAN], self.planner)
            fut.wait()
            results = fut.value()
        except BaseException:
            if digests is not None:  # the worker stops reading the values before we fail
                with contextlib.suppress(Exception):
                    digests(None)
            raise
        sums = digests(results) if digests is not None else None
        self.slots[Slot.WRITE_RESULTS] = RankResults(results, sums)

    def step_commit(self) -> None:
        """Coordinator: the replica digests sent with the results are compared (DEDUP-17),
        then ``StorageWriter.finish``, whose return is the commit point (SAVE-6)."""
        assert self.writer is not None
        metadata: Metadata = self.slots[Slot.METADATA]
        gathered: list[RankResults] = self.slots[Slot.ALL_RESULTS]
        sums = [g.replica_digests for g in gathered]
        check = getattr(self.planner, "check_replicas_after_write", None)
        if check is not None and any(s is not None for s in sums):
            check(sums)
        results = [g.results for g in gathered]
        try:
            self.writer.finish(metadata=metadata, results=results)
        except BaseException as exc:
            finish_failed(exc)  # it may have committed before raising (SAVE-16)
            raise

    HANDLERS: ClassVar[Mapping[Step, Callable[[Any], None]]] = {
        Step.SET_UP: step_set_up,
        Step.LOCAL_PLAN: step_local_plan,
        Step.GLOBAL_PLAN: step_global_plan,
        Step.FINISH_PLAN: step_finish_plan,
        Step.WRITE: step_write,
        Step.COMMIT: step_commit,
    }


@dataclass
class LoadContext(_Base):
    """One rank's load: the reader, the planner, and the Stateful bookkeeping."""

    reader_factory: Callable[[], StorageReader] | None = None
    reader: StorageReader | None = None
    planner: LoadPlanner | None = None
    checkpoint_id: Any = None
    verify: bool | None = None
    #: all-or-nothing (LOAD-21): what the load may change, copied before anything is read
    atomic: bool = False
    #: the communicator moves bytes through a device (NCCL): ``read_once="auto"`` stays off
    exchange_on_device: bool = False
    snapshot: Snapshot | None = None
    #: top-level keys whose ``Stateful.load_state_dict`` has run (LOAD-21 calls them again)
    applied: list[Any] = field(default_factory=list)

    def step_set_up(self) -> None:
        """Stateful destinations, metadata, planner and reader set-up (LOAD-1, API-2)."""
        sd = unwrap_stateful(self.state_dict)  # keys of any type, in the caller's order
        self.slots[Slot.FLAT_STATE_DICT] = sd
        if self.atomic:
            self.snapshot = Snapshot(self.state_dict, sd)
        if self.reader is None:
            assert self.reader_factory is not None
            self.reader = self.reader_factory()
        elif self.checkpoint_id is not None:
            self.reader.reset(self.checkpoint_id)
        set_verify = getattr(self.reader, "set_verify", None)
        if set_verify is not None:
            set_verify(self.verify)  # None: check what carries a checksum (LOAD-10)
        elif self.verify:
            raise ValueError(
                f"verify=True needs a reader with checksums; {type(self.reader).__name__} has none"
            )
        assert self.planner is not None
        if hasattr(self.planner, "apply_loaded_values"):
            deferring: Any = self.planner
            deferring.defer_nested_values = True  # placed at apply (LOAD-19)
        if hasattr(self.planner, "read_once_outgoing"):
            exchanging: Any = self.planner
            exchanging.exchange_read_once = True  # pieces ride in the read outcomes (ONCE-3)
            if getattr(exchanging, "read_once", None) == "auto":  # ONCE-9
                exchanging.shared_storage = (
                    None if self.exchange_on_device else shared_storage(self.reader)
                )
        metadata = self.reader.read_metadata()
        self.slots[Slot.METADATA] = metadata
        self.planner.set_up_planner(sd, metadata, self.coordinator)
        set_up_reader(self.reader, metadata, self.coordinator, self.rank)

    def step_local_plan(self) -> None:
        assert self.planner is not None and self.reader is not None
        try:
            plan = self.planner.create_local_plan()
        except LoadPolicyError as e:  # name the checkpoint it was checked against (API-23)
            where = self.checkpoint_id or getattr(self.reader, "checkpoint_id", None)
            if where is not None and e.checkpoint is None:
                e.name_checkpoint(str(where))
            raise
        self.slots[Slot.LOCAL_PLAN] = self.reader.prepare_local_plan(plan)

    def step_global_plan(self) -> None:
        assert self.planner is not None and self.reader is not None
        plans = _expect_plans(
            self.planner.create_global_plan(self.slots[Slot.ALL_PLANS]),
            self.world_size,
            "LoadPlanner.create_global_plan",
        )
        self.slots[Slot.GLOBAL_PLANS] = _expect_plans(
            self.reader.prepare_global_plan(plans),
            self.world_size,
            "StorageReader.prepare_global_plan",
        )

    def step_finish_plan(self) -> None:
        assert self.planner is not None
        self.slots[Slot.FINAL_PLAN] = self.planner.finish_plan(self.slots[Slot.CENTRAL_PLAN])

    def step_read(self) -> None:
        """Read this rank's items into the destination state dict (LOAD-4)."""
        assert self.planner is not None and self.reader is not None
        self.reader.read_data(self.slots[Slot.FINAL_PLAN], self.planner).wait()
        outgoing = getattr(self.planner, "read_once_outgoing", None)
        sent = outgoing(self.verify) if outgoing is not None else None  # ONCE-3
        self.slots[Slot.READ_OUTCOME] = True if sent is None else sent

    def step_apply(self) -> None:
        """Hand loaded values to Stateful objects; replace other top-level values (LOAD-5, API-2)."""
        sd = self.slots[Slot.FLAT_STATE_DICT]
        receive = getattr(self.planner, "read_once_receive", None)
        if receive is not None:  # the boxes other ranks read for this one (ONCE-3)
            receive(self.slots.pop(Slot.READ_OUTCOMES), self.verify)
        place = getattr(self.planner, "apply_loaded_values", None)
        if place is not None:
            place()  # nested non-tensor values (LOAD-19)
        for key, value in self.state_dict.items():
            if is_stateful(value):
                self.applied.append(key)
                value.load_state_dict(sd[key])
            else:
                self.state_dict[key] = sd[key]
        self.slots[Slot.APPLY_OUTCOME] = True

    def roll_back(self) -> list[str]:
        """After a failed all-or-nothing load: leave every destination as it was (LOAD-21);
        a line for each ``Stateful`` that refused its old state."""
        if self.snapshot is None:
            return []
        return self.snapshot.restore(self.state_dict, self.applied)

    HANDLERS: ClassVar[Mapping[Step, Callable[[Any], None]]] = {
        Step.SET_UP: step_set_up,
        Step.LOCAL_PLAN: step_local_plan,
        Step.GLOBAL_PLAN: step_global_plan,
        Step.FINISH_PLAN: step_finish_plan,
        Step.READ: step_read,
        Step.APPLY: step_apply,
    }
