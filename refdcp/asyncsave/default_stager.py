"""The stager ``async_save`` uses when none is given: cached buffers, bounded, releasable (ASYNC-30).

A fresh copy per save (torch's default) pays for new memory every time: page
faults on first touch, or pages the host must hand back, cost several times
the copy itself. ``async_save`` instead keeps the last snapshot's buffers
and copies the next save with the same structure (keys, shapes, dtypes) into
them, so a steady-state save costs about one memcpy.

* One default stager per explicit communicator (each fake-world rank has its
  own, as it has its own in-flight limit), else one per process.
* Memory it holds: at most ``MAX_SETS`` buffer sets, each the size of one
  staged state dict; between saves of an unchanged structure, one. A set of
  another structure is evicted when a new one needs the room.
* :func:`release_staging_buffers` frees every set no save in flight is
  using, at once; pass ``stager=CpuStager()`` to ``async_save`` for a fresh
  copy per save instead.

Isolation is the buffer pool's (STAGE-11, STAGE-12): a set is leased to one
snapshot from staging until its save ends, so two saves in flight never
share a buffer, and the source may change as soon as ``staged`` resolves.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

from refdcp.comm.base import Communicator
from refdcp.staging.cpu_stager import CpuStager

__all__ = ["MAX_SETS", "default_stager", "release_staging_buffers"]

#: Buffer sets one default stager may hold (saves in flight at once, or alternating structures).
MAX_SETS = 2

_LOCK = threading.Lock()
_PROCESS: CpuStager | None = None
_PER_COMM: weakref.WeakKeyDictionary[Any, CpuStager] = weakref.WeakKeyDictionary()


def _new() -> CpuStager:
    return CpuStager(cache_staged_state_dict=True, max_buffer_sets=MAX_SETS)


def default_stager(comm: Communicator | None = None) -> CpuStager:
    """The cached stager for ``comm`` (or for this process when ``comm`` is None)."""
    global _PROCESS
    with _LOCK:
        if comm is not None:
            try:
                stager = _PER_COMM.get(comm)
                if stager is None:
                    stager = _PER_COMM[comm] = _new()
                return stager
            except TypeError:  # not weak-referenceable: share the process's
                pass
        if _PROCESS is None:
            _PROCESS = _new()
        return _PROCESS


def release_staging_buffers() -> int:
    """Free the default stagers' buffer sets that no save in flight uses; return the bytes still held.

    Safe at any time: a set leased by a save in flight is kept (and reused or
    evicted later as usual); the next ``async_save`` allocates what it needs.
    """
    with _LOCK:
        stagers = [s for s in (_PROCESS, *_PER_COMM.values()) if s is not None]
    held = 0
    for stager in stagers:
        assert stager.pool is not None
        held += stager.pool.trim()
    return held
