"""What a load accepts, written to be read (POLICY-1..6, LOAD-7..9, REF-15).

Two rules. :func:`check_load` compares the flattened destination with the
checkpoint's metadata and lists every problem before any read (POLICY-1).
:func:`unpickle_value` rebuilds a saved non-tensor value with torch's weights-only
unpickler, which builds only globals on an allow-list (PLAN-7): torch's own list of
primitives and containers plus :func:`allow_list`, the data-only types common in
training checkpoints (LOAD-7), plus what the caller names in ``safe_globals=``.
"""

from __future__ import annotations

import argparse
import datetime
import decimal
import fractions
import importlib
import io
import pathlib
import pickle
import re
import uuid
from collections.abc import Mapping, Sequence
from typing import IO, Any

import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

from refdcp.storage.errors import UnsafeObjectError

# one lock for both paths: torch keeps the weights-only allow-list in one process-wide list
from refdcp.storage.metadata.safe_globals import ALLOW_LIST_LOCK

from .flatten import is_tensor_like

__all__ = ["allow_list", "check_load", "unpickle_value"]


def check_load(
    dest: Mapping[str, Any],
    saved: Mapping[str, Any],
    *,
    strict: bool = True,
    reject_unexpected: bool = False,
    allow_cast: bool = False,
) -> tuple[list[str], list[str]]:
    """The keys to read and every problem (POLICY-1): a destination key the checkpoint lacks
    when ``strict`` (POLICY-2), checkpoint keys the destination lacks when
    ``reject_unexpected`` (POLICY-3), a tensor where an object was saved or the reverse,
    another shape, or another dtype unless ``allow_cast`` (POLICY-4, POLICY-5)."""
    problems = []
    if strict:  # torch's wording first, which callers match on (API-23)
        for key in dest:
            if key not in saved:
                problems.append(
                    f"Missing key in checkpoint state_dict: {key}. ({key!r} is in the "
                    "state_dict, not in the checkpoint)"
                )
    if reject_unexpected:
        unexpected = [key for key in saved if key not in dest]
        if unexpected:
            problems.append(
                f"unexpected keys (in the checkpoint, not in the state_dict): {unexpected}"
            )
    keys = []
    for fqn, value in dest.items():
        if fqn not in saved:
            continue
        md = saved[fqn]
        if isinstance(md, BytesStorageMetadata) and is_tensor_like(value):
            problems.append(
                f"{fqn!r}: the checkpoint holds a non-tensor object, the state_dict a tensor"
            )
            continue
        if isinstance(md, TensorStorageMetadata):
            if not is_tensor_like(value):
                problems.append(
                    f"{fqn!r}: the checkpoint holds a tensor, the state_dict a "
                    f"{type(value).__name__}"
                )
                continue
            if tuple(value.size()) != tuple(md.size):
                problems.append(  # torch's wording first (API-23)
                    f"Size mismatch between saved {md.size} and current: {value.size()} for "
                    f"{fqn} ({fqn!r}: shape mismatch: checkpoint {list(md.size)}, "
                    f"state_dict {list(value.size())})"
                )
            dtype = getattr(value, "dtype", None)
            wrong_dtype = isinstance(dtype, torch.dtype) and dtype != md.properties.dtype
            if wrong_dtype and not allow_cast:
                problems.append(
                    f"{fqn!r}: dtype mismatch: checkpoint {md.properties.dtype}, state_dict "
                    f"{dtype} (pass allow_cast=True to cast)"
                )
        keys.append(fqn)
    return keys, problems


def allow_list() -> list[Any]:
    """The globals a saved value may reference in a default load, beside torch's own (LOAD-7):
    numpy arrays, scalars and dtypes; ``argparse.Namespace``; dates and times; exact numbers;
    UUIDs; ``frozenset``, ``slice``, ``range``; ``pathlib`` paths; ``io.BytesIO``; and
    ``bytes()`` without an argument. Each is rebuilt from plain data and runs no code."""
    return [
        *_numpy_types(),
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


def _numpy_types() -> list[Any]:
    """numpy's array, dtype and scalar types, found by name (numpy need not be installed)."""
    try:
        numpy = importlib.import_module("numpy")
    except ImportError:
        return []
    try:
        multiarray = importlib.import_module("numpy._core.multiarray")
    except ImportError:  # numpy 1.x
        multiarray = importlib.import_module("numpy.core.multiarray")
    found = [numpy.ndarray, numpy.dtype, multiarray._reconstruct, multiarray.scalar]
    # the names numpy 1.x wrote into pickles for the same two functions
    found.append((multiarray._reconstruct, "numpy.core.multiarray._reconstruct"))
    found.append((multiarray.scalar, "numpy.core.multiarray.scalar"))
    dtypes = getattr(numpy, "dtypes", None)
    for name in dir(dtypes) if dtypes is not None else []:
        if name.endswith("DType") and isinstance(getattr(dtypes, name), type):
            found.append(getattr(dtypes, name))
    return found


def _empty_bytes(*args: object) -> bytes:
    """What a pickled ``bytes()`` call may build: ``b""`` only, never ``bytes(n)``."""
    if args:
        raise pickle.UnpicklingError("only bytes() with no argument is allowed (LOAD-7)")
    return b""


def unpickle_value(fqn: str, data: IO[bytes], safe_globals: Sequence[Any] = ()) -> Any:
    """``torch.load(data, weights_only=True)`` allowing :func:`allow_list` and ``safe_globals``
    (LOAD-7, LOAD-8); a refusal is an ``UnsafeObjectError`` naming ``fqn``, the refused global
    and the unpickler's reason (LOAD-9)."""
    with ALLOW_LIST_LOCK, torch.serialization.safe_globals([*allow_list(), *safe_globals]):
        try:
            return torch.load(data, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as exc:
            text = str(exc)
            refused = re.search(r"GLOBAL ([\w.]+)", text)
            reason = re.search(r"WeightsUnpickler error:\s*(.+?)\s*(\n\s*\n|$)", text, re.S)
            raise UnsafeObjectError(
                fqn, refused.group(1) if refused else None, reason.group(1) if reason else ""
            ) from exc
