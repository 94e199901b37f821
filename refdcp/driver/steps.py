"""The local steps of the save and load protocols: calls into planners, storage and Stateful.

Each protocol rank owns one context object. The machine names a step; the
driver calls ``ctx.run(step)``. Collectives read payloads with
``ctx.payload(slot)`` and store results with ``ctx.store(slot, value)``.
Planner and storage objects are any implementations of torch's ABCs
(API-3): refdcp's own, torch's, or a third party's.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadPlanner, SavePlan, SavePlanner
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter

from refdcp.errors import ProtocolError

__all__ = ["LoadContext", "SaveContext", "set_up_reader", "set_up_writer"]


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


@dataclass
class _Base:
    rank: int
    world_size: int
    coordinator: bool
    state_dict: dict[str, Any]
    slots: dict[str, Any] = field(default_factory=dict)

    def payload(self, slot: str) -> Any:
        return self.slots.get(slot)

    def store(self, slot: str, value: Any) -> None:
        self.slots[slot] = value

    def run(self, step: str) -> None:
        fn = getattr(self, "step_" + step, None)
        if fn is None:
            raise ProtocolError("PROTO-3", f"unknown local step {step!r}")
        fn()


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
        sd = {
            k: (v.state_dict() if isinstance(v, Stateful) else v)
            for k, v in self.state_dict.items()
        }
        self.slots["flat_state_dict"] = sd
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
        set_up_writer(self.writer, self.coordinator, self.rank, self.use_collectives)

    def step_local_plan(self) -> None:
        assert self.planner is not None and self.writer is not None
        plan = self.planner.create_local_plan()
        self.slots["local_plan"] = self.writer.prepare_local_plan(plan)

    def step_global_plan(self) -> None:
        """Coordinator: global plan and metadata, then the writer's global step (SAVE-3)."""
        assert self.planner is not None and self.writer is not None
        all_plans: list[SavePlan] = self.slots["all_plans"]
        plans, metadata = self.planner.create_global_plan(all_plans)
        plans = _expect_plans(plans, self.world_size, "SavePlanner.create_global_plan")
        plans = _expect_plans(
            self.writer.prepare_global_plan(plans),
            self.world_size,
            "StorageWriter.prepare_global_plan",
        )
        self.slots["global_plans"] = plans
        self.slots["metadata"] = metadata

    def step_finish_plan(self) -> None:
        assert self.planner is not None
        self.slots["final_plan"] = self.planner.finish_plan(self.slots["central_plan"])

    def step_write(self) -> None:
        """Write this rank's items and wait for the results (SAVE-5)."""
        assert self.planner is not None and self.writer is not None
        fut = self.writer.write_data(self.slots["final_plan"], self.planner)
        fut.wait()
        self.slots["write_results"] = fut.value()

    def step_commit(self) -> None:
        """Coordinator: ``StorageWriter.finish``; its return is the commit point (SAVE-6)."""
        assert self.writer is not None
        metadata: Metadata = self.slots["metadata"]
        self.writer.finish(metadata=metadata, results=self.slots["all_results"])

    def result(self, slot: str) -> Any:
        return self.slots.get(slot)


@dataclass
class LoadContext(_Base):
    """One rank's load: the reader, the planner, and the Stateful bookkeeping."""

    reader_factory: Callable[[], StorageReader] | None = None
    reader: StorageReader | None = None
    planner: LoadPlanner | None = None
    checkpoint_id: Any = None
    verify: bool | None = None

    def step_set_up(self) -> None:
        """Stateful destinations, metadata, planner and reader set-up (LOAD-1, API-2)."""
        sd: dict[str, Any] = {}
        for key, value in self.state_dict.items():  # keys of any type, in the caller's order
            sd[key] = value.state_dict() if isinstance(value, Stateful) else value
        self.slots["flat_state_dict"] = sd
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
        metadata = self.reader.read_metadata()
        self.slots["metadata"] = metadata
        self.planner.set_up_planner(sd, metadata, self.coordinator)
        set_up_reader(self.reader, metadata, self.coordinator, self.rank)

    def step_local_plan(self) -> None:
        assert self.planner is not None and self.reader is not None
        self.slots["local_plan"] = self.reader.prepare_local_plan(self.planner.create_local_plan())

    def step_global_plan(self) -> None:
        assert self.planner is not None and self.reader is not None
        plans = _expect_plans(
            self.planner.create_global_plan(self.slots["all_plans"]),
            self.world_size,
            "LoadPlanner.create_global_plan",
        )
        self.slots["global_plans"] = _expect_plans(
            self.reader.prepare_global_plan(plans),
            self.world_size,
            "StorageReader.prepare_global_plan",
        )

    def step_finish_plan(self) -> None:
        assert self.planner is not None
        self.slots["final_plan"] = self.planner.finish_plan(self.slots["central_plan"])

    def step_read(self) -> None:
        """Read this rank's items into the destination state dict (LOAD-4)."""
        assert self.planner is not None and self.reader is not None
        self.reader.read_data(self.slots["final_plan"], self.planner).wait()
        self.slots["read_outcome"] = True

    def step_apply(self) -> None:
        """Hand loaded values to Stateful objects; replace other top-level values (LOAD-5, API-2)."""
        sd = self.slots["flat_state_dict"]
        for key, value in self.state_dict.items():
            if isinstance(value, Stateful):
                value.load_state_dict(sd[key])
            else:
                self.state_dict[key] = sd[key]
        self.slots["apply_outcome"] = True

    def result(self, slot: str) -> Any:
        return None
