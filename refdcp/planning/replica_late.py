"""Replica digests computed while the rank writes, compared before the commit (DEDUP-17).

When refdcp's driver runs a save, a rank's tensor replica digests (DEDUP-13)
need not hold up planning: :class:`DigestJob` computes them on a worker
thread started when the rank's plan is final, so they overlap its writes;
the rank sends them with its write results, and the coordinator compares
them with :func:`replica_value_problems` before ``StorageWriter.finish``
(the commit point, SAVE-6). A disagreement fails the save before anything
is committed, like any other failure (SAVE-7, STORE-31).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping, Sequence
from itertools import compress
from operator import ne
from typing import Any

from torch.distributed.checkpoint.planner import WriteItem

from .global_metadata import PlanValidationError
from .local_plan import replica_checksums

__all__ = ["DigestJob", "ReplicaMismatchError", "key_place", "replica_value_problems"]


class ReplicaMismatchError(PlanValidationError):
    """Ranks wrote different values under one replicated key; nothing was committed (DEDUP-17)."""

    headline = "replicas differ in value"


def key_place(key: Any) -> str:
    """How a dedup key (FQN, chunk offsets) is named in problems (DEDUP-4, DEDUP-6)."""
    fqn, off = key
    return f"{fqn!r}" + ("" if off is None else f" chunk at offsets {tuple(off)}")


def _order(key: Any) -> tuple[str, tuple[int, ...]]:
    return key[0], tuple(key[1] or ())


def replica_value_problems(sums: Sequence[Mapping[Any, int] | None]) -> list[str]:
    """One problem per key whose ranks sent different digests, in key order (DEDUP-17).

    ``sums[r]`` is rank r's digests (None: it sent none). Every digest is
    compared with the first one of its key through ``dict.setdefault`` mapped
    over whole dicts, so agreeing replicas cost no Python-level work per item.
    """
    first: dict[Any, int] = {}
    suspects: set[Any] = set()
    for s in sums:
        if s:
            keys, values = list(s), list(s.values())
            suspects.update(compress(keys, map(ne, map(first.setdefault, keys, values), values)))
    problems: list[str] = []
    for key in sorted(suspects, key=_order):
        by: dict[int, list[int]] = {}
        for rank, s in enumerate(sums):
            if s and key in s:
                by.setdefault(s[key], []).append(rank)
        desc = "; ".join(f"ranks {rs} hold checksum {v:#010x}" for v, rs in by.items())
        problems.append(f"replicas of {key_place(key)} differ in value between ranks: {desc}")
    return problems


class DigestJob:
    """The tensor replica digests of ``items`` (DEDUP-13), computed on a worker thread.

    :meth:`result` waits for them and re-raises the worker's error, so a digest
    that failed fails the save instead of being skipped.
    """

    def __init__(self, flat: Mapping[str, Any], items: Iterable[WriteItem]) -> None:
        self._sums: dict[Any, int] = {}
        self._error: BaseException | None = None
        items = list(items)
        self._thread: threading.Thread | None = None
        if items:
            self._thread = threading.Thread(
                target=self._run, args=(flat, items), name="refdcp-replica-digests", daemon=True
            )
            self._thread.start()

    def _run(self, flat: Mapping[str, Any], items: list[WriteItem]) -> None:
        try:
            self._sums = replica_checksums(flat, items, objects=False)
        except BaseException as exc:  # handed to result(), on the rank's own thread
            self._error = exc

    def result(self) -> dict[Any, int]:
        if self._thread is not None:
            self._thread.join()
        if self._error is not None:
            raise RuntimeError(f"computing replica digests failed: {self._error}") from self._error
        return self._sums
