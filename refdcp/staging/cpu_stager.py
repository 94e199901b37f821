"""Blocking CPU stager, fresh or with cached buffers (STAGE-6..STAGE-13).

:class:`CpuStager` implements torch's ``AsyncStager`` protocol (``stage``,
``should_synchronize_after_execute``, ``synchronize_staging``, ``close``) so it
can be passed to ``torch.distributed.checkpoint.async_save`` as well as to
``refdcp.async_save``. ``stage`` returns only once the snapshot is complete.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import torch
from torch.distributed.checkpoint.staging import AsyncStager

from refdcp.staging.buffer_pool import BufferPool, Lease
from refdcp.staging.tree import Layout, build_snapshot, layout_of

__all__ = ["CpuStager", "StagedStateDict", "allocate", "copy_into"]


class StagedStateDict(dict[str, Any]):
    """A staged snapshot (a plain dict that can carry a weak reference to its lease)."""

    __slots__ = ("__weakref__",)


def copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy ``src``'s own elements into the contiguous buffer ``dst`` (STAGE-7)."""
    with torch.no_grad():
        dst.copy_(src.detach())


def allocate(layout: Layout, *, pin_memory: bool = False) -> list[torch.Tensor | None]:
    """Fresh contiguous CPU buffers for ``layout`` (``None`` for alias slots)."""
    return [
        None
        if s.alias_of is not None
        else torch.empty(s.shape, dtype=s.dtype, pin_memory=pin_memory)
        for s in layout
    ]


class CpuStager(AsyncStager):
    """Stage a state dict into CPU memory, blocking until the copy is complete (STAGE-6).

    * ``cache_staged_state_dict=False``: every ``stage`` allocates a fresh copy.
    * ``cache_staged_state_dict=True``: copies go into a :class:`BufferPool`
      reused across saves (STAGE-11); pinned when CUDA is available unless
      ``pin_memory`` says otherwise or ``share_memory`` is set (STAGE-13); ``share_memory=True`` puts the buffers in
      shared memory (used by the process executor). A snapshot's buffers stay
      leased until :meth:`release` is called on it, or until the snapshot dict
      is garbage-collected (STAGE-12).
    * ``type_check=True``: leaves must be plain tensors or simple Python
      scalars/strings (STAGE-10).
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
    ) -> None:
        self.cache_staged_state_dict = cache_staged_state_dict
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

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """Return a snapshot of ``state_dict`` on CPU, immune to later source changes (STAGE-6)."""
        layout = layout_of(state_dict, type_check=self.type_check)
        if self.pool is None:
            out = build_snapshot(state_dict, layout, allocate(layout), copy_into)
            return _as_staged(out)
        lease = self.pool.acquire(layout)
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
        """Nothing to wait for: ``stage`` blocks until the copy is complete."""

    def close(self) -> None:
        """Free the cached buffers (STAGE-4: raises while a snapshot is still leased)."""
        if self.pool is not None:
            self.pool.close()


def _as_staged(out: Any) -> StagedStateDict:
    if not isinstance(out, dict):
        raise TypeError("a state dict must be a dict")
    return StagedStateDict(out)
