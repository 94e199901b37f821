"""Nested state dicts to FQN keys and back, written to be read (FLAT-1..6, REF-14).

A state dict is walked depth first. Mappings are always entered; a list is entered
when it holds a tensor or a container that is entered (torch's rule); a tuple only
when it holds a tensor somewhere inside (FLAT-4). Everything else is a leaf whose
FQN is its path joined with dots. Beside torch's path of each leaf, the walk keeps
a *rich* path whose steps say what each container was (``"d"`` mapping, ``"l"``
list, ``"t"`` tuple) and keep non-string keys as they were (FLAT-2, FLAT-3); the
rich paths that torch's path cannot express, and the empty mappings, go into
``planner_data`` under :data:`RESERVED_KEY` (FLAT-6).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed._shard.sharded_tensor.api import ShardedTensor

__all__ = ["RESERVED_KEY", "Flat", "flatten", "is_tensor_like", "set_by_rich_path", "structure"]

#: The ``planner_data`` key of refdcp's structure record; no state dict may use it (FLAT-6).
RESERVED_KEY = "__refdcp_planner__"


@dataclass
class Flat:
    """A flattened state dict (FLAT-1): per FQN its value, torch's path and the rich path;
    and the rich paths of the empty mappings (FLAT-2)."""

    items: dict[str, Any] = field(default_factory=dict)
    paths: dict[str, tuple[Any, ...]] = field(default_factory=dict)
    rich: dict[str, tuple[Any, ...]] = field(default_factory=dict)
    empties: list[tuple[Any, ...]] = field(default_factory=list)


def is_tensor_like(value: object) -> bool:
    """True for a value saved as tensor chunks rather than pickled bytes (PLAN-3, PLAN-6)."""
    return (
        isinstance(value, (torch.Tensor, ShardedTensor))
        or hasattr(value, "__create_write_items__")
        or hasattr(value, "__create_chunk_list__")
    )


def _holds_tensor(value: object) -> bool:
    """A tensor is ``value`` or somewhere inside it (FLAT-4)."""
    if is_tensor_like(value):
        return True
    if isinstance(value, Mapping):
        return any(_holds_tensor(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_holds_tensor(v) for v in value)
    return False


def _enter_list(value: list[Any]) -> bool:
    """torch's rule: enter a list holding a tensor, a mapping, or a container we enter."""
    for entry in value:
        if is_tensor_like(entry) or isinstance(entry, Mapping):
            return True
        if isinstance(entry, list) and _enter_list(entry):
            return True
        if isinstance(entry, tuple) and _holds_tensor(entry):
            return True
    return False


def _kept_key(key: object) -> object:
    """A key as the rich path keeps it: plain data as it is, anything else as text (FLAT-3)."""
    if isinstance(key, (str, int, float, bool, bytes, type(None))):
        return key
    return str(key)


def flatten(state_dict: Mapping[Any, Any]) -> Flat:
    """Flatten ``state_dict`` (FLAT-1..5); two leaves with one FQN, or a leaf named
    :data:`RESERVED_KEY`, raise ``ValueError`` (FLAT-5, FLAT-6)."""
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"a state_dict must be a mapping, got {type(state_dict).__name__}")
    flat = Flat()
    for key, value in state_dict.items():
        _visit(flat, (str(key),), (("d", _kept_key(key)),), value)
    return flat


def _visit(flat: Flat, path: tuple[Any, ...], rich: tuple[Any, ...], value: object) -> None:
    if isinstance(value, Mapping):
        if len(value) == 0:
            flat.empties.append(rich)
        for k, v in value.items():
            _visit(flat, (*path, str(k)), (*rich, ("d", _kept_key(k))), v)
        return
    if isinstance(value, list) and _enter_list(value):
        for i, v in enumerate(value):
            _visit(flat, (*path, i), (*rich, ("l", i)), v)
        return
    if isinstance(value, tuple) and _holds_tensor(value):
        for i, v in enumerate(value):
            _visit(flat, (*path, i), (*rich, ("t", i)), v)
        return
    fqn = ".".join(str(step) for step in path)
    if fqn in flat.items:
        earlier = "".join(f"[{key!r}]" for _, key in flat.rich[fqn])
        this = "".join(f"[{key!r}]" for _, key in rich)
        raise ValueError(f"state_dict paths {earlier} and {this} both flatten to the FQN {fqn!r}")
    if fqn == RESERVED_KEY:
        raise ValueError(f"the FQN {fqn!r} is reserved by refdcp's planner")
    flat.items[fqn] = value
    flat.paths[fqn] = path
    flat.rich[fqn] = rich


def _plain_rich(path: tuple[Any, ...]) -> tuple[Any, ...]:
    """The rich path torch's path means when read plainly: text keys, list indices."""
    return tuple(("d", step) if isinstance(step, str) else ("l", step) for step in path)


def structure(flat: Flat) -> dict[str, Any]:
    """The structure record for ``planner_data[RESERVED_KEY]`` (FLAT-6): the rich paths
    that differ from their plain reading, and the empty mappings."""
    rich = {}
    for fqn, path in flat.rich.items():
        if path != _plain_rich(flat.paths[fqn]):
            rich[fqn] = path
    return {"version": 1, "rich": rich, "empties": list(flat.empties)}


def set_by_rich_path(root: dict[Any, Any], path: tuple[Any, ...], value: Any) -> None:
    """Store ``value`` at ``path`` inside ``root``, creating missing containers and
    rebuilding the tuples on the way, which cannot change in place (FLAT-1, FLAT-4)."""
    _put(root, path, value)


def _put(container: Any, path: tuple[Any, ...], value: Any) -> Any:
    """``container`` with ``value`` stored at ``path`` (a new tuple, or the same container)."""
    kind, key = path[0]
    if len(path) == 1:
        new = value
    else:
        if kind == "d":
            child = container.get(key) if isinstance(container, Mapping) else None
        else:
            child = container[key] if key < len(container) else None
        if child is None:
            child = {"d": {}, "l": [], "t": ()}[path[1][0]]
        new = _put(child, path[1:], value)
    if kind == "t" or isinstance(container, tuple):
        entries = list(container) + [None] * (key + 1 - len(container))
        entries[key] = new
        return tuple(entries)
    if kind == "l":
        container.extend([None] * (key + 1 - len(container)))
    container[key] = new
    return container
