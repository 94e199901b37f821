"""The global-plan checks, written to be read: no screen, every FQN checked (META-6).

:func:`reference_metadata_problems` states META-2..4 directly: bytes and
tensors under one FQN, dtype or global-shape disagreement, chunks out of
bounds, overlapping chunks (every pair compared) and incomplete cover. The
planner's :func:`~refdcp.planning.metadata.build.build_state_dict_metadata`
screens all tensors at once with numpy and words the problems only for the
suspects; a property test checks that both find the same problems, of the
same kind, for the same FQNs (META-6).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import TensorProperties
from torch.distributed.checkpoint.planner import WriteItem

__all__ = ["reference_metadata_problems"]


def reference_metadata_problems(
    plans: Sequence[Sequence[WriteItem]],
    chunkless: Mapping[str, tuple[TensorProperties, torch.Size]] | None = None,
) -> list[tuple[str, str]]:
    """``(fqn, kind)`` of every problem; kind is ``bytes``, ``disagree``, ``outside``,
    ``overlap`` or ``cover``."""
    tensors: dict[str, list[tuple[int, Any]]] = {}
    objects: dict[str, list[int]] = {}
    for rank, items in enumerate(plans):
        for item in items:
            if item.tensor_data is None:
                objects.setdefault(item.index.fqn, []).append(rank)
            else:
                tensors.setdefault(item.index.fqn, []).append((rank, item.tensor_data))
    problems: list[tuple[str, str]] = []
    for fqn, ranks in objects.items():
        if fqn in tensors or len(ranks) > 1:
            problems.append((fqn, "bytes"))
    for fqn, entries in tensors.items():
        if fqn in objects:
            continue
        if len({(td.properties.dtype, tuple(td.size)) for _, td in entries}) > 1:
            problems.append((fqn, "disagree"))
            continue
        size = tuple(entries[0][1].size)
        problems += [(fqn, kind) for kind in _chunk_problems(size, [td for _, td in entries])]
    for fqn, (_, size) in (chunkless or {}).items():  # a tensor no rank wrote a chunk of
        if fqn not in tensors and fqn not in objects:
            problems += [(fqn, kind) for kind in _chunk_problems(tuple(size), [])]
    return problems


def _chunk_problems(size: tuple[int, ...], tds: list[Any]) -> list[str]:
    chunks = [(tuple(td.chunk.offsets), tuple(td.chunk.sizes)) for td in tds]
    if not size:  # a 0-d tensor: exactly one chunk
        return [] if len(chunks) == 1 else ["cover"]
    inside = [
        (off, sz)
        for off, sz in chunks
        if len(off) == len(sz) == len(size)
        and all(o >= 0 and s >= 0 and o + s <= g for o, s, g in zip(off, sz, size))
    ]
    out = ["outside"] * (len(chunks) - len(inside))
    boxes = [(off, sz) for off, sz in inside if math.prod(sz) > 0]
    out += [
        "overlap"
        for i, a in enumerate(boxes)
        for b in boxes[i + 1 :]
        if all(x < y + m and y < x + n for x, n, y, m in zip(a[0], a[1], b[0], b[1]))
    ]
    if not out and sum(math.prod(sz) for _, sz in inside) != math.prod(size):
        out.append("cover")
    return out
