"""Flatten nested state dicts to FQN keys and back (spec/planning.md, FLAT-*).

The FQN scheme is torch's: dict keys are joined with ``str(key)``, list
indices with their number. refdcp also records what torch loses (FLAT-2..4):
empty containers, the original type of non-string keys, and tuples that hold
tensors. That extra record travels in ``planner_data`` under
:data:`RESERVED_KEY`, which torch's readers never look up (FLAT-6).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from itertools import filterfalse, pairwise
from typing import Any

import torch
from torch.distributed._shard.sharded_tensor.api import ShardedTensor

__all__ = [
    "RESERVED_KEY",
    "Flattened",
    "RichPath",
    "TorchPath",
    "decode_structure",
    "encode_structure",
    "flatten_state_dict",
    "is_tensor_like",
    "set_by_rich_path",
    "unflatten_state_dict",
]

#: Key of refdcp's own entry in ``planner_data`` (never a valid user FQN; FLAT-6).
RESERVED_KEY = "__refdcp_planner__"

TorchPath = tuple[str | int, ...]
#: One step: ("d", key) into a mapping, ("l", i) into a list, ("t", i) into a tuple.
RichStep = tuple[str, Any]
RichPath = tuple[RichStep, ...]

_KEPT_KEY_TYPES = (str, int, float, bool, bytes, type(None))


def is_tensor_like(value: object) -> bool:
    """True for values saved as tensor chunks rather than pickled bytes."""
    return (
        isinstance(value, (torch.Tensor, ShardedTensor))
        or hasattr(value, "__create_write_items__")
        or hasattr(value, "__create_chunk_list__")
    )


@dataclass
class Flattened:
    """A flattened state dict: FQN -> value, torch path, refdcp path; empty containers."""

    items: dict[str, Any] = field(default_factory=dict)
    paths: dict[str, TorchPath] = field(default_factory=dict)
    rich: dict[str, RichPath] = field(default_factory=dict)
    empties: list[RichPath] = field(default_factory=list)
    #: FQNs whose rich path is known to be the plain reading of their torch path
    plain: set[str] = field(default_factory=set)


def _list_descends(value: list[Any]) -> bool:
    """torch's rule: a list is descended if it holds a tensor or a non-terminal container."""
    for entry in value:
        if is_tensor_like(entry) or isinstance(entry, Mapping):
            return True
        if isinstance(entry, list) and _list_descends(entry):
            return True
        if isinstance(entry, tuple) and _tuple_descends(entry):
            return True
    return False


def _tuple_descends(value: tuple[Any, ...]) -> bool:
    """refdcp's rule (FLAT-4): a tuple is descended only if it (recursively) holds a tensor."""
    for entry in value:
        if is_tensor_like(entry):
            return True
        if isinstance(entry, Mapping) and any(_holds_tensor(v) for v in entry.values()):
            return True
        if isinstance(entry, (list, tuple)) and any(_holds_tensor(v) for v in entry):
            return True
    return False


def _holds_tensor(value: object) -> bool:
    if is_tensor_like(value):
        return True
    if isinstance(value, Mapping):
        return any(_holds_tensor(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_holds_tensor(v) for v in value)
    return False


def _kept_key(key: object) -> object:
    return key if isinstance(key, _KEPT_KEY_TYPES) else str(key)


def flatten_state_dict(state_dict: Mapping[Any, Any]) -> Flattened:
    """Flatten ``state_dict`` (FLAT-1..5); two paths with one FQN raise ValueError naming both."""
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"a state_dict must be a mapping, got {type(state_dict).__name__}")
    out = Flattened()
    items, paths, rich, plain = out.items, out.paths, out.rich, out.plain
    for key, value in state_dict.items():
        if type(key) is str and type(value) in _PLAIN_LEAVES and key not in items:
            # the common top-level tensor: what _visit would record, without its checks
            if key == RESERVED_KEY:
                raise ValueError(f"the FQN {key!r} is reserved by refdcp's planner")
            items[key] = value
            paths[key] = (key,)
            rich[key] = (("d", key),)
            plain.add(key)
            continue
        _visit(out, (str(key),), (("d", _kept_key(key)),), value)
    return out


_PLAIN_LEAVES = (torch.Tensor, torch.nn.Parameter)


