"""Walking a state dict for staging: tensor layout and snapshot building (STAGE-6..STAGE-9).

A state dict is a tree of ``dict`` / ``list`` / ``tuple`` containers; its
leaves are tensors or other objects. Tensors are copied into contiguous CPU
buffers of their own shape and dtype, so a view stages only its own elements
(STAGE-7). The same tensor object reached twice stages once and both places
share the copy (STAGE-8). A ``LocalShards`` stages each of its chunk tensors
like a container and is rebuilt around the copies (STAGE-17); a DTensor stages
its local shard and is rebuilt with the same spec (STAGE-19). Other leaves are
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
    """refdcp's LocalShards or the reference's (REF-16): both stage chunk by chunk."""
    from refdcp.planning.local_shards import LocalShards
    from refdcp.reference.local_shards import LocalShards as ReferenceLocalShards

    return isinstance(obj, (LocalShards, ReferenceLocalShards))


def _dtensor(obj: object) -> bool:
    """A DTensor whose local shard is a plain tensor: staged through its local tensor (STAGE-19)."""
    from torch.distributed.tensor import DTensor

    return isinstance(obj, DTensor) and _plain_tensor(obj._local_tensor)


def _plain_tensor(obj: object) -> bool:
    return isinstance(obj, torch.Tensor) and type(obj) in (torch.Tensor, torch.nn.Parameter)


def layout_of(state_dict: Any, *, type_check: bool = False) -> Layout:
    """The tensor slots of ``state_dict`` in traversal order (STAGE-6).

    With ``type_check=True`` a leaf that is neither a plain tensor nor one of
    :data:`PLAIN_LEAF_TYPES` raises TypeError naming its path (STAGE-10).
    """
    walker = _LayoutWalk(type_check)
    walker.walk(state_dict, ())
    return tuple(walker.slots)


class _LayoutWalk:
    """Recursion through bound methods, not a self-referencing closure: no reference cycle."""

    def __init__(self, type_check: bool) -> None:
        self.type_check = type_check
        self.slots: list[Slot] = []
        self.seen: dict[int, int] = {}

    def walk(self, obj: Any, path: tuple[Any, ...]) -> None:
        if _is_container(obj):
            for key, value in _children(obj):
                self.walk(value, (*path, key))
        elif _local_shards(obj):
            for i, (_, chunk) in enumerate(obj.chunks):
                self.walk(chunk, (*path, ("chunk", i)))
        elif _dtensor(obj):
            self.walk(obj._local_tensor, (*path, "local"))
        elif _plain_tensor(obj):
            t: torch.Tensor = obj
            first = self.seen.get(id(t))
            if first is None:
                self.seen[id(t)] = len(self.slots)
            self.slots.append(Slot(path, tuple(t.shape), t.dtype, first))
        elif self.type_check and not isinstance(obj, PLAIN_LEAF_TYPES):
            raise TypeError(
                f"staging: value at {'.'.join(map(str, path)) or '<root>'} has type "
                f"{type(obj).__name__}, which type_check=True does not allow (STAGE-10)"
            )


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
    walker = _SnapshotWalk(layout, buffers, copy_into)
    walker.root = state_dict
    out = walker.walk(state_dict)
    if walker.idx != len(layout):
        raise ValueError("staging: the state dict changed shape while it was being staged")
    return out


class _SnapshotWalk:
    """Builds the snapshot; bound-method recursion leaves no cycle holding the buffers (ASYNC-16)."""

    def __init__(
        self,
        layout: Layout,
        buffers: list[torch.Tensor | None],
        copy_into: Callable[[torch.Tensor, torch.Tensor], None],
    ) -> None:
        self.layout, self.buffers, self.copy_into = layout, buffers, copy_into
        self.idx = 0
        self.memo: dict[int, Any] = {}
        self.root: Any = None

    def walk(self, obj: Any) -> Any:
        if _is_container(obj):
            return _rebuild(obj, [self.walk(v) for _, v in _children(obj)])
        if _local_shards(obj):
            chunks = [(off, self.walk(t)) for off, t in obj.chunks]
            return type(obj)(obj.shape, chunks, dtype=obj.dtype)
        if _dtensor(obj):
            from torch.distributed.tensor import DTensor

            # same spec (mesh, placements, global shape), the staged copy as local shard
            staged = self.walk(obj._local_tensor)
            return DTensor(staged, obj._spec, requires_grad=False)  # type: ignore[no-untyped-call]
        if _plain_tensor(obj):
            slot = self.layout[self.idx]
            if slot.alias_of is not None:
                dst = self.buffers[slot.alias_of]
            else:
                dst = self.buffers[self.idx]
                assert dst is not None
                try:
                    self.copy_into(dst, obj)
                except Exception as exc:
                    raise _named(slot.path, obj, exc) from exc
            self.idx += 1
            return dst
        try:
            return copy.deepcopy(obj, self.memo)
        except Exception as exc:
            raise _named(self._path_of(obj), obj, exc) from exc

    def _path_of(self, obj: Any) -> tuple[Any, ...]:
        """Where ``obj`` sits in the state dict (searched only on a failure)."""
        found = _find(self.root, obj, ())
        return found if found is not None else ("<unknown>",)


def _find(tree: Any, obj: Any, path: tuple[Any, ...]) -> tuple[Any, ...] | None:
    if tree is obj:
        return path
    if _is_container(tree):
        for key, value in _children(tree):
            hit = _find(value, obj, (*path, key))
            if hit is not None:
                return hit
    return None


def _named(path: tuple[Any, ...], obj: Any, exc: Exception) -> Exception:
    """A staging failure that names the value's key path and type (ASYNC-17)."""
    from refdcp.planning.loadable import staging_refusal

    return staging_refusal(".".join(map(str, path)) or "<root>", obj, exc)
