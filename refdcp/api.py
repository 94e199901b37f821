"""``refdcp.save`` / ``refdcp.load``: drop-ins for torch's DCP entry points (spec/api.md).

They wire the pieces: choose a Communicator (API-4), choose storage from
``checkpoint_id`` when none is given (API-5), and drive the save or load
protocol machine (spec/protocol.md) with any planner and storage that
implement torch's ABCs (API-3).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadPlanner, SavePlanner
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter

from refdcp.call_forms import storage_positional
from refdcp.comm.base import Communicator
from refdcp.driver.gcpause import gc_paused
from refdcp.driver.run import FaultHook, Observer, drive
from refdcp.driver.steps import LoadContext, SaveContext
from refdcp.protocol.load import LOAD
from refdcp.protocol.save import SAVE

__all__ = ["CheckpointException", "load", "resolve_comm", "save"]  # torch's api name too (API-27)


def resolve_comm(
    comm: Communicator | None, process_group: Any = None, no_dist: bool = False
) -> Communicator:
    """The Communicator a call uses (API-4).

    An explicit ``comm`` wins; ``no_dist=True`` or an uninitialised
    torch.distributed gives a single rank (with a warning in the latter case,
    as torch does); otherwise the given (or default) process group.
    """
    from refdcp.comm import SingleRank, TorchDistComm

    if comm is not None:
        return comm
    if no_dist:
        return SingleRank()
    if not (dist.is_available() and dist.is_initialized()):
        warnings.warn(
            "torch.distributed is not initialized: running as a single rank (no_dist=True)",
            UserWarning,
            stacklevel=3,
        )
        return SingleRank()
    return TorchDistComm(process_group)


def _default_save_planner() -> SavePlanner:
    from refdcp.planning import DefaultSavePlanner

    return DefaultSavePlanner()


def _default_load_planner() -> LoadPlanner:
    from refdcp.planning import DefaultLoadPlanner

    return DefaultLoadPlanner()


def _writer_factory(checkpoint_id: Any) -> Callable[[], StorageWriter]:
    def make() -> StorageWriter:
        from refdcp.storage.select import select_writer

        return select_writer(checkpoint_id)

    return make


def _reader_factory(checkpoint_id: Any) -> Callable[[], StorageReader]:
    def make() -> StorageReader:
        from refdcp.storage.select import select_reader

        return select_reader(checkpoint_id)

    return make


def _require_id(storage: object, checkpoint_id: Any, what: str) -> None:
    if storage is None and checkpoint_id is None:
        raise ValueError(f"`checkpoint_id` must be given when no {what} is given (API-5)")


@storage_positional("storage_writer")
def save(
    state_dict: dict[str, Any],
    *,
    checkpoint_id: Any = None,
    storage_writer: StorageWriter | None = None,
    planner: SavePlanner | None = None,
    process_group: Any = None,
    no_dist: bool = False,
    use_collectives: bool = True,
    comm: Communicator | None = None,
    fault: FaultHook | None = None,
    observer: Observer | None = None,
) -> Metadata:
    """Save ``state_dict`` collectively; return the committed Metadata on every rank (API-1).

    ``use_collectives=False`` is torch's experimental mode (API-9): every rank
    plans and commits alone (``__{rank}.metadata``), then the ranks meet once.
    ``fault`` and ``observer`` are hooks for tests and ``refdcp trace``
    (PROTO-7): ``fault(i, action)`` runs before this rank's i-th action and may
    raise; ``observer`` receives a record of every step.
    """
    _require_id(storage_writer, checkpoint_id, "storage_writer")
    c = resolve_comm(comm, process_group, no_dist)
    if not use_collectives:
        return _save_without_collectives(
            state_dict, c, storage_writer, checkpoint_id, planner, fault, observer
        )
    ctx = SaveContext(
        rank=c.rank,
        world_size=c.world_size,
        coordinator=c.rank == c.coordinator_rank,
        state_dict=state_dict,
        writer=storage_writer,
        writer_factory=_writer_factory(checkpoint_id),
        planner=planner or _default_save_planner(),
        checkpoint_id=checkpoint_id,
    )
    try:
        with gc_paused():
            result: Metadata = drive(SAVE, ctx, c, fault=fault, observer=observer)
            # drop the plans and write results (and a planner made here) while the collector
            # is still paused: freed by reference counting now, not traversed by its first pass
            ctx.slots.clear()
            if planner is None:
                ctx.planner = None
    except BaseException:
        from refdcp.storage.fs.cleanup import abort_writer

        abort_writer(ctx.writer)  # remove what this rank wrote, free the lock (STORE-31)
        raise
    return result


def _save_without_collectives(
    state_dict: dict[str, Any],
    c: Communicator,
    storage_writer: StorageWriter | None,
    checkpoint_id: Any,
    planner: SavePlanner | None,
    fault: FaultHook | None,
    observer: Observer | None,
) -> Metadata:
    """torch's ``use_collectives=False``: this rank alone plans, writes and commits its own
    metadata; then every rank learns every rank's outcome (API-9, ERR-1)."""
    from refdcp.comm import SingleRank
    from refdcp.errors import CheckpointError, Failure

    ctx = SaveContext(
        rank=c.rank,
        world_size=1,
        coordinator=True,
        state_dict=state_dict,
        writer=storage_writer,
        writer_factory=_writer_factory(checkpoint_id),
        planner=planner or _default_save_planner(),
        checkpoint_id=checkpoint_id,
        use_collectives=False,
    )
    result: Metadata | None = None
    failure: Failure | None = None
    from refdcp.storage.fs.cleanup import abort_writer

    try:
        with gc_paused():
            result = drive(SAVE, ctx, SingleRank(), fault=fault, observer=observer)
    except CheckpointError as e:
        abort_writer(ctx.writer)  # remove what this rank wrote, free the lock (STORE-31)
        failure = next(iter(e.rank_failures.values()), None) or Failure.capture(c.rank, e.step, e)
        failure = Failure(c.rank, failure.step, failure.exception, failure.traceback_text)
    except BaseException:
        abort_writer(ctx.writer)
        raise
    outcomes = c.all_gather(failure)
    failures = {f.rank: f for f in outcomes if f is not None}
    if failures:
        raise CheckpointError(next(iter(failures.values())).step, failures)
    assert result is not None
    return result


