"""``refdcp.Checkpointer``: one place for a job's checkpoint configuration (ASYNC-9, ASYNC-10).

It holds the storage writer/reader (or builds them from each call's
``checkpoint_id``), planners, stager, executor, communicator or process group
and the in-flight bound, and forwards ``save``/``async_save``/``load`` to
refdcp's functions. Unlike torch 2.13's ``_Checkpointer`` (whose ``save``
raises TypeError), every method works.
"""

from __future__ import annotations

from typing import Any

from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadPlanner, SavePlanner
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter

from refdcp.asyncsave.save import AsyncSaveHandle, InFlightLimiter, async_save
from refdcp.comm.base import Communicator
from refdcp.staging.cpu_stager import CpuStager

__all__ = ["Checkpointer"]


class Checkpointer:
    """Save, async-save and load with fixed components (ASYNC-9).

    ``stager`` defaults to a :class:`CpuStager` with cached buffers, kept for
    the Checkpointer's life so steady-state saves reuse them (ASYNC-10);
    ``max_in_flight`` bounds this Checkpointer's own saves in flight (ASYNC-5).
    Call :meth:`close` (or use it as a context manager) to wait for saves in
    flight and free the buffers.
    """

    def __init__(
        self,
        *,
        storage_writer: StorageWriter | None = None,
        storage_reader: StorageReader | None = None,
        save_planner: SavePlanner | None = None,
        load_planner: LoadPlanner | None = None,
        stager: AsyncStager | None = None,
        executor: str = "thread",
        process_group: Any = None,
        comm: Communicator | None = None,
        no_dist: bool = False,
        max_in_flight: int = 1,
    ) -> None:
        self.storage_writer = storage_writer
        self.storage_reader = storage_reader
        self.save_planner = save_planner
        self.load_planner = load_planner
        self._own_stager = stager is None
        self.stager: AsyncStager = (
            CpuStager(cache_staged_state_dict=True, share_memory=executor == "process")
            if stager is None
            else stager
        )
        self.executor = executor
        self.process_group = process_group
        self.comm = comm
        self.no_dist = no_dist
        self.limiter = InFlightLimiter(max_in_flight)
        self._handles: list[AsyncSaveHandle] = []

    def save(self, state_dict: dict[str, Any], *, checkpoint_id: Any = None) -> Metadata:
        """Blocking collective save; returns the committed Metadata (ASYNC-9)."""
        from refdcp.api import save

        return save(
            state_dict,
            checkpoint_id=checkpoint_id,
            storage_writer=self.storage_writer,
            planner=self.save_planner,
            process_group=self.process_group,
            no_dist=self.no_dist,
            comm=self.comm,
        )

    def async_save(
        self, state_dict: dict[str, Any], *, checkpoint_id: Any = None
    ) -> AsyncSaveHandle:
        """Stage now, save in the background with this Checkpointer's stager and bound."""
        handle = async_save(
            state_dict,
            checkpoint_id=checkpoint_id,
            storage_writer=self.storage_writer,
            planner=self.save_planner,
            stager=self.stager,
            executor=self.executor,
            process_group=self.process_group,
            comm=self.comm,
            no_dist=self.no_dist,
            limiter=self.limiter,
        )
        self._handles = [h for h in self._handles if not h.done()] + [handle]
        return handle

    def load(
        self, state_dict: dict[str, Any], *, checkpoint_id: Any = None, verify: bool = False
    ) -> None:
        """Collective load into ``state_dict`` in place (ASYNC-9)."""
        from refdcp.api import load

        load(
            state_dict,
            checkpoint_id=checkpoint_id,
            storage_reader=self.storage_reader,
            planner=self.load_planner,
            process_group=self.process_group,
            no_dist=self.no_dist,
            comm=self.comm,
            verify=verify,
        )

    def wait(self, timeout: float | None = None) -> None:
        """Wait until every save in flight has committed or failed (errors are not raised here)."""
        for handle in self._handles:
            handle.committed.exception(timeout)
        self._handles = []

    def close(self, timeout: float | None = None) -> None:
        """Wait for saves in flight, then close the stager if this Checkpointer created it."""
        self.wait(timeout)
        if self._own_stager:
            self.stager.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
