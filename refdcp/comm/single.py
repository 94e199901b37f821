"""A world of one rank: every collective is local (spec/comm.md, COMM-10, COMM-11)."""

from __future__ import annotations

from typing import Any

from refdcp.comm.base import DEFAULT_TIMEOUT_S

__all__ = ["SingleRank"]


class SingleRank:
    """Rank 0 of a world of size 1, its own coordinator (COMM-10).

    Collectives never block and pass objects by reference, as torch does with
    ``no_dist=True`` (COMM-11): nothing is pickled, so unpicklable plans work.
    """

    def __init__(self, timeout: float = DEFAULT_TIMEOUT_S) -> None:
        if timeout <= 0:
            raise ValueError(f"timeout must be positive, got {timeout}")
        self._timeout = float(timeout)

    @property
    def rank(self) -> int:
        return 0

    @property
    def world_size(self) -> int:
        return 1

    @property
    def coordinator_rank(self) -> int:
        return 0

    @property
    def timeout(self) -> float:
        return self._timeout

    def gather(self, obj: Any, *, timeout: float | None = None) -> list[Any] | None:
        return [obj]

    def scatter(self, objs: list[Any] | None, *, timeout: float | None = None) -> Any:
        if objs is None or len(objs) != 1:
            raise ValueError(f"scatter on the coordinator needs a list of 1 object, got {objs!r}")
        return objs[0]

    def broadcast(self, obj: Any, *, timeout: float | None = None) -> Any:
        return obj

    def all_gather(self, obj: Any, *, timeout: float | None = None) -> list[Any]:
        return [obj]

    def barrier(self, *, timeout: float | None = None) -> None:
        return None

    def __repr__(self) -> str:
        return f"SingleRank(timeout={self._timeout:g})"
