"""Walking a state dict for staging: tensor layout and snapshot building (STAGE-6..STAGE-9).

A state dict is a tree of ``dict`` / ``list`` / ``tuple`` containers; its
leaves are tensors or other objects. Tensors are copied into contiguous CPU
buffers of their own shape and dtype, so a view stages only its own elements
(STAGE-7). The same tensor object reached twice stages once and both places
share the copy (STAGE-8). A ``LocalShards`` stages each of its chunk tensors
like a container and is rebuilt around the copies (STAGE-17). Other leaves are
deep-copied (STAGE-9).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Slot", "Layout", "layout_of", "build_snapshot", "PLAIN_LEAF_TYPES", "nbytes_of"]

#: Leaf types accepted when ``type_check=True`` (STAGE-10).
PLAIN_LEAF_TYPES: tuple[type, ...] = (int, float, complex, bool, str, bytes, type(None))


@dataclass(frozen=True)
class Slot:
    """One staged tensor: where it is, its shape and dtype; ``alias_of`` for repeats."""

    path: tuple[Any, ...]
    shape: tuple[int, ...]
    dtype: torch.dtype
    alias_of: int | None = None

    @property
    def nbytes(self) -> int:
        if self.alias_of is not None:
            return 0
        n = 1
        for d in self.shape:
            n *= d
        return n * self.dtype.itemsize


#: The tensors of a state dict in traversal order; the key of a cached buffer set.
Layout = tuple[Slot, ...]


def nbytes_of(layout: Layout) -> int:
    """Bytes a buffer set for ``layout`` needs."""
    return sum(s.nbytes for s in layout)


def _is_container(obj: object) -> bool:
    return isinstance(obj, (dict, list, tuple))


def _children(obj: Any) -> Iterator[tuple[Any, Any]]:
    if isinstance(obj, dict):
        yield from obj.items()
    else:
        yield from enumerate(obj)


def _local_shards(obj: object) -> bool:
    from refdcp.planning.local_shards import LocalShards

    return isinstance(obj, LocalShards)


def _plain_tensor(obj: object) -> bool:
    return isinstance(obj, torch.Tensor) and type(obj) in (torch.Tensor, torch.nn.Parameter)


def layout_of(state_dict: Any, *, type_check: bool = False) -> Layout:
    """The tensor slots of ``state_dict`` in traversal order (STAGE-6).

    With ``type_check=True`` a leaf that is neither a plain tensor nor one of
    :data:`PLAIN_LEAF_TYPES` raises TypeError naming its path (STAGE-10).
    """
    slots: list[Slot] = []
    seen: dict[int, int] = {}

    def walk(obj: Any, path: tuple[Any, ...]) -> None:
        if _is_container(obj):
            for key, value in _children(obj):
                walk(value, (*path, key))
        elif _local_shards(obj):
            for i, (_, chunk) in enumerate(obj.chunks):
                walk(chunk, (*path, ("chunk", i)))
        elif _plain_tensor(obj):
            t: torch.Tensor = obj
            first = seen.get(id(t))
            if first is None:
                seen[id(t)] = len(slots)
            slots.append(Slot(path, tuple(t.shape), t.dtype, first))
        elif type_check and not isinstance(obj, PLAIN_LEAF_TYPES):
            raise TypeError(
                f"staging: value at {'.'.join(map(str, path)) or '<root>'} has type "
                f"{type(obj).__name__}, which type_check=True does not allow (STAGE-10)"
            )

    walk(state_dict, ())
    return tuple(slots)


def _rebuild(obj: Any, values: list[Any]) -> Any:
    if isinstance(obj, dict):
        out: dict[Any, Any] = {}
        for key, value in zip(obj.keys(), values):
            out[key] = value
        return out
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*values)  # namedtuple
    if isinstance(obj, tuple):
        return tuple(values)
    return values


def build_snapshot(
    state_dict: Any,
    layout: Layout,
    buffers: list[torch.Tensor | None],
    copy_into: Callable[[torch.Tensor, torch.Tensor], None],
) -> Any:
    """A tree shaped like ``state_dict`` whose tensors are ``buffers`` filled from it.

    ``buffers[i]`` receives the i-th tensor (``None`` for an alias slot, which
    reuses its first occurrence's buffer). ``copy_into(dst, src)`` does the copy.
    Non-tensor leaves are deep-copied (STAGE-9).
    """
    idx = 0
    memo: dict[int, Any] = {}

    def walk(obj: Any) -> Any:
        nonlocal idx
        if _is_container(obj):
            return _rebuild(obj, [walk(v) for _, v in _children(obj)])
        if _local_shards(obj):
            from refdcp.planning.local_shards import LocalShards

            chunks = [(off, walk(t)) for off, t in obj.chunks]
            return LocalShards(obj.shape, chunks, dtype=obj.dtype)
        if _plain_tensor(obj):
            slot = layout[idx]
            if slot.alias_of is not None:
                dst = buffers[slot.alias_of]
            else:
                dst = buffers[idx]
                assert dst is not None
                copy_into(dst, obj)
            idx += 1
            return dst
        return copy.deepcopy(obj, memo)

    out = walk(state_dict)
    if idx != len(layout):
        raise ValueError("staging: the state dict changed shape while it was being staged")
    return out
