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

import contextlib
import hashlib
import os
import sys
import threading
from array import array
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import compress
from operator import ne
from typing import Any

from torch.distributed.checkpoint.planner import WriteItem

from refdcp.crc.pieces import TwoEnds
from refdcp.planning.errors import ReplicaMismatchError
from refdcp.planning.local_plan import digest_units, replica_tensors

__all__ = [
    "DigestJob",
    "RankDigests",
    "ReplicaMismatchError",
    "group_of",
    "key_place",
    "replica_problems",
    "replica_value_problems",
]


def key_place(key: Any) -> str:
    """How a dedup key (FQN, chunk offsets) is named in problems (DEDUP-4, DEDUP-6)."""
    fqn, off = key
    return f"{fqn!r}" + ("" if off is None else f" chunk at offsets {tuple(off)}")


def _order(key: Any) -> tuple[str, tuple[int, ...]]:
    return key[0], tuple(key[1] or ())


@dataclass(frozen=True)
class RankDigests:
    """One rank's value digests (DEDUP-17), keyed like dedup keys items, in its items'
    order; ``group`` names the dict exactly: ranks whose local plans are identical and
    whose digests are equal send the same ``group`` (None: not comparable that way)."""

    sums: dict[Any, int]
    group: bytes | None = None


def group_of(structure: bytes, sums: Mapping[Any, int]) -> bytes:
    """``RankDigests.group`` of digests whose keys and order ``structure`` names (DEDUP-17)."""
    values = array("I", sums.values()).tobytes()
    return hashlib.blake2b(structure + values, digest_size=16).digest()


def replica_problems(digests: Sequence[RankDigests | None]) -> list[str]:
    """:func:`replica_value_problems` of every rank's digests; a rank whose ``group`` an
    earlier rank sent holds the same dict, so only the first of each group is screened."""
    seen: set[bytes] = set()
    screen = [True] * len(digests)
    for r, d in enumerate(digests):
        if d is not None and d.group is not None:
            screen[r] = d.group not in seen
            seen.add(d.group)
    return replica_value_problems([d.sums if d else None for d in digests], screen)


def replica_value_problems(
    sums: Sequence[Mapping[Any, int] | None], screen: Sequence[bool] | None = None
) -> list[str]:
    """One problem per key whose ranks sent different digests, in key order (DEDUP-17).

    ``sums[r]`` is rank r's digests (None: it sent none). Every digest is
    compared with the first one of its key through ``dict.setdefault`` mapped
    over whole dicts, so agreeing replicas cost no Python-level work per item;
    ranks with ``screen[r]`` False hold a dict equal to a screened one's and are
    only named in the problems.
    """
    first: dict[Any, int] = {}
    suspects: set[Any] = set()
    for r, s in enumerate(sums):
        if s and (screen is None or screen[r]):
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


def _lower_priority() -> None:
    """This thread only, to the lowest CPU priority (Linux; elsewhere nothing) (DEDUP-17)."""
    if sys.platform == "linux":
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)


class DigestJob:
    """The value digests of the tensor ``items`` (DEDUP-17), computed while the rank writes.

    A worker thread resolves the items, then takes units of work (pieces of large
    tensors, batches of small ones) from the front at the lowest CPU priority, so it
    uses the CPU time the write leaves idle instead of slowing it; :meth:`result`,
    called once the rank has written, takes the rest from the back on the rank's own
    thread, so a starved worker delays nothing, and re-raises the worker's error.
    """

    def __init__(self, flat: Mapping[str, Any], items: Iterable[WriteItem]) -> None:
        self._keys: list[Any] = []
        self._work: TwoEnds | None = None
        self._combine: Callable[[], list[int]] | None = None
        self._error: BaseException | None = None
        self._ready = threading.Event()
        items = list(items)
        self._thread: threading.Thread | None = None
        if not items:
            self._ready.set()
            return
        self._thread = threading.Thread(
            target=self._run, args=(flat, items), name="refdcp-replica-digests", daemon=True
        )
        self._thread.start()

    def _run(self, flat: Mapping[str, Any], items: list[WriteItem]) -> None:
        try:
            keys, tensors, seeds = replica_tensors(flat, items, framed=True)
            units, combine, _ = digest_units(tensors, seeds)
            self._keys, self._combine, self._work = keys, combine, TwoEnds(units)
        except BaseException as exc:  # handed to result(), on the rank's own thread
            self._error = exc
            return
        finally:
            self._ready.set()
        _lower_priority()
        self._work.help()

    def _fail(self, exc: BaseException) -> RuntimeError:
        return RuntimeError(f"computing replica digests failed: {exc}")

    def result(self) -> dict[Any, int]:
        self._ready.wait()
        if self._error is not None:
            raise self._fail(self._error) from self._error
        if self._work is None or self._combine is None:
            return {}
        try:
            self._work.finish()
        except BaseException as exc:
            raise self._fail(exc) from exc
        return dict(zip(self._keys, self._combine()))

    def stop(self) -> None:
        """Take no more units; return once the worker has stopped reading the values."""
        self._ready.wait()
        if self._work is not None:
            self._work.stop()
