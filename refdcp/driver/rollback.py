"""All-or-nothing loads: what a load may change, copied first and put back after a failure (LOAD-21).

``refdcp.load(..., atomic=True)`` takes a :class:`Snapshot` once the
``Stateful`` destinations are known (LOAD-1) and before anything is read: a
host copy of every tensor reachable from the state dict (plain tensors,
``DTensor`` local tensors, ``ShardedTensor`` local shards) and the contents
of every dict and list on the way. When the load fails on any rank, every
rank restores its own: tensors get their saved bytes back through ``copy_``
(same dtype, so bit for bit), containers their saved contents, and each
``Stateful`` whose ``load_state_dict`` had already run gets it again with its
restored state dict. The cost is one host copy of the state dict's tensors
for the duration of the load.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

__all__ = ["Snapshot"]


def _storage_tensors(value: Any) -> list[torch.Tensor]:
    """The tensors whose memory a load writes for ``value`` (empty for non-tensors)."""
    if isinstance(value, torch.Tensor):
        if isinstance(getattr(type(value), "chunks", None), property):
            # a LocalShards (refdcp's or the reference's): a container of its chunk tensors
            chunks: list[tuple[Any, torch.Tensor]] = value.chunks  # type: ignore[attr-defined]
            return [t for _, t in chunks]
        local = getattr(value, "_local_tensor", None)  # DTensor: its shard on this rank
        return [local if isinstance(local, torch.Tensor) else value]
    shards = getattr(value, "local_shards", None)
    if callable(shards) and type(value).__name__ == "ShardedTensor":
        return [s.tensor for s in shards()]
    return []


class Snapshot:
    """The state a load may change, kept so that a failed load can leave it as it was."""

    def __init__(self, top: dict[Any, Any], flat: dict[Any, Any]) -> None:
        self.tensors: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._dicts: list[tuple[dict[Any, Any], list[tuple[Any, Any]]]] = []
        self._lists: list[tuple[list[Any], list[Any]]] = []
        self._flat = flat
        self._seen: set[int] = set()
        with torch.no_grad():
            self._walk(top)
            self._walk(flat)
        del self._seen

    @property
    def nbytes(self) -> int:
        """Host memory the snapshot holds (the copies of every tensor)."""
        return sum(copy.nbytes for _, copy in self.tensors)

    def _walk(self, value: Any) -> None:
        if id(value) in self._seen:
            return
        self._seen.add(id(value))
        tensors = _storage_tensors(value)
        if tensors:
            for t in tensors:
                if t is value or id(t) not in self._seen:
                    self._seen.add(id(t))
                    self.tensors.append((t, t.detach().to("cpu", copy=True)))
            return
        if isinstance(value, dict):
            items = list(value.items())
            self._dicts.append((value, items))
            self._walk_all(v for _, v in items)
        elif isinstance(value, list):
            saved = list(value)
            self._lists.append((value, saved))
            self._walk_all(saved)
        elif isinstance(value, tuple):
            self._walk_all(value)

    def _walk_all(self, values: Iterable[Any]) -> None:
        for v in values:
            self._walk(v)

    def restore(self, top: dict[Any, Any], applied: Iterable[Any]) -> list[str]:
        """Put everything back; then hand each ``Stateful`` of ``applied`` (top-level keys
        whose ``load_state_dict`` ran) its restored state dict again. Returns a line for
        each ``Stateful`` that refused it (its state is then unknown)."""
        with torch.no_grad():
            for dest, copy in self.tensors:
                dest.detach().copy_(copy)
        for d, items in self._dicts:
            d.clear()
            d.update(items)
        for lst, saved in self._lists:
            lst[:] = saved
        refused = []
        for key in applied:
            try:
                top[key].load_state_dict(self._flat[key])
            except Exception as exc:  # reported on the load's own error, never replacing it
                refused.append(f"atomic load: restoring {key!r} failed: {exc!r}")
        return refused
