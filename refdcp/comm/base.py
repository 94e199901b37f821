"""The Communicator protocol: object collectives with timeouts (spec/comm.md).

A Communicator is all the protocol drivers know of "distributed": a rank, a
world size, a coordinator, and five collectives over picklable Python objects.
Every collective takes an optional ``timeout`` in seconds; ``None`` means the
communicator's default (``comm.timeout``). A collective that cannot complete
raises :class:`refdcp.errors.CommTimeout` or :class:`refdcp.errors.CommAborted`
instead of blocking forever (COMM-5, COMM-6).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

__all__ = ["Communicator", "DEFAULT_TIMEOUT_S"]

#: Default collective timeout for real process groups (seconds).
DEFAULT_TIMEOUT_S = 1800.0


@runtime_checkable
class Communicator(Protocol):
    """Object collectives among ``world_size`` ranks (COMM-1)."""

    @property
    def rank(self) -> int:
        """This rank, in ``range(world_size)``."""
        ...

    @property
    def world_size(self) -> int: ...

    @property
    def coordinator_rank(self) -> int:
        """The rank that gathers plans and commits (COMM-2)."""
        ...

    @property
    def timeout(self) -> float:
        """Default timeout of every collective, in seconds."""
        ...

    def gather(self, obj: Any, *, timeout: float | None = None) -> list[Any] | None:
        """Send ``obj`` to the coordinator; it gets the list in rank order, others get None."""
        ...

    def scatter(self, objs: list[Any] | None, *, timeout: float | None = None) -> Any:
        """The coordinator passes one object per rank; each rank returns its own."""
        ...

    def broadcast(self, obj: Any, *, timeout: float | None = None) -> Any:
        """Every rank returns the coordinator's ``obj`` (others pass anything, usually None)."""
        ...

    def all_gather(self, obj: Any, *, timeout: float | None = None) -> list[Any]:
        """Every rank returns the list of all ranks' objects in rank order."""
        ...

    def barrier(self, *, timeout: float | None = None) -> None:
        """Return once every rank has entered the barrier."""
        ...


def is_coordinator(comm: Communicator) -> bool:
    """True on the coordinator rank."""
    return comm.rank == comm.coordinator_rank
