"""The checkpoint process groups of background saves and their communicators, in one registry (COMM-54).

A background save must not share a process group with the training loop
(ASYNC-6), so each process group (None = WORLD) gets a dedicated Gloo group,
created once and cached with its :class:`~refdcp.comm.TorchDistComm`. Entries
are keyed by the group's rank tuple, never by ``id()`` (an id is reused once
its object is collected, which would hand back another group's Gloo group),
and the cache is dropped when the default process group is replaced
(``destroy_process_group`` then ``init_process_group``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from refdcp.comm.base import Communicator

__all__ = ["REGISTRY", "GroupRegistry", "checkpoint_process_group"]

Ranks = tuple[int, ...] | None  # None: the whole default group


def _ranks_of(process_group: Any) -> Ranks:
    return None if process_group is None else tuple(dist.get_process_group_ranks(process_group))


def _new_gloo_group(ranks: Ranks) -> Any:
    return dist.new_group(ranks=None if ranks is None else list(ranks), backend="gloo")


def _default_group() -> Any:
    return dist.group.WORLD


def _torchdist_comm(group: Any) -> Communicator:
    from refdcp.comm.torchdist import TorchDistComm

    return TorchDistComm(group)


class GroupRegistry:
    """Rank tuple -> (checkpoint Gloo group, its Communicator), under one lock (COMM-54).

    The four callables are the torch.distributed calls it needs; tests pass
    fakes. Creating a group is collective, as with ``dist.new_group``: every
    rank of the default group must ask for a given rank tuple.
    """

    def __init__(
        self,
        *,
        ranks_of: Callable[[Any], Ranks] = _ranks_of,
        new_group: Callable[[Ranks], Any] = _new_gloo_group,
        default_group: Callable[[], Any] = _default_group,
        make_comm: Callable[[Any], Communicator] = _torchdist_comm,
    ) -> None:
        self._ranks_of = ranks_of
        self._new_group = new_group
        self._default_group = default_group
        self._make_comm = make_comm
        self._lock = threading.Lock()
        self._world: Any = None  # the default group the entries were made under (held strongly)
        self._groups: dict[Ranks, Any] = {}
        self._comms: dict[Ranks, Communicator] = {}

    def _current(self) -> None:
        world = self._default_group()
        if world is not self._world:  # a new default group: every cached group is stale
            self._world = world
            self._groups.clear()
            self._comms.clear()

    def group(self, process_group: Any = None) -> Any:
        """The dedicated checkpoint group for ``process_group``'s ranks."""
        key = self._ranks_of(process_group)
        with self._lock:
            self._current()
            group = self._groups.get(key)
            if group is None:
                group = self._groups[key] = self._new_group(key)
            return group

    def comm(self, process_group: Any = None) -> Communicator:
        """The Communicator over :meth:`group` (one per rank tuple)."""
        group = self.group(process_group)
        key = self._ranks_of(process_group)
        with self._lock:
            comm = self._comms.get(key)
            if comm is None:
                comm = self._comms[key] = self._make_comm(group)
            return comm

    def clear(self) -> None:
        with self._lock:
            self._groups.clear()
            self._comms.clear()
            self._world = None


#: The process's registry.
REGISTRY = GroupRegistry()


def checkpoint_process_group(process_group: Any = None) -> Any:
    """A dedicated Gloo group for background checkpoint collectives (ASYNC-6).

    Created once per rank tuple of ``process_group`` (None = WORLD) and
    cached. Creating it is itself collective: every rank of the default group
    must reach the first ``async_save`` for a given group, as with
    ``dist.new_group``.
    """
    return REGISTRY.group(process_group)
