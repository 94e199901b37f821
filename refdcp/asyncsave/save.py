"""``refdcp.async_save``: stage now, write in the background (spec/staging.md, ASYNC-*).

The caller is blocked only while the state dict is staged (copied) by the
stager; the collective save of the snapshot then runs on a background thread
(``executor="thread"``) or a background process (``executor="process"``); the
executor is a strategy chosen once (:mod:`refdcp.asyncsave.executors`). The returned :class:`AsyncSaveHandle` has two
futures: ``staged`` (the source may be mutated now) and ``committed``, the
handle itself, a ``concurrent.futures.Future`` of the checkpoint's ``Metadata``.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, cast

from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlanner
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse
from torch.distributed.checkpoint.storage import StorageWriter

from refdcp.asyncsave.default_stager import default_stager
from refdcp.asyncsave.executors import Executor, SaveFn, executor_for
from refdcp.asyncsave.groups import checkpoint_process_group
from refdcp.comm.base import Communicator
from refdcp.driver.steps import unwrap_stateful
from refdcp.staging.cpu_stager import CpuStager

__all__ = [
    "AsyncSaveHandle",
    "InFlightLimiter",
    "async_save",
    "checkpoint_process_group",
    "DEFAULT_LIMITER",
]


class AsyncSaveHandle(Future[Metadata], AsyncSaveResponse):
    """One asynchronous save: a ``concurrent.futures.Future`` of its ``Metadata`` (ASYNC-1).

    The handle is the future torch's ``async_save`` returns: it resolves to the
    ``Metadata`` once the checkpoint is durable, or to the save's exception, so
    ``result()``, ``concurrent.futures.wait`` and ``as_completed`` work on it.
    It is also torch's ``AsyncSaveResponse``: ``staging_completion`` resolves
    (to None) once the snapshot is complete and the source may be mutated, and
    ``upload_completion`` is the handle itself. refdcp's own names for the two
    are ``staged`` and ``committed``.
    """

    # a future is compared and hashed by identity (the dataclass base would compare fields)
    __eq__ = object.__eq__
    __hash__ = object.__hash__

    def __init__(self) -> None:
        Future.__init__(self)
        self.staged: Future[None] = Future()
        self.staging_completion = self.staged
        self.upload_completion = cast("Future[None]", self)

    @property
    def committed(self) -> Future[Metadata]:
        """The handle itself: resolves once the checkpoint is durable (ASYNC-1)."""
        return self

    def __repr__(self) -> str:
        return f"<AsyncSaveHandle staged={self.staged.done()} {Future.__repr__(self)}>"


class InFlightLimiter:
    """Bounds how many saves may be in flight (staged but not committed) at once (ASYNC-5).

    Policy: a save that would exceed ``max_in_flight`` blocks its caller
    before staging until an earlier save completes (committed or failed); if
    none completes within ``wait_timeout`` seconds it raises TimeoutError and
    starts nothing.
    """

    def __init__(self, max_in_flight: int = 1, wait_timeout: float = 3600.0) -> None:
        if max_in_flight < 1:
            raise ValueError("max_in_flight must be at least 1")
        self.max_in_flight = max_in_flight
        self.wait_timeout = wait_timeout
        self._cond = threading.Condition()
        self._in_flight = 0

    @property
    def in_flight(self) -> int:
        with self._cond:
            return self._in_flight

    def acquire(self) -> None:
        with self._cond:
            ok = self._cond.wait_for(
                lambda: self._in_flight < self.max_in_flight, timeout=self.wait_timeout
            )
            if not ok:
                raise TimeoutError(
                    f"{self._in_flight} checkpoint save(s) still in flight after "
                    f"{self.wait_timeout:.1f} s; max_in_flight={self.max_in_flight} (ASYNC-5)"
                )
            self._in_flight += 1

    def release(self) -> None:
        with self._cond:
            self._in_flight -= 1
            self._cond.notify_all()


_GROUPS_LOCK = threading.Lock()

#: The bound shared by every ``async_save`` call that passes neither a limiter nor a ``comm``.
DEFAULT_LIMITER = InFlightLimiter(max_in_flight=1)
_COMM_LIMITERS: weakref.WeakKeyDictionary[Any, InFlightLimiter] = weakref.WeakKeyDictionary()


def _default_limiter(comm: Communicator | None) -> InFlightLimiter:
    """One save in flight per explicit communicator (each FakeWorld rank has its own), else per process."""
    if comm is None:
        return DEFAULT_LIMITER
    with _GROUPS_LOCK:
        try:
            lim = _COMM_LIMITERS.get(comm)
            if lim is None:
                lim = InFlightLimiter(max_in_flight=1)
                _COMM_LIMITERS[comm] = lim
        except TypeError:  # not weak-referenceable
            return DEFAULT_LIMITER
        return lim


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
    executor: str | Executor | None = None,
    comm: Communicator | None = None,
    limiter: InFlightLimiter | None = None,
    save_fn: SaveFn | None = None,
) -> AsyncSaveHandle:
    """Stage ``state_dict`` and save the snapshot in the background (ASYNC-1).

    ``stager`` defaults to a cached :class:`CpuStager` shared by the saves of
    this process (or of ``comm``), whose buffers are reused by the next save of
    the same structure (ASYNC-30; :func:`release_staging_buffers` frees them);
    pass ``stager=CpuStager()`` for a fresh copy per save (the process
    executor's default).
    ``limiter`` bounds saves in flight (default :data:`DEFAULT_LIMITER`, one
    save per process, or per ``comm`` when one is given; ASYNC-5). ``save_fn``
    replaces ``refdcp.save`` (e.g. a wrapper for fault injection); it is called
    with the staged dict and the keyword arguments ``checkpoint_id``,
    ``storage_writer``, ``planner`` and either ``comm`` or ``no_dist=True``
    (and ``use_collectives=False`` when given).
    torch's spellings are accepted too (API-11): ``async_stager=`` for
    ``stager=`` and ``async_checkpointer_type=`` (torch's
    ``AsyncCheckpointerType`` or ``"thread"``/``"process"``) for ``executor=``.
    """
    stager, executor = _translate_torch_names(
        stager, async_stager, executor, async_checkpointer_type
    )
    chosen = executor_for(executor)
    if not use_collectives and chosen.name == "process":
        raise ValueError("use_collectives=False is supported with executor='thread' only")
    plan = chosen.plan(comm=comm, process_group=process_group, no_dist=no_dist, save_fn=save_fn)
    bg_comm, fn = plan.comm, plan.save_fn
    limiter = _default_limiter(comm) if limiter is None else limiter
    if stager is not None:
        stager_: AsyncStager = stager
    elif chosen.name == "thread":
        stager_ = default_stager(comm)
    else:  # the process worker moves the snapshot to shared memory: a fresh copy (ASYNC-30)
        stager_ = CpuStager()

    limiter.acquire()
    handle = AsyncSaveHandle()
    try:
        staged_or_future = stager_.stage(unwrap_stateful(state_dict))
    except BaseException:
        limiter.release()
        raise
    snapshot: Future[dict[str, Any]]
    if isinstance(staged_or_future, Future):
        snapshot = staged_or_future
    else:
        snapshot = Future()
        snapshot.set_result(staged_or_future)
    del staged_or_future

    def on_staged(f: Future[dict[str, Any]]) -> None:
        exc = f.exception()
        if exc is None:
            handle.staged.set_result(None)
        else:
            handle.staged.set_exception(exc)

    snapshot.add_done_callback(on_staged)
    # The background job owns the only reference to the snapshot and drops it
    # before ``committed`` resolves, so a fresh copy is freed before the
    # caller can stage the next one (peak memory: one snapshot per save in flight).
    box: list[Future[dict[str, Any]]] = [snapshot]
    del snapshot

    def run() -> None:
        staged: dict[str, Any] | None = None
        error: BaseException | None = None
        metadata: Metadata | None = None
        try:
            staged = box.pop().result()
            kwargs: dict[str, Any] = {
                "checkpoint_id": checkpoint_id,
                "storage_writer": storage_writer,
                "planner": planner,
            }
            if bg_comm is not None:
                kwargs["comm"] = bg_comm
            else:
                kwargs["no_dist"] = True
            if not use_collectives:
                kwargs["use_collectives"] = False
            metadata = fn(staged, **kwargs)
        except BaseException as exc:
            error = exc
        try:
            _finish(stager_, staged, limiter)
        except Exception as exc:  # a failing release() must still resolve the handle (ASYNC-15)
            # the checkpoint's fate is already decided: report, do not mask it
            warnings.warn(
                f"async_save: the stager's release() failed after the save: {exc!r}",
                RuntimeWarning,
                stacklevel=1,
            )
        staged = None
        if error is not None:
            handle.committed.set_exception(error)
        else:
            assert metadata is not None
            handle.committed.set_result(metadata)

    _submit_serial(bg_comm, run)
    if stager_.should_synchronize_after_execute:
        stager_.synchronize_staging()
    return handle


def _translate_torch_names(
    stager: AsyncStager | None,
    async_stager: AsyncStager | None,
    executor: str | Executor | None,
    async_checkpointer_type: Any,
) -> tuple[AsyncStager | None, str | Executor]:
    """refdcp's ``stager``/``executor`` from either spelling; both spellings at once must agree (API-11)."""
    if async_stager is not None:
        if stager is not None and stager is not async_stager:
            raise ValueError("pass the stager once: `stager=` (refdcp) or `async_stager=` (torch)")
        stager = async_stager
    kind: str | None = None
    if async_checkpointer_type is not None:
        kind = str(getattr(async_checkpointer_type, "value", async_checkpointer_type))
        if kind not in ("thread", "process"):
            raise ValueError(
                f"async_checkpointer_type must be AsyncCheckpointerType.THREAD/PROCESS "
                f"or 'thread'/'process', not {async_checkpointer_type!r}"
            )
        named = executor if isinstance(executor, str) or executor is None else executor.name
        if named is not None and named != kind:
            raise ValueError(
                f"executor={named!r} and async_checkpointer_type={kind!r} disagree; pass one"
            )
    if executor is None:
        return stager, kind or "thread"
    return stager, executor


_CHANNELS: dict[object, list[Callable[[], None]]] = {}
_CHANNELS_LOCK = threading.Lock()


def _submit_serial(channel: object, job: Callable[[], None]) -> None:
    """Run ``job`` on a background thread after every earlier job of ``channel`` (ASYNC-13).

    Saves over one communicator (or one process group) run one at a time, in
    call order, so every rank issues their collectives in the same order.
    """
    key = channel  # held strongly while its jobs are pending, so never a reused id
    with _CHANNELS_LOCK:
        pending = _CHANNELS.get(key)
        if pending is not None:  # a worker is draining this channel
            pending.append(job)
            return
        pending = [job]
        _CHANNELS[key] = pending

    def drain() -> None:
        while True:
            with _CHANNELS_LOCK:
                if not pending:
                    del _CHANNELS[key]
                    return
                nxt = pending.pop(0)
            with contextlib.suppress(Exception):  # a job resolves its own handle; keep draining
                nxt()

    threading.Thread(target=drain, name="refdcp-async-save", daemon=True).start()


def _finish(stager: AsyncStager, staged: dict[str, Any] | None, limiter: InFlightLimiter) -> None:
    """Return the snapshot's buffers (ASYNC-4) and the in-flight slot, before ``committed`` resolves."""
    try:
        release = getattr(stager, "release", None)
        if staged is not None and callable(release):
            release(staged)
    finally:
        limiter.release()
