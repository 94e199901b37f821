"""Dense integer ids of hashable values, assigned in C (DEDUP-8, META-1..4).

Planning at thousands of ranks handles millions of write items; turning FQNs,
offsets and shapes into small integers once lets every later step run as
numpy over int arrays instead of Python over objects.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

__all__ = ["DenseIds", "IdArray", "dense_ids", "dense_ids_of_names"]

#: ids as int32: half the memory of int64 (fewer than 2**31 items always)
IdArray = np.ndarray[Any, np.dtype[np.int32]]


class DenseIds(dict[Any, int]):
    """Maps each distinct value to 0, 1, 2, ... in order of first lookup.

    A lookup of a known value runs in C (``dict.__getitem__``); only a new
    value calls the Python ``__missing__``. The keys, in id order, are the
    first-seen objects of each value.
    """

    def __missing__(self, key: Any) -> int:
        n = self[key] = len(self)
        return n


def dense_ids(ids: DenseIds, values: Iterable[Any], n: int) -> IdArray:
    """The ids of ``n`` values, as an array, adding new values to ``ids``."""
    return np.fromiter(map(ids.__getitem__, values), dtype=np.int32, count=n)


def dense_ids_of_names(
    values: Sequence[Any],
) -> tuple[dict[Any, int], IdArray]:
    """Ids of values that may be mostly distinct (FQNs): C passes only, no Python call per value.

    Returns the id of each distinct value (in order of first appearance) and
    the ids of ``values``.
    """
    ids = dict(zip(dict.fromkeys(values), range(len(values))))
    return ids, np.fromiter(map(ids.__getitem__, values), dtype=np.int32, count=len(values))
