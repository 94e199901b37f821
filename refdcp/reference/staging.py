"""The reference stager: a fresh CPU copy of a state dict that training cannot change (REF-10).

Staging is one walk over the state dict (STAGE-6..STAGE-10, STAGE-17, STAGE-19):

* ``dict``, ``list``, ``tuple`` and namedtuple containers are rebuilt with the
  same keys in the same order (STAGE-9);
* a plain tensor is copied into a new contiguous CPU tensor of its shape and
  dtype, holding only its own elements (STAGE-7); the same tensor object met
  twice is copied once and both places share the copy (STAGE-8);
* a ``LocalShards`` is rebuilt around copies of its chunk tensors (STAGE-17),
  and a DTensor around a copy of its local shard, with the same mesh,
  placements and global shape (STAGE-19);
* any other value is deep-copied (STAGE-9), a ShardedTensor too (its own
  deepcopy copies its local shards); one that cannot be copied fails with
  ``UnloadableValueError`` naming its key path, type and cause (ASYNC-17).

Every ``stage`` allocates a new copy: there is no buffer pool, so nothing is
leased and nothing needs releasing (``refdcp``'s cached stager is the fast
version, STAGE-11).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.tensor import DTensor

from refdcp.planning.errors import UnloadableValueError
from refdcp.planning.local_shards import LocalShards

from .local_shards import LocalShards as ReferenceLocalShards

__all__ = ["CpuStager", "ReferenceStager", "release_staging_buffers"]

#: The leaves ``type_check=True`` accepts besides tensors (STAGE-10).
PLAIN_LEAVES = (int, float, complex, bool, str, bytes, type(None))


class ReferenceStager(AsyncStager):
    """Stage a state dict as a fresh CPU copy, blocking until it is complete (REF-10, STAGE-6, STAGE-16).

    It is torch's ``AsyncStager``: ``stage`` returns the snapshot itself (never
    a Future), so there is nothing to synchronize afterwards.
    ``cache_staged_state_dict`` is accepted and ignored: caching only saves
    allocations, the snapshot is the same (REF-10). With ``type_check=True`` a
    leaf other than a tensor or a plain Python value raises TypeError naming its
    path before anything is copied (STAGE-10).
    """

    _synchronize_after_execute = False

    def __init__(self, cache_staged_state_dict: bool = False, type_check: bool = False) -> None:
        self.cache_staged_state_dict = cache_staged_state_dict
        self.type_check = type_check

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """A snapshot of ``state_dict`` that later changes to its source cannot reach (STAGE-6)."""
        if self.type_check:
            _check_leaves(state_dict, ())
        copies: dict[int, torch.Tensor] = {}  # id of a source tensor -> its copy (STAGE-8)
        memo: dict[int, Any] = {}  # deepcopy's memo, shared by all other leaves
        snapshot: dict[str, Any] = _copy(state_dict, (), copies, memo)
        return snapshot

    def synchronize_staging(self) -> None:
        """Nothing to wait for: ``stage`` returned a complete snapshot (REF-10)."""

    def close(self) -> None:
        """Nothing to free: each snapshot is its own memory, freed with it (REF-10)."""


#: ``refdcp.reference.CpuStager`` is the reference stager, as ``refdcp.CpuStager`` is the fast one.
CpuStager = ReferenceStager


def release_staging_buffers() -> int:
    """Free cached staging buffers: the reference keeps none, so this frees nothing and returns 0 (REF-10)."""
    return 0


def _copy(
    value: Any, path: tuple[Any, ...], copies: dict[int, torch.Tensor], memo: dict[int, Any]
) -> Any:
    """The staged copy of ``value``, found at ``path`` in the state dict."""
    if isinstance(value, dict):
        return {key: _copy(item, (*path, key), copies, memo) for key, item in value.items()}
    if isinstance(value, list):
        return [_copy(item, (*path, i), copies, memo) for i, item in enumerate(value)]
    if isinstance(value, tuple):
        items = [_copy(item, (*path, i), copies, memo) for i, item in enumerate(value)]
        if hasattr(value, "_fields"):  # a namedtuple
            return type(value)(*items)
        return tuple(items)
    if isinstance(value, (LocalShards, ReferenceLocalShards)):  # either class, rebuilt as itself
        chunks = [
            (offsets, _copy(chunk, (*path, ("chunk", i)), copies, memo))
            for i, (offsets, chunk) in enumerate(value.chunks)
        ]
        return type(value)(value.shape, chunks, dtype=value.dtype)
    if isinstance(value, DTensor) and _is_plain_tensor(value._local_tensor):
        local = _copy(value._local_tensor, (*path, "local"), copies, memo)
        return DTensor(local, value._spec, requires_grad=False)  # type: ignore[no-untyped-call]
    if _is_plain_tensor(value):
        if id(value) not in copies:
            copies[id(value)] = _copy_tensor(value, path)
        return copies[id(value)]
    try:
        return copy.deepcopy(value, memo)
    except Exception as exc:
        raise _cannot_stage(path, value, exc) from exc


def _is_plain_tensor(value: object) -> bool:
    """A tensor or a Parameter, not a subclass that holds its data elsewhere."""
    return type(value) in (torch.Tensor, torch.nn.Parameter)


def _copy_tensor(tensor: torch.Tensor, path: tuple[Any, ...]) -> torch.Tensor:
    """A new contiguous CPU tensor with ``tensor``'s shape, dtype and elements (STAGE-7)."""
    try:
        out = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu")
        out.copy_(tensor.detach())
    except Exception as exc:
        raise _cannot_stage(path, tensor, exc) from exc
    return out


def _cannot_stage(path: tuple[Any, ...], value: Any, exc: Exception) -> UnloadableValueError:
    """A copy that failed, naming the value's key path, type and cause (ASYNC-17)."""
    from .save_planner import unloadable  # what a save would say of the value (SAVE-12)

    key = ".".join(map(str, path)) or "<root>"
    why = f"cannot be staged ({type(exc).__name__}: {exc})"
    cause = unloadable({key: value})
    if cause:
        why += "; " + cause[0].split(": ", 1)[1]
    return UnloadableValueError([f"key {key!r}, type {type(value).__name__}: {why}"])


def _check_leaves(value: Any, path: tuple[Any, ...]) -> None:
    """Raise TypeError naming the first leaf ``type_check=True`` refuses (STAGE-10)."""
    if isinstance(value, dict):
        for key, item in value.items():
            _check_leaves(item, (*path, key))
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _check_leaves(item, (*path, i))
    elif isinstance(value, (LocalShards, ReferenceLocalShards)):
        for i, (_, chunk) in enumerate(value.chunks):
            _check_leaves(chunk, (*path, ("chunk", i)))
    elif isinstance(value, DTensor) and _is_plain_tensor(value._local_tensor):
        return
    elif not _is_plain_tensor(value) and not isinstance(value, PLAIN_LEAVES):
        raise TypeError(
            f"staging: value at {'.'.join(map(str, path)) or '<root>'} has type "
            f"{type(value).__name__}, which type_check=True does not allow (STAGE-10)"
        )
