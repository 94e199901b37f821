"""The global metadata and its checks (META-1..7).

:func:`build_metadata` records, for the final (deduplicated) plans, each
tensor's dtype, global shape and chunks, and each object FQN; the checks
(:func:`reference_metadata_problems`) compare every chunk with every other of
its tensor, with no screen. ``refdcp.planning``'s global metadata is the same
rule vectorised and is tested to find the same problems for the same FQNs (META-6).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    STORAGE_TYPES,
    BytesStorageMetadata,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import WriteItem

__all__ = ["build_metadata", "chunk_problems", "reference_metadata_problems"]

WithoutChunks = Mapping[str, tuple[TensorProperties, torch.Size]]


def build_metadata(
    plans: Sequence[Sequence[WriteItem]], without_chunks: WithoutChunks | None = None
) -> tuple[dict[str, STORAGE_TYPES], list[str]]:
    """``state_dict_metadata`` of the final plans, and every problem, worded (META-1..5)."""
    md: dict[str, STORAGE_TYPES] = {}
    for items in plans:
        for item in items:
            td = item.tensor_data
            fqn = item.index.fqn
            if td is None:
                md[fqn] = BytesStorageMetadata()
            elif not isinstance(md.get(fqn), TensorStorageMetadata):
                md[fqn] = TensorStorageMetadata(td.properties, td.size, [td.chunk])
            else:
                md[fqn].chunks.append(td.chunk)  # type: ignore[union-attr]
    for fqn, (props, size) in (
        without_chunks or {}
    ).items():  # no rank wrote a chunk of it (PLAN-1)
        md.setdefault(fqn, TensorStorageMetadata(props, size, []))
    words = {
        "bytes": "saved as bytes by several ranks, or as bytes and as a tensor",
        "disagree": "ranks disagree on dtype or global shape",
        "outside": "a chunk lies outside the global shape",
        "overlap": "chunks overlap",
        "cover": "the chunks do not cover the whole tensor",
    }
    problems = reference_metadata_problems(plans, without_chunks)
    return md, [f"{fqn!r}: {words[kind]} (ranks {_ranks(plans, fqn)})" for fqn, kind in problems]


def _ranks(plans: Sequence[Sequence[WriteItem]], fqn: str) -> list[int]:
    return [r for r, items in enumerate(plans) if any(i.index.fqn == fqn for i in items)]


def reference_metadata_problems(
    plans: Sequence[Sequence[WriteItem]], without_chunks: WithoutChunks | None = None
) -> list[tuple[str, str]]:
    """``(fqn, kind)`` of every problem; kind is ``bytes``, ``disagree``, ``outside``,
    ``overlap`` or ``cover`` (META-2..4, META-7)."""
    tensors: dict[str, list[Any]] = {}
    objects: dict[str, list[int]] = {}
    for rank, items in enumerate(plans):
        for item in items:
            if item.tensor_data is None:
                objects.setdefault(item.index.fqn, []).append(rank)
            else:
                tensors.setdefault(item.index.fqn, []).append(item.tensor_data)
    problems = []
    for fqn, ranks in objects.items():  # META-4: one kind per FQN, one writer of an object
        if fqn in tensors or len(ranks) > 1:
            problems.append((fqn, "bytes"))
    for fqn, tds in tensors.items():
        if fqn in objects:
            continue
        if len({(td.properties.dtype, tuple(td.size)) for td in tds}) > 1:  # META-4
            problems.append((fqn, "disagree"))
            continue
        chunks = [(tuple(td.chunk.offsets), tuple(td.chunk.sizes)) for td in tds]
        problems += [(fqn, kind) for kind in chunk_problems(tuple(tds[0].size), chunks)]
    for fqn, (_, size) in (without_chunks or {}).items():  # a tensor no rank wrote a chunk of
        if fqn not in tensors and fqn not in objects:
            problems += [(fqn, kind) for kind in chunk_problems(tuple(size), [])]
    return problems


def chunk_problems(size: tuple[int, ...], chunks: list[tuple[Any, Any]]) -> list[str]:
    """META-2 (inside the shape), META-3 (no overlap, full cover; at any world size)."""
    if not size:  # a 0-d tensor: exactly one chunk
        return [] if len(chunks) == 1 else ["cover"]
    inside = [(off, sz) for off, sz in chunks if _inside(off, sz, size)]
    out = ["outside"] * (len(chunks) - len(inside))
    boxes = [(off, sz) for off, sz in inside if math.prod(sz) > 0]
    for i, a in enumerate(boxes):
        out += ["overlap" for b in boxes[i + 1 :] if _overlap(a, b)]
    if not out and sum(math.prod(sz) for _, sz in inside) != math.prod(size):
        out.append("cover")
    return out


def _inside(off: tuple[int, ...], sz: tuple[int, ...], size: tuple[int, ...]) -> bool:
    if not len(off) == len(sz) == len(size):
        return False
    return all(o >= 0 and s >= 0 and o + s <= g for o, s, g in zip(off, sz, size))


def _overlap(a: tuple[Any, Any], b: tuple[Any, Any]) -> bool:
    """Two boxes share an element when they overlap along every dimension."""
    return all(x < y + m and y < x + n for x, n, y, m in zip(a[0], a[1], b[0], b[1]))
