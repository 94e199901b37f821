"""Where a background save runs: the executor strategies of ``async_save`` (ASYNC-7, STAGE-20).

``async_save`` picks one executor once (:func:`executor_for`) and asks it
for a :class:`Plan`: the function the background job calls with the staged
state dict, and the Communicator its collectives use in this process. The
executor never calls ``async_save``; ``async_save`` does the staging, the
in-flight limit and the handle for both.

* :class:`ThreadExecutor`: a background thread calls ``refdcp.save`` over a
  dedicated checkpoint group (ASYNC-6).
* :class:`ProcessExecutor`: the background thread forwards the snapshot to a
  worker process (:mod:`refdcp.asyncsave.process_executor`), whose own
  process group runs the collectives; nothing collective happens here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata

from refdcp.api import save
from refdcp.asyncsave.groups import REGISTRY
from refdcp.comm.base import Communicator

__all__ = ["Executor", "Plan", "ProcessExecutor", "SaveFn", "ThreadExecutor", "executor_for"]

SaveFn = Callable[..., Metadata]


@dataclass(frozen=True)
class Plan:
    """What the background job does: ``save_fn(staged, checkpoint_id=..., storage_writer=...,
    planner=..., comm=comm)`` (or ``no_dist=True`` when ``comm`` is None)."""

    save_fn: SaveFn
    comm: Communicator | None


class Executor(Protocol):
    name: str

    def plan(
        self,
        *,
        comm: Communicator | None,
        process_group: Any,
        no_dist: bool,
        save_fn: SaveFn | None,
    ) -> Plan: ...


def _distributed(no_dist: bool) -> bool:
    return not no_dist and dist.is_available() and dist.is_initialized()


class ThreadExecutor:
    """Save on a background thread of this process (ASYNC-1, ASYNC-6)."""

    name = "thread"

    def plan(
        self,
        *,
        comm: Communicator | None,
        process_group: Any,
        no_dist: bool,
        save_fn: SaveFn | None,
    ) -> Plan:
        if comm is None and _distributed(no_dist):
            comm = REGISTRY.comm(process_group)
        return Plan(save if save_fn is None else save_fn, comm)


class ProcessExecutor:
    """Save in a worker process; the thread here only forwards the snapshot (ASYNC-7)."""

    name = "process"

    def __init__(self, timeout_s: float = 1800.0) -> None:
        self.timeout_s = timeout_s

    def plan(
        self,
        *,
        comm: Communicator | None,
        process_group: Any,
        no_dist: bool,
        save_fn: SaveFn | None,
    ) -> Plan:
        from refdcp.asyncsave.process_executor import Request, get_worker

        if comm is not None:
            raise ValueError(
                "executor='process' cannot use an in-process Communicator; "
                "pass process_group (or nothing) instead (ASYNC-7)"
            )
        if save_fn is not None:
            raise ValueError(
                "executor='process' runs refdcp.save in the worker; save_fn is thread-only"
            )
        worker = get_worker(process_group, _distributed(no_dist), self.timeout_s)

        def save_in_worker(staged: dict[str, Any], **kwargs: Any) -> Metadata:
            req = Request(
                dict(staged), kwargs["checkpoint_id"], kwargs["storage_writer"], kwargs["planner"]
            )
            return worker.submit(req).result()

        return Plan(save_in_worker, None)


_BY_NAME: dict[str, Callable[[], Executor]] = {
    "thread": ThreadExecutor,
    "process": ProcessExecutor,
}


def executor_for(executor: str | Executor) -> Executor:
    """The strategy for ``async_save(executor=...)``: a name or an Executor object."""
    if not isinstance(executor, str):
        return executor
    make = _BY_NAME.get(executor)
    if make is None:
        raise ValueError(f"executor must be 'thread' or 'process', not {executor!r}")
    return make()
