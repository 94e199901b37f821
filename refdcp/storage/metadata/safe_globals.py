"""The allow-list of non-tensor values that load by default (LOAD-7..9).

refdcp unpickles saved objects with ``torch.load(weights_only=True)``
(PLAN-7): only globals on an allow-list may be referenced, so loading can
never run code. Torch's own list covers Python's primitives and containers;
:func:`default_safe_globals` adds the common data-only types found in training
checkpoints. Each entry is rebuilt from plain data by C code or by a stdlib
constructor that only validates and stores its arguments:

* numpy arrays (any dtype, structured and object arrays included: the
  elements go through the same allow-list), numpy scalars and dtypes, so
  ``np.random.get_state()`` loads;
* ``argparse.Namespace`` (its ``__dict__`` is restored, no ``__setstate__``);
* ``datetime.date/time/datetime/timedelta/timezone``, ``decimal.Decimal``,
  ``fractions.Fraction``, ``uuid.UUID``;
* ``frozenset``, ``slice``, ``range``;
* the ``pathlib`` path classes (built from strings, no I/O);
* ``io.BytesIO`` (its buffer, position and ``__dict__`` are restored by C code), so a
  ``BytesIO`` value round-trips as it does with torch (API-24); ``bytes()`` with no
  argument, which pickles an empty ``bytes`` (``bytes(n)`` stays refused).

Not on the list: ``collections.deque`` and ``defaultdict`` (torch's weights-only
unpickler cannot rebuild them), and, on purpose, user-defined classes (dataclasses, Enums, ...).
Referencing one imports its module, which runs that module's code, so it
must be the caller's decision: ``refdcp.load(..., safe_globals=[MyEnum])`` or
``DefaultLoadPlanner(safe_globals=[...])``.
"""

from __future__ import annotations

import argparse
import datetime
import decimal
import fractions
import io
import pathlib
import pickle
import re
import threading
import uuid
from typing import IO, Any

import torch

from refdcp.storage.errors import UnsafeObjectError

__all__ = [
    "ALLOW_LIST_LOCK",
    "UnsafeObjectError",
    "default_safe_globals",
    "refused_global",
    "unpickler_detail",
]


def _numpy_globals() -> list[Any]:
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy ships with torch's test deps
        return []
    try:
        from numpy._core import multiarray
    except ImportError:  # pragma: no cover - numpy < 2
        from numpy.core import multiarray  # type: ignore[no-redef]
    out: list[Any] = [
        np.ndarray,
        np.dtype,
        multiarray._reconstruct,
        multiarray.scalar,
        # the names numpy 1.x wrote into pickles
        (multiarray._reconstruct, "numpy.core.multiarray._reconstruct"),
        (multiarray.scalar, "numpy.core.multiarray.scalar"),
    ]
    dtypes = getattr(np, "dtypes", None)
    if dtypes is not None:
        out += [
            getattr(dtypes, n)
            for n in dir(dtypes)
            if n.endswith("DType") and isinstance(getattr(dtypes, n), type)
        ]
    return out


def default_safe_globals() -> list[Any]:
    """Every global that non-tensor values may reference when loaded by default (LOAD-7).

    The fast path's one place for the default allow-list: the load planner passes it to
    ``torch.load(weights_only=True)``; save-time loadability checks use it too. The
    reference path states it again, readably, and is tested equal (REF-15).
    Entries are classes/functions or ``(object, "module.name")`` pairs, as
    ``torch.serialization.safe_globals`` takes them.
    """
    return [
        *_numpy_globals(),
        argparse.Namespace,
        datetime.date,
        datetime.time,
        datetime.datetime,
        datetime.timedelta,
        datetime.timezone,
        decimal.Decimal,
        fractions.Fraction,
        uuid.UUID,
        frozenset,
        slice,
        range,
        pathlib.PurePath,
        pathlib.PurePosixPath,
        pathlib.PureWindowsPath,
        pathlib.Path,
        pathlib.PosixPath,
        pathlib.WindowsPath,
        io.BytesIO,
        (_empty_bytes, "builtins.bytes"),
    ]


def _empty_bytes(*args: object) -> bytes:
    """What a pickle's ``bytes()`` call (an empty ``bytes`` or ``BytesIO`` value) rebuilds:
    ``b""`` and nothing else, so a pickle cannot ask for ``bytes(n)`` (n zero bytes)."""
    if args:
        raise pickle.UnpicklingError("only bytes() with no argument is allowed (LOAD-7)")
    return b""


def refused_global(message: str) -> str | None:
    """The ``module.name`` a weights-only unpickler refused, from torch's error text, if any."""
    m = re.search(r"GLOBAL ([\w.]+)", message)
    return m.group(1) if m else None


def unpickler_detail(message: str) -> str:
    """The weights-only unpickler's own reason, from torch's error text."""
    m = re.search(r"WeightsUnpickler error:\s*(.+?)\s*(?:\n\s*\n|$)", message, re.S)
    return m.group(1).strip() if m else ""


#: torch keeps its weights-only allow-list in one process-wide list, and its
#: ``safe_globals`` context restores that list on exit: two threads loading at once (the
#: ranks of a FakeWorld) would each remove the other's globals mid-load (LOAD-7). The
#: reference path (refdcp/reference/policy.py) takes the same lock.
ALLOW_LIST_LOCK = threading.Lock()


def load_weights_only(data: IO[bytes], extra: list[Any]) -> Any:
    """``torch.load(data, weights_only=True)`` with the default allow-list plus ``extra``,
    one thread at a time, so concurrent loads never see each other's list (LOAD-7, LOAD-8)."""
    with ALLOW_LIST_LOCK, torch.serialization.safe_globals([*default_safe_globals(), *extra]):
        return torch.load(data, map_location="cpu", weights_only=True)
