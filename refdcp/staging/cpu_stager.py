"""CPU stager, fresh or with cached buffers, blocking unless asked to copy in the background.

:class:`CpuStager` implements torch's ``AsyncStager`` protocol (``stage``,
``should_synchronize_after_execute``, ``synchronize_staging``, ``close``) so it
can be passed to ``torch.distributed.checkpoint.async_save`` as well as to
``refdcp.async_save``. ``stage`` returns once the snapshot is complete
(STAGE-6..STAGE-13), or, with ``background_copy=True``, returns a ``Future`` of
the snapshot at once and copies on a staging thread (STAGE-18).
"""

from __future__ import annotations

import threading
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from torch.distributed.checkpoint.staging import AsyncStager

from refdcp.staging.buffer_pool import BufferPool, Lease, allocate
from refdcp.staging.tree import Layout, build_snapshot, layout_of

__all__ = ["CpuStager", "StagedStateDict", "allocate", "copy_into"]


class StagedStateDict(dict[str, Any]):
    """A staged snapshot (a plain dict that can carry a weak reference to its lease)."""

    __slots__ = ("__weakref__",)


def copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy ``src``'s own elements into the contiguous buffer ``dst`` (STAGE-7)."""
    with torch.no_grad():
        dst.copy_(src.detach())


class CpuStager(AsyncStager):
    """Stage a state dict into CPU memory: blocking (STAGE-6), or in the background (STAGE-18).

    * ``cache_staged_state_dict=False``: every ``stage`` allocates a fresh copy.
    * ``cache_staged_state_dict=True``: copies go into a :class:`BufferPool`
      reused across saves (STAGE-11); pinned when CUDA is available unless
      ``pin_memory`` says otherwise or ``share_memory`` is set (STAGE-13); ``share_memory=True`` puts the buffers in
      shared memory (used by the process executor). A snapshot's buffers stay
      leased until :meth:`release` is called on it, or until the snapshot dict
      is garbage-collected (STAGE-12).
    * ``type_check=True``: leaves must be plain tensors or simple Python
      scalars/strings (STAGE-10).
    * ``background_copy=True``: ``stage`` returns a ``Future`` at once and the
      copy runs on a staging thread (torch's copies release the GIL, so the
      training step goes on); the source must not change until the Future
      (``handle.staged`` in ``async_save``) resolves (STAGE-18).
    """

    _synchronize_after_execute: bool = False

    def __init__(
        self,
        cache_staged_state_dict: bool = False,
        type_check: bool = False,
        *,
        pin_memory: bool | None = None,
        share_memory: bool = False,
        max_buffer_sets: int = 2,
        max_bytes: int | None = None,
        wait_timeout: float = 600.0,
        background_copy: bool = False,
    ) -> None:
        self.cache_staged_state_dict = cache_staged_state_dict
        self.background_copy = background_copy
        self._bg_executor: ThreadPoolExecutor | None = None
        self._bg_pending: Future[dict[str, Any]] | None = None
        self.type_check = type_check
        self.pool: BufferPool | None = None
        if cache_staged_state_dict:
            # shared-memory buffers are not pinned by default (they go to another process)
            pin = (
                torch.cuda.is_available() and not share_memory if pin_memory is None else pin_memory
            )
            self.pool = BufferPool(
                pin_memory=pin,
                share_memory=share_memory,
                max_sets=max_buffer_sets,
                max_bytes=max_bytes,
                wait_timeout=wait_timeout,
            )
        self._leases: dict[int, tuple[Lease, weakref.finalize[Any, Any]]] = {}
        self._lock = threading.Lock()

    def stage(self, state_dict: dict[str, Any]) -> Any:
        """A snapshot of ``state_dict`` on CPU, immune to later source changes (STAGE-6).

        With ``background_copy`` it is a ``Future`` of the snapshot (STAGE-18).
        """
        layout = layout_of(state_dict, type_check=self.type_check)
        lease = self.pool.acquire(layout) if self.pool is not None else None
        if not self.background_copy:
            return self._copy(state_dict, layout, lease)
        if self._bg_executor is None:
            self._bg_executor = ThreadPoolExecutor(1, thread_name_prefix="refdcp-staging")
        fut = self._bg_executor.submit(self._copy, state_dict, layout, lease)
        self._bg_pending = fut
        return fut

    def _copy(self, state_dict: dict[str, Any], layout: Layout, lease: Lease | None) -> Any:
        if lease is None:
            out = build_snapshot(state_dict, layout, allocate(layout), copy_into)
            return _as_staged(out)
        assert self.pool is not None
        try:
            out = build_snapshot(state_dict, layout, lease.buffers, copy_into)
        except BaseException:
            self.pool.copy_failed(lease)
            raise
        self.pool.copy_done(lease)
        staged = _as_staged(out)
        self._track(staged, lease)
        return staged

    def _track(self, staged: StagedStateDict, lease: Lease) -> None:
        key = id(staged)
        fin = weakref.finalize(staged, self._release_key, key)
        with self._lock:
            self._leases[key] = (lease, fin)

    def _release_key(self, key: int) -> None:
        with self._lock:
            entry = self._leases.pop(key, None)
        if entry is not None:
            entry[0].release()

    def release(self, staged: object) -> None:
        """The save reading ``staged`` has finished: its buffers may be reused (STAGE-12)."""
        with self._lock:
            entry = self._leases.pop(id(staged), None)
        if entry is not None:
            lease, fin = entry
            fin.detach()
            lease.release()

    def synchronize_staging(self) -> None:
        """Wait for the last background copy (nothing to wait for without ``background_copy``)."""
        pending = self._bg_pending
        if pending is not None:
            pending.exception()  # waits; the error itself is the Future's to report

    def close(self) -> None:
        """Free the cached buffers (STAGE-4: raises while a snapshot is still leased)."""
        if self._bg_executor is not None:
            self._bg_executor.shutdown(wait=True)
            self._bg_executor = None
        if self.pool is not None:
            self.pool.close()


def _as_staged(out: Any) -> StagedStateDict:
    if not isinstance(out, dict):
        raise TypeError("a state dict must be a dict")
    return StagedStateDict(out)
