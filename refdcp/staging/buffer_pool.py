"""Cached staging buffers reused across saves, with leases (STAGE-3, STAGE-5, STAGE-11).

A *buffer set* holds one CPU tensor per slot of a :data:`Layout`. Staging
leases a set (state machine: :mod:`refdcp.staging.machine`); the save that
reads the snapshot releases it. A leased set is never handed out again.

Policy when every set is leased (STAGE-5): a new set is allocated while the
pool holds fewer than ``max_sets`` sets and the total stays within
``max_bytes``; otherwise ``acquire`` waits for a release, at most
``wait_timeout`` seconds, then raises :class:`StagingTimeoutError`.
"""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass, field

import torch

from refdcp.errors import StagingTimeoutError
from refdcp.staging.machine import LEASED, Action, Event, State, step
from refdcp.staging.tree import Layout, nbytes_of

__all__ = ["BufferPool", "BufferSet", "Lease", "StagingTimeoutError", "allocate"]


def allocate(
    layout: Layout, *, pin_memory: bool = False, share_memory: bool = False
) -> list[torch.Tensor | None]:
    """Fresh contiguous CPU buffers for ``layout`` (``None`` for alias slots), the one allocator."""
    out: list[torch.Tensor | None] = []
    for slot in layout:
        if slot.alias_of is not None:
            out.append(None)
            continue
        t = torch.empty(slot.shape, dtype=slot.dtype, pin_memory=pin_memory)
        if share_memory:
            t.share_memory_()  # type: ignore[no-untyped-call]
        out.append(t)
    return out


@dataclass(eq=False)
class BufferSet:
    """One set of CPU buffers for a layout, with its machine state."""

    ident: int
    layout: Layout
    buffers: list[torch.Tensor | None]
    nbytes: int
    state: State = State.IDLE
    uses: int = 0


@dataclass(eq=False)
class Lease:
    """The right to read one buffer set until :meth:`release` (STAGE-3)."""

    pool: BufferPool
    bset: BufferSet
    released: bool = field(default=False)

    @property
    def buffers(self) -> list[torch.Tensor | None]:
        return self.bset.buffers

    def release(self) -> None:
        """Give the buffers back; a second call is a no-op."""
        self.pool._release(self)


class BufferPool:
    """Buffer sets keyed by layout, leased to one snapshot at a time (STAGE-11)."""

    def __init__(
        self,
        *,
        pin_memory: bool = False,
        share_memory: bool = False,
        max_sets: int = 2,
        max_bytes: int | None = None,
        wait_timeout: float = 600.0,
    ) -> None:
        if max_sets < 1:
            raise ValueError("max_sets must be at least 1")
        self.pin_memory = pin_memory
        self.share_memory = share_memory
        self.max_sets = max_sets
        self.max_bytes = max_bytes
        self.wait_timeout = wait_timeout
        self._sets: list[BufferSet] = []
        self._cond = threading.Condition(threading.RLock())
        self._ids = itertools.count()
        self.allocations = 0  # buffer sets allocated so far (for tests and benchmarks)
        self._closed = False

    # -- observation -------------------------------------------------------
    def states(self) -> list[State]:
        """The state of every buffer set the pool holds."""
        with self._cond:
            return [s.state for s in self._sets]

    @property
    def held_bytes(self) -> int:
        with self._cond:
            return sum(s.nbytes for s in self._sets)

    # -- leasing -----------------------------------------------------------
    def acquire(self, layout: Layout, *, timeout: float | None = None) -> Lease:
        """Lease a buffer set for ``layout``, allocating or waiting per STAGE-5."""
        need = nbytes_of(layout)
        if self.max_bytes is not None and need > self.max_bytes:
            raise ValueError(
                f"staging needs {need} bytes, more than the pool's max_bytes={self.max_bytes}"
            )
        wait = self.wait_timeout if timeout is None else timeout
        deadline = time.monotonic() + wait
        with self._cond:
            while True:
                if self._closed:
                    raise RuntimeError("the staging buffer pool is closed")
                bset = self._free_matching(layout)
                if bset is None:
                    bset = self._try_allocate(layout, need)
                if bset is not None:
                    self._apply(bset, Event.STAGE)
                    bset.uses += 1
                    return Lease(self, bset)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise StagingTimeoutError(
                        f"all {len(self._sets)} staging buffer sets are leased by saves in "
                        f"flight; none was released within {wait:.1f} s (STAGE-5)"
                    )
                self._cond.wait(remaining)

    def copy_done(self, lease: Lease) -> None:
        """The snapshot in ``lease`` is complete."""
        with self._cond:
            self._apply(lease.bset, Event.COPY_DONE)

    def copy_failed(self, lease: Lease) -> None:
        """Staging into ``lease`` failed; the buffers return to the pool."""
        with self._cond:
            if not lease.released:
                lease.released = True
                self._apply(lease.bset, Event.COPY_FAILED)
                self._cond.notify_all()

    def _release(self, lease: Lease) -> None:
        with self._cond:
            if lease.released:
                return
            lease.released = True
            self._apply(lease.bset, Event.RELEASE)
            self._cond.notify_all()

    def trim(self) -> int:
        """Free every buffer set not leased now; return the bytes the leased ones still hold (ASYNC-31)."""
        with self._cond:
            for bset in [s for s in self._sets if s.state in (State.IDLE, State.RELEASED)]:
                self._apply(bset, Event.CLOSE)
                self._sets.remove(bset)
            return sum(s.nbytes for s in self._sets)

    def close(self) -> None:
        """Free every buffer set; raises ProtocolError if one is still leased (STAGE-4)."""
        with self._cond:
            for bset in self._sets:
                if bset.state in LEASED:
                    self._apply(bset, Event.CLOSE)  # raises
            for bset in self._sets:
                self._apply(bset, Event.CLOSE)
            self._sets.clear()
            self._closed = True
            self._cond.notify_all()

    # -- internals -----------------------------------------------------------
    def _apply(self, bset: BufferSet, event: Event) -> Action:
        nxt, action = step(bset.state, event)
        bset.state = nxt
        if action is Action.FREE:
            bset.buffers = []
        return action

    def _free_matching(self, layout: Layout) -> BufferSet | None:
        for bset in self._sets:
            if bset.state in (State.IDLE, State.RELEASED) and bset.layout == layout:
                return bset
        return None

    def _try_allocate(self, layout: Layout, need: int) -> BufferSet | None:
        # Evict free sets of other layouts first if they stand in the way.
        while not self._room_for(need):
            victim = next((s for s in self._sets if s.state in (State.IDLE, State.RELEASED)), None)
            if victim is None:
                return None
            self._apply(victim, Event.CLOSE)
            self._sets.remove(victim)
        bset = BufferSet(next(self._ids), layout, self._allocate(layout), need)
        self._sets.append(bset)
        self.allocations += 1
        return bset

    def _room_for(self, need: int) -> bool:
        if len(self._sets) >= self.max_sets:
            return False
        held = sum(s.nbytes for s in self._sets)
        return self.max_bytes is None or held + need <= self.max_bytes

    def _allocate(self, layout: Layout) -> list[torch.Tensor | None]:
        return allocate(layout, pin_memory=self.pin_memory, share_memory=self.share_memory)
