"""Load policy: what may differ between the destination state dict and the checkpoint (POLICY-*).

All problems are collected and raised together, before any read is planned
(POLICY-1, POLICY-6).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    STORAGE_TYPES,
    BytesStorageMetadata,
    TensorStorageMetadata,
)

from refdcp.planning.errors import LoadPolicyError

from .flatten import is_tensor_like

__all__ = ["LoadPolicy", "LoadPolicyError", "check_load"]


@dataclass(frozen=True)
class LoadPolicy:
    """``strict``: keys of the state dict missing from the checkpoint are errors (POLICY-2);
    ``reject_unexpected``: checkpoint keys the state dict does not ask for are
    errors too (POLICY-3; off by default, so a subset loads as with torch);
    ``allow_cast``: a dtype mismatch casts instead of failing (POLICY-5);
    ``allow_pickle``: non-tensor objects load with ``weights_only=False`` (PLAN-7)."""

    strict: bool = True
    reject_unexpected: bool = False
    allow_cast: bool = False
    allow_pickle: bool = False


def _dest_dtype(obj: Any) -> torch.dtype | None:
    dtype = getattr(obj, "dtype", None)
    return dtype if isinstance(dtype, torch.dtype) else None


def check_load(
    dest: Mapping[str, Any], saved: Mapping[str, STORAGE_TYPES], policy: LoadPolicy
) -> tuple[list[str], list[str]]:
    """(keys to load, problems) for a flattened destination against the checkpoint (POLICY-1..6)."""
    problems: list[str] = []
    keys: list[str] = []
    if policy.strict:  # torch's wording first, which callers match on (API-23)
        problems += [
            f"Missing key in checkpoint state_dict: {k}. ({k!r} is in the state_dict, "
            "not in the checkpoint)"
            for k in dest
            if k not in saved
        ]
    if policy.reject_unexpected:
        unexpected = [k for k in saved if k not in dest]
        if unexpected:
            problems.append(
                f"unexpected keys (in the checkpoint, not in the state_dict): {unexpected}"
            )
    plain = (torch.Tensor, torch.nn.Parameter)
    for fqn, obj in dest.items():
        md = saved.get(fqn)
        if md is None:
            continue
        if (  # the common case: a plain tensor of the saved shape and dtype
            type(obj) in plain
            and type(md) is TensorStorageMetadata
            and obj.size() == md.size
            and (obj.dtype == md.properties.dtype or policy.allow_cast)
        ):
            keys.append(fqn)
            continue
        tensor_dest = is_tensor_like(obj)
        if isinstance(md, BytesStorageMetadata):
            if tensor_dest:
                problems.append(
                    f"{fqn!r}: the checkpoint holds a non-tensor object, the state_dict a tensor"
                )
                continue
        elif isinstance(md, TensorStorageMetadata):
            if not tensor_dest:
                problems.append(
                    f"{fqn!r}: the checkpoint holds a tensor, the state_dict a {type(obj).__name__}"
                )
                continue
            shape = tuple(obj.size())
            if shape != tuple(md.size):
                problems.append(  # torch's wording first (API-23)
                    f"Size mismatch between saved {md.size} and current: {obj.size()} for {fqn} "
                    f"({fqn!r}: shape mismatch: checkpoint {list(md.size)}, "
                    f"state_dict {list(shape)})"
                )
            dtype = _dest_dtype(obj)
            if dtype is not None and dtype != md.properties.dtype and not policy.allow_cast:
                problems.append(
                    f"{fqn!r}: dtype mismatch: checkpoint {md.properties.dtype}, state_dict {dtype} "
                    "(pass allow_cast=True to cast)"
                )
        keys.append(fqn)
    return keys, problems