def _visit(out: Flattened, tpath: TorchPath, rpath: RichPath, value: object) -> None:
    """One step of :func:`flatten_state_dict` (a module function: no closure cycle)."""
    if isinstance(value, Mapping):
        if not value:
            out.empties.append(rpath)
            return
        for k, v in value.items():
            _visit(out, (*tpath, str(k)), (*rpath, ("d", _kept_key(k))), v)
        return
    if isinstance(value, list) and _list_descends(value):
        for i, v in enumerate(value):
            _visit(out, (*tpath, i), (*rpath, ("l", i)), v)
        return
    if isinstance(value, tuple) and _tuple_descends(value):
        for i, v in enumerate(value):
            _visit(out, (*tpath, i), (*rpath, ("t", i)), v)
        return
    fqn = ".".join(map(str, tpath))
    if fqn in out.items:
        raise ValueError(
            f"state_dict paths {_show(out.rich[fqn])} and {_show(rpath)} both flatten "
            f"to the FQN {fqn!r}"
        )
    if fqn == RESERVED_KEY:
        raise ValueError(f"the FQN {fqn!r} is reserved by refdcp's planner")
    out.items[fqn] = value
    out.paths[fqn] = tpath
    out.rich[fqn] = rpath


def _show(rpath: RichPath) -> str:
    return "".join(f"[{k!r}]" for _, k in rpath)


def _plain_rich(tpath: TorchPath) -> RichPath:
    return tuple(("d", k) if isinstance(k, str) else ("l", k) for k in tpath)


def encode_structure(flat: Flattened) -> dict[str, Any]:
    """The part of the structure torch's path tuples cannot express (FLAT-6).

    Only paths that differ from the plain reading of the torch path are kept,
    so a state dict of string keys and lists costs nothing.
    """
    known = flat.plain
    rich: dict[str, RichPath] = {}
    for fqn in filterfalse(known.__contains__, flat.rich) if known else flat.rich:
        rp = flat.rich[fqn]
        if rp != _plain_rich(flat.paths[fqn]):
            rich[fqn] = rp
    # persisted in .metadata (planner_data[RESERVED_KEY]): "rich" maps an FQN to its typed path
    # where that is not the plain one, "empties" lists empty containers; the key names stay
    # as written so that every checkpoint already saved keeps loading
    return {"version": 1, "rich": rich, "empties": list(flat.empties)}


def decode_structure(
    paths: Mapping[str, TorchPath], structure: Mapping[str, Any] | None
) -> tuple[dict[str, RichPath], list[RichPath]]:
    """Rich paths for every FQN in ``paths`` plus the empty containers."""
    extra: Mapping[str, RichPath] = structure.get("rich", {}) if structure else {}
    empties: list[RichPath] = list(structure.get("empties", [])) if structure else []
    rich = {fqn: extra.get(fqn) or _plain_rich(tuple(p)) for fqn, p in paths.items()}
    return rich, empties


class _Node:
    """A container under construction: kind 'd', 'l' or 't' with its children."""

    __slots__ = ("children", "kind")

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.children: dict[Any, Any] = {}

    def build(self) -> Any:
        vals = {k: (v.build() if isinstance(v, _Node) else v) for k, v in self.children.items()}
        if self.kind == "d":
            return vals
        size = max(vals, default=-1) + 1
        seq = [vals.get(i) for i in range(size)]
        return tuple(seq) if self.kind == "t" else seq


def unflatten_state_dict(
    items: Mapping[str, Any], rich: Mapping[str, RichPath], empties: Sequence[RichPath] = ()
) -> dict[Any, Any]:
    """Rebuild the nested state dict from flattened items and rich paths (FLAT-1)."""
    root = _Node("d")

    def walk(path: RichPath) -> _Node:
        node = root
        for (_, key), (next_kind, _) in pairwise(path):
            child = node.children.get(key)
            if not isinstance(child, _Node):
                child = _Node(next_kind)
                node.children[key] = child
            node = child
        return node

    for epath in empties:
        walk(epath).children.setdefault(epath[-1][1], {})
    for fqn, value in items.items():
        path = rich[fqn]
        walk(path).children[path[-1][1]] = value
    result: dict[Any, Any] = root.build()
    return result


def set_by_rich_path(root: dict[Any, Any], path: RichPath, value: Any) -> None:
    """Store ``value`` at ``path`` inside ``root``, rebuilding tuples on the way (FLAT-4)."""
    _put(root, path, value)


def _put(container: Any, steps: RichPath, value: Any) -> Any:
    (kind, key), rest = steps[0], steps[1:]
    if rest:
        if kind == "d":
            child = container.get(key) if isinstance(container, Mapping) else None
        else:
            child = container[key] if key < len(container) else None
        if child is None:
            child = {} if rest[0][0] == "d" else ([] if rest[0][0] == "l" else ())
        new_child = _put(child, rest, value)
    else:
        new_child = value
    if kind == "t" or isinstance(container, tuple):
        seq = list(container)
        seq.extend([None] * (key + 1 - len(seq)))
        seq[key] = new_child
        return tuple(seq)
    if kind == "l":
        container.extend([None] * (key + 1 - len(container)))
    container[key] = new_child
    return container