@storage_positional("storage_reader")
def load(
    state_dict: dict[str, Any],
    *,
    checkpoint_id: Any = None,
    storage_reader: StorageReader | None = None,
    planner: LoadPlanner | None = None,
    process_group: Any = None,
    no_dist: bool = False,
    comm: Communicator | None = None,
    verify: bool | None = None,
    safe_globals: Sequence[Any] = (),
    fault: FaultHook | None = None,
    observer: Observer | None = None,
    atomic: bool = False,
    read_once: bool | Literal["auto"] | None = None,
) -> None:
    """Load into ``state_dict`` in place, resharding as needed (API-1).

    Top-level ``Stateful`` values receive ``load_state_dict``; other top-level
    values are replaced by what was loaded, as torch does (API-2).
    ``verify=None`` (default) checks every item that carries a checksum
    (LOAD-10); ``verify=True`` requires and checks every item's checksum
    before delivering it (API-6); ``verify=False`` checks nothing.
    ``safe_globals`` extends the allow-list of globals that non-tensor values
    may reference (LOAD-8). A failed load leaves no destination holding bytes
    that failed their check (LOAD-20); ``atomic=True`` leaves every
    destination and ``Stateful`` as it was, at the cost of a host copy of the
    state dict's tensors during the load (LOAD-21). ``read_once=True`` has
    each stored item several ranks read read by one of them and sent to the
    others (ONCE-6); ``"auto"`` does so where the storage is shared (ONCE-9);
    ``None`` keeps the planner's setting (``"auto"`` for the default planner).
    """
    _require_id(storage_reader, checkpoint_id, "storage_reader")
    c = resolve_comm(comm, process_group, no_dist)
    ctx = LoadContext(
        rank=c.rank,
        world_size=c.world_size,
        coordinator=c.rank == c.coordinator_rank,
        state_dict=state_dict,
        reader=storage_reader,
        reader_factory=_reader_factory(checkpoint_id),
        planner=_load_planner(planner, safe_globals, read_once),
        checkpoint_id=checkpoint_id,
        verify=verify,
        atomic=atomic,
        exchange_on_device=getattr(getattr(c, "device", None), "type", "cpu") != "cpu",
    )
    with gc_paused():
        try:
            drive(LOAD, ctx, c, fault=fault, observer=observer)
        except BaseException as exc:
            for line in ctx.roll_back():  # atomic=True: every destination as it was (LOAD-21)
                exc.add_note(line)
            raise
        # free this load's metadata, plans and planner while the collector is paused: alive
        # when it resumes, they would all be traversed by its next pass (API-20)
        del ctx


def _load_planner(
    planner: LoadPlanner | None,
    safe_globals: Sequence[Any],
    read_once: bool | Literal["auto"] | None = None,
) -> LoadPlanner:
    """The planner a load uses; ``safe_globals`` (LOAD-8) and ``read_once`` (ONCE-6) go to
    refdcp's DefaultLoadPlanner."""
    from refdcp.planning import DefaultLoadPlanner
    from refdcp.planning.load_planner import check_read_once

    p = planner or _default_load_planner()
    if read_once is not None:
        check_read_once(read_once)
        if not isinstance(p, DefaultLoadPlanner):
            raise ValueError(
                f"read_once= applies to refdcp's DefaultLoadPlanner, not {type(p).__name__}"
            )
        p.read_once = read_once
    if safe_globals:
        if not isinstance(p, DefaultLoadPlanner):
            raise ValueError(
                f"safe_globals= applies to refdcp's DefaultLoadPlanner; {type(p).__name__} "
                "unpickles objects itself"
            )
        p.safe_globals = [*p.safe_globals, *safe_globals]
    return p
