"""``async_save`` on the reference path: stage now, write on a background thread (REF-11).

What happens, in order (ASYNC-1..ASYNC-5, ASYNC-12, ASYNC-13):

1. The arguments are checked: the executor must be the thread (REF-12), so a
   wrong one fails before anything is staged (ASYNC-11).
2. The in-flight limiter gives this save its slot, waiting while another save
   holds it (ASYNC-5: one save in flight per process, or per communicator).
3. Top-level ``Stateful`` values are replaced by their ``state_dict()``
   (ASYNC-12) and the stager copies the state dict (the reference stager by
   default: a fresh CPU copy). From here the caller may change its tensors;
   ``handle.staged`` says so (ASYNC-2).
4. A ``threading.Thread`` runs ``save`` on the snapshot, after every earlier
   save over the same communicator (ASYNC-13), drops the snapshot, frees the
   slot (ASYNC-4, ASYNC-16) and resolves ``handle.committed`` with the
   ``Metadata`` or the save's exception (ASYNC-1, ASYNC-3).

This is the one module of ``refdcp/reference/`` that uses ``threading`` and
``concurrent.futures`` (REF-7): a background thread and the futures it
resolves are what an asynchronous save is.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, cast

import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlanner
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.checkpoint.storage import StorageWriter

from refdcp.comm import Communicator, SingleRank, TorchDistComm

from .api import save as reference_save
from .staging import ReferenceStager

__all__ = ["AsyncSaveHandle", "InFlightLimiter", "async_save"]


class AsyncSaveHandle(Future[Metadata], AsyncSaveResponse):
    """One asynchronous save: a future of its ``Metadata``, and torch's ``AsyncSaveResponse`` (ASYNC-1).

    The handle resolves to the checkpoint's ``Metadata`` once it is committed,
    or to the save's exception, so ``concurrent.futures.wait`` and
    ``as_completed`` take it. ``staged`` (torch's ``staging_completion``)
    resolves to None once the snapshot is complete: the source may change from
    then on. ``committed`` and ``upload_completion`` are the handle itself.
    """

    __eq__ = object.__eq__  # a future is itself: compared and hashed by identity
    __hash__ = object.__hash__

    def __init__(self) -> None:
        Future.__init__(self)
        self.staged: Future[None] = Future()
        self.staging_completion = self.staged
        self.upload_completion = cast("Future[None]", self)

    @property
    def committed(self) -> Future[Metadata]:
        """The handle itself: resolves once the checkpoint is committed (ASYNC-1)."""
        return self


class InFlightLimiter:
    """At most ``max_in_flight`` saves staged but not yet ended (ASYNC-5).

    ``acquire`` waits for a free slot, at most ``wait_timeout`` seconds, then
    raises TimeoutError; ``release`` frees a slot.
    """

    def __init__(self, max_in_flight: int = 1, wait_timeout: float = 3600.0) -> None:
        if max_in_flight < 1:
            raise ValueError("max_in_flight must be at least 1")
        self.max_in_flight = max_in_flight
        self.wait_timeout = wait_timeout
        self.in_flight = 0
        self._changed = threading.Condition()

    def acquire(self) -> None:
        """Take a slot, waiting for one to be freed (ASYNC-5)."""
        with self._changed:
            free = self._changed.wait_for(
                lambda: self.in_flight < self.max_in_flight, timeout=self.wait_timeout
            )
            if not free:
                raise TimeoutError(
                    f"{self.in_flight} checkpoint save(s) still in flight after "
                    f"{self.wait_timeout:.1f} s; max_in_flight={self.max_in_flight} (ASYNC-5)"
                )
            self.in_flight += 1

    def release(self) -> None:
        """Free a slot (ASYNC-4)."""
        with self._changed:
            self.in_flight -= 1
            self._changed.notify_all()


#: The limiter of every save that names no communicator (ASYNC-5).
PROCESS_LIMITER = InFlightLimiter()
#: One limiter per communicator a save names, so each FakeWorld rank has its own (ASYNC-5).
_COMM_LIMITERS: weakref.WeakKeyDictionary[Any, InFlightLimiter] = weakref.WeakKeyDictionary()
#: Per communicator (None: this process), the ``committed`` of its newest save (ASYNC-13).
_NEWEST_SAVE: dict[Communicator | None, Future[Metadata]] = {}
#: Per (default group, ranks), the Communicator over a dedicated Gloo group (ASYNC-6).
_CHECKPOINT_COMMS: dict[tuple[object, tuple[int, ...] | None], Communicator] = {}
_TABLES = threading.Lock()


def async_save(
    state_dict: dict[str, Any],
    *,
    checkpoint_id: Any = None,
    storage_writer: StorageWriter | None = None,
    planner: SavePlanner | None = None,
    process_group: Any = None,
    async_checkpointer_type: Any = None,
    async_stager: AsyncStager | None = None,
    no_dist: bool = False,
    use_collectives: bool = True,
    stager: AsyncStager | None = None,
    executor: Any = None,
    comm: Communicator | None = None,
    limiter: Any = None,
    save_fn: Callable[..., Metadata] | None = None,
) -> AsyncSaveHandle:
    """Stage ``state_dict`` and save the snapshot on a background thread (REF-11, ASYNC-1).

    The arguments are ``refdcp.async_save``'s. ``stager`` (torch: ``async_stager``)
    defaults to a fresh :class:`ReferenceStager`; ``executor`` (torch:
    ``async_checkpointer_type``) must be the thread: ``"process"`` raises
    ValueError (REF-12). ``limiter`` is any object with ``acquire``/``release``
    (default: one save in flight per process, or per ``comm``; ASYNC-5).
    ``save_fn`` replaces :func:`refdcp.reference.save`; it is called with the
    snapshot and ``checkpoint_id``, ``storage_writer``, ``planner`` and ``comm``
    (a ``SingleRank`` for ``no_dist=True``; plus ``use_collectives=False`` when given; REF-12).
    """
    stager = _one_stager(stager, async_stager)
    _check_thread_executor(executor, async_checkpointer_type)
    background_comm = _background_comm(comm, process_group, no_dist)
    if limiter is None:
        limiter = _default_limiter(comm)
    kwargs: dict[str, Any] = {
        "checkpoint_id": checkpoint_id,
        "storage_writer": storage_writer,
        "planner": planner,
        "comm": background_comm,
    }
    if not use_collectives:
        kwargs["use_collectives"] = False

    limiter.acquire()
    try:
        snapshot = stager.stage(_unwrap_stateful(state_dict))
    except BaseException:
        limiter.release()
        raise
    handle = AsyncSaveHandle()
    if isinstance(snapshot, Future):  # a stager that copies in the background
        snapshot.add_done_callback(lambda done: _mirror(done, handle.staged))
    else:
        handle.staged.set_result(None)

    with _TABLES:
        earlier = _NEWEST_SAVE.get(comm)
        _NEWEST_SAVE[comm] = handle.committed
    box = [snapshot]  # the thread takes the only reference to the snapshot (ASYNC-16)
    del snapshot
    job = (box, save_fn or reference_save, kwargs, limiter, handle, comm, earlier)
    threading.Thread(target=_write, args=job, name="refdcp-reference-save", daemon=True).start()
    if stager.should_synchronize_after_execute:
        stager.synchronize_staging()
    return handle


def _write(
    box: list[Any],
    save: Callable[..., Metadata],
    kwargs: dict[str, Any],
    limiter: Any,
    handle: AsyncSaveHandle,
    comm: Communicator | None,
    earlier: Future[Metadata] | None,
) -> None:
    """The background thread: save the snapshot, then resolve ``committed`` (ASYNC-1, ASYNC-3, ASYNC-4)."""
    if earlier is not None:
        earlier.exception()  # wait for the save before this one over this comm (ASYNC-13)
    metadata: Any = None  # what save returned: the Metadata
    error: BaseException | None = None
    try:
        snapshot = box.pop()
        if isinstance(snapshot, Future):
            snapshot = snapshot.result()
        metadata = save(snapshot, **kwargs)
    except BaseException as exc:
        error = exc
    snapshot = None  # nothing here keeps the snapshot once committed resolves (ASYNC-16)
    with _TABLES:
        if _NEWEST_SAVE.get(comm) is handle.committed:
            del _NEWEST_SAVE[comm]
    limiter.release()  # the slot is free before committed resolves (ASYNC-4)
    if error is not None:
        handle.committed.set_exception(error)
    else:
        handle.committed.set_result(metadata)


def _mirror(done: Future[Any], staged: Future[None]) -> None:
    """Resolve ``staged`` as a background copy ended (STAGE-18)."""
    error = done.exception()
    if error is None:
        staged.set_result(None)
    else:
        staged.set_exception(error)


def _one_stager(stager: AsyncStager | None, async_stager: AsyncStager | None) -> AsyncStager:
    """The stager from refdcp's or torch's spelling, else a fresh reference stager (API-11)."""
    if async_stager is not None:
        if stager is not None and stager is not async_stager:
            raise ValueError("pass the stager once: `stager=` (refdcp) or `async_stager=` (torch)")
        return async_stager
    return stager if stager is not None else ReferenceStager()


def _check_thread_executor(executor: Any, async_checkpointer_type: Any) -> None:
    """Accept only the thread executor, as a name or torch's enum member (REF-12, ASYNC-11, API-11)."""
    kinds = [getattr(g, "value", g) for g in (executor, async_checkpointer_type) if g is not None]
    if len(set(kinds)) > 1:
        raise ValueError(
            f"executor={executor!r} and async_checkpointer_type={async_checkpointer_type!r} "
            "disagree; pass one"
        )
    for name, given in (
        ("executor", executor),
        ("async_checkpointer_type", async_checkpointer_type),
    ):
        if given is None:
            continue
        kind = getattr(given, "value", given)  # AsyncCheckpointerType.THREAD.value == "thread"
        if kind == "process":
            raise ValueError(
                "refdcp.reference.async_save writes on a background thread only; "
                "executor='process' is refdcp.async_save's (REF-12)"
            )
        if kind != "thread":
            raise ValueError(f"{name} must be 'thread' or 'process', not {given!r}")


def _background_comm(comm: Communicator | None, process_group: Any, no_dist: bool) -> Communicator:
    """The communicator the background save uses (API-4, ASYNC-6).

    The given one; else, under torch.distributed, one over a dedicated Gloo group
    made once per process group, so the save's collectives never interleave with
    the training loop's on that group; else one rank.
    """
    if comm is not None:
        return comm
    if no_dist or not (dist.is_available() and dist.is_initialized()):
        return SingleRank()
    ranks = None if process_group is None else tuple(dist.get_process_group_ranks(process_group))
    key = (dist.group.WORLD, ranks)
    with _TABLES:
        if key not in _CHECKPOINT_COMMS:  # creating a group is collective: every rank gets here
            group = dist.new_group(ranks=None if ranks is None else list(ranks), backend="gloo")
            _CHECKPOINT_COMMS[key] = TorchDistComm(group)
        return _CHECKPOINT_COMMS[key]


def _default_limiter(comm: Communicator | None) -> InFlightLimiter:
    """One save in flight per communicator named, else per process (ASYNC-5)."""
    if comm is None:
        return PROCESS_LIMITER
    with _TABLES:
        if comm not in _COMM_LIMITERS:
            _COMM_LIMITERS[comm] = InFlightLimiter()
        return _COMM_LIMITERS[comm]


def _unwrap_stateful(state_dict: dict[str, Any]) -> dict[str, Any]:
    """Top-level ``Stateful`` values replaced by their ``state_dict()`` (ASYNC-12)."""
    return {
        key: value.state_dict() if isinstance(value, Stateful) else value
        for key, value in state_dict.items()
    }
