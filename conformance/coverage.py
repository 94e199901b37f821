"""The coverage model: the suite's dimensions and pairwise cases crossing them (CONF-61..63).

A defect often lives at a combination of dimension values (many threads *and* a
multi-MiB item, writer reuse *on rank 1*, unicode keys *in a resharded load*),
so a check that exercises one point per dimension misses it. This module lists
the dimensions (:data:`DIMENSIONS`) and generates, for one backend, a set of
cases in which every pair of values of two dimensions occurs at least once
(:func:`pairwise`), greedily and seeded, so the same backend always gets the same
cases. Values a backend's capabilities rule out are dropped before the pairs are
formed (CONF-55): a rank-local backend gets one rank, a backend without
``thread_count`` one thread, one without ``overwrite`` fresh locations only.

:func:`build` turns a case into per-rank state dicts (chunks of one FQN spread
over the ranks, keys of the case's shape), and :func:`describe_case` into the
words a failure reason uses ("ranks=2 (coordinator rank 0), thread_count=4,
item of 6.0 MiB ..."). The values are finite (CONF-10 alone saves special
values) and tensors only (CONF-13 alone saves bytes items, CONF-52).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    ReadItem,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from conformance.backend import Capabilities
from conformance.truth import finite_tensor

__all__ = [
    "DIMENSIONS",
    "SEED",
    "SIZES",
    "BoxLoadPlanner",
    "Case",
    "ChunkSavePlanner",
    "Built",
    "build",
    "cases_for",
    "describe_case",
    "domains_for",
    "flatten",
    "pairwise",
    "reshard_boxes",
    "unfold",
]

#: The seed of the pairwise generator: the cases of a backend never change between runs.
SEED = 61

#: Bytes of the case's main tensor: tiny, past a 4 KiB page, past 64 KiB, and past
#: 1, 2, 4 and 5 MiB part or buffer boundaries (CONF-46's largest size).
SIZES: dict[str, int] = {"tiny": 40, "4KiB+1": 4097, "64KiB+1": 65537, "6MiB+4": 6 * 2**20 + 4}

#: dimension -> its values, in the order the reasons name them.
DIMENSIONS: dict[str, tuple[Any, ...]] = {
    "ranks": (1, 2, 3),
    "thread_count": (1, 4),
    "size": tuple(SIZES),
    "chunks": (1, 2, 3),
    "dtype": ("float32", "bfloat16", "float8_e4m3fn", "complex64", "int16", "bool"),
    "bits": ("random", "extremes"),
    "keys": ("short", "long", "unicode", "separators", "nested"),
    "reuse": ("none", "writer", "reader", "both"),
    "load": ("full", "subset", "resharded"),
    "overwrite": ("fresh", "over_larger", "over_smaller"),
}


def domains_for(caps: Capabilities) -> dict[str, tuple[Any, ...]]:
    """The dimensions' values this backend's capabilities allow (CONF-55)."""
    out = dict(DIMENSIONS)
    if not caps.shared_location:
        out["ranks"] = (1,)
    if not caps.thread_count:
        out["thread_count"] = (1,)
    if not caps.overwrite:
        out["overwrite"] = ("fresh",)
    return out


Pair = tuple[str, Any, str, Any]


def _pairs(domains: dict[str, tuple[Any, ...]]) -> dict[Pair, None]:
    names = list(domains)
    return {
        (a, va, b, vb): None
        for i, a in enumerate(names)
        for b in names[i + 1 :]
        for va in domains[a]
        for vb in domains[b]
    }


def _covered(case: dict[str, Any], names: Sequence[str]) -> list[Pair]:
    return [(a, case[a], b, case[b]) for i, a in enumerate(names) for b in names[i + 1 :]]


def pairwise(
    domains: dict[str, tuple[Any, ...]], seed: int = SEED, tries: int = 20
) -> list[dict[str, Any]]:
    """Cases (dimension -> value) covering every pair of values of two dimensions.

    Greedy: each new case starts from a pair not yet covered and gives every other
    dimension the value covering the most uncovered pairs (ties broken by the
    seeded generator); of ``tries`` such candidates the one covering most is kept.
    The result depends only on ``domains`` and ``seed``.
    """
    rng = random.Random(seed)
    names = list(domains)
    uncovered = _pairs(domains)
    cases: list[dict[str, Any]] = []
    while uncovered:
        pending = list(uncovered)
        best: dict[str, Any] = {}
        best_gain = -1
        for _ in range(tries):
            a, va, b, vb = rng.choice(pending)
            case: dict[str, Any] = {a: va, b: vb}
            rest = [n for n in names if n not in case]
            rng.shuffle(rest)
            for n in rest:
                scored = []
                for v in domains[n]:
                    gain = sum(
                        1
                        for m, w in case.items()
                        if ((n, v, m, w) if names.index(n) < names.index(m) else (m, w, n, v))
                        in uncovered
                    )
                    scored.append((gain, rng.random(), v))
                case[n] = max(scored, key=lambda s: (s[0], s[1]))[2]
            gain = sum(1 for p in _covered(case, names) if p in uncovered)
            if gain > best_gain:
                best, best_gain = {n: case[n] for n in names}, gain
        cases.append(best)
        for p in _covered(best, names):
            uncovered.pop(p, None)
    return cases


@dataclass(frozen=True)
class Case:
    """One generated case: its number among ``total`` and its dimension values."""

    number: int
    total: int
    values: dict[str, Any] = field(hash=False)

    def __getitem__(self, name: str) -> Any:
        return self.values[name]


def cases_for(caps: Capabilities, seed: int = SEED) -> list[Case]:
    """The pairwise cases of a backend with these capabilities."""
    found = pairwise(domains_for(caps), seed)
    return [Case(i + 1, len(found), c) for i, c in enumerate(found)]


# --- building a case's state dicts -------------------------------------------------------------

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "complex64": torch.complex64,
    "int16": torch.int16,
    "bool": torch.bool,
}

_COLS = 3


def _rows(case: Case, extra: int = 0) -> int:
    itemsize = torch.empty((), dtype=_DTYPES[case["dtype"]]).element_size()
    return max(6, math.ceil(SIZES[case["size"]] / (_COLS * itemsize))) + extra


def key(case: Case, stem: str) -> str:
    """The flattened FQN of ``stem`` under the case's key shape."""
    shape = case["keys"]
    if shape == "long":
        return ("long_key_" * 40)[:300] + stem
    if shape == "unicode":
        return f"größe_権重_λ_{stem}"
    if shape == "separators":
        return f"sep/../x\\y:z w.{stem}"
    if shape == "nested":
        return ".".join(f"n{i}" for i in range(10)) + f".{stem}"
    return stem


def unfold(flat: dict[str, Any], case: Case) -> dict[str, Any]:
    """A state dict of ``flat``'s items, nested ten levels deep for the "nested" key shape."""
    if case["keys"] != "nested":
        return dict(flat)
    out: dict[str, Any] = {}
    for fqn, value in flat.items():
        node = out
        *parents, leaf = fqn.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return out


def flatten(sd: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """The flattened items of a (possibly nested) state dict, as DCP names them."""
    out: dict[str, Any] = {}
    for k, v in sd.items():
        name = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, f"{name}."))
        else:
            out[name] = v
    return out


def _extremes(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Finite extreme values (largest and smallest normal magnitudes, integer bounds), mixed
    with random finite ones: never NaN, infinity or subnormal (those are CONF-10's)."""
    t = finite_tensor(shape, dtype, gen).clone()
    flat = t.view(-1)
    if dtype == torch.bool:
        ends = torch.tensor([True, False, False, True])
    elif dtype.is_complex:
        part = torch.finfo(torch.float32)
        ends = torch.tensor(
            [complex(part.max, -part.tiny), complex(-part.max, part.tiny), complex(1, -1)],
            dtype=dtype,
        )
    elif dtype.is_floating_point:
        fi = torch.finfo(dtype)
        ends = torch.tensor([fi.max, -fi.max, fi.tiny, -fi.tiny, 1.0, -1.0], dtype=torch.float64)
        ends = ends.to(dtype)
    else:
        ii = torch.iinfo(dtype)
        ends = torch.tensor([ii.max, ii.min, 0, -1, 1], dtype=torch.int64).to(dtype)
    n = min(flat.numel(), 3 * ends.numel())
    if n:
        flat[:n] = ends.repeat(3)[:n]
        flat[-n:] = ends.repeat(3)[:n]
    return t


@dataclass
class Built:
    """A case's per-rank state dicts as the caller holds them, and their chunks.

    ``sds[r]`` is what rank r hands to save (nested for the "nested" key shape, the
    main tensor left out); ``chunks[r]`` maps the main FQN to rank r's (row offset,
    view of ``main``) pairs; ``main`` is the caller's full tensor, of which the
    chunks are views.
    """

    sds: list[dict[str, Any]]
    chunks: list[dict[str, list[tuple[int, torch.Tensor]]]]
    main_fqn: str
    main: torch.Tensor
    small: list[list[str]]  # rank r's small FQNs, in save order: head, skip, tail

    def truths(self) -> list[dict[str, Any]]:
        """Independent copies of every rank's flattened items, the main tensor's chunks
        as one full tensor under its FQN (CONF-40)."""
        out = []
        for sd in self.sds:
            t = {k: v.detach().clone() for k, v in flatten(sd).items()}
            t[self.main_fqn] = self.main.detach().clone()
            out.append(t)
        return out


def build(case: Case, *, seed: int, extra_rows: int = 0, variant: str = "") -> Built:
    """The state dicts of ``case``: per rank a head, a skipped and a tail item and the
    rank's chunks of one main FQN, split by rows round-robin over the ranks."""
    dtype = _DTYPES[case["dtype"]]
    gen = torch.Generator().manual_seed(seed)
    rows = _rows(case, extra_rows)
    maker = _extremes if case["bits"] == "extremes" else finite_tensor
    main = maker((rows, _COLS), dtype, gen)
    main_fqn = key(case, f"{variant}main")
    n_chunks, n_ranks = case["chunks"], case["ranks"]
    bounds = [rows * i // n_chunks for i in range(n_chunks + 1)]
    chunks: list[dict[str, list[tuple[int, torch.Tensor]]]] = [{} for _ in range(n_ranks)]
    for i in range(n_chunks):
        piece = (bounds[i], main[bounds[i] : bounds[i + 1]])
        chunks[i % n_ranks].setdefault(main_fqn, []).append(piece)
    sds, small = [], []
    for r in range(n_ranks):
        names = [key(case, f"{variant}r{r}_{s}") for s in ("head", "skip", "tail")]
        flat = {n: finite_tensor((5,), dtype, gen) for n in names}
        sds.append(unfold(flat, case))
        small.append(names)
    return Built(sds, chunks, main_fqn, main, small)


class ChunkSavePlanner(DefaultSavePlanner):
    """torch's planner plus shard write items for chunks of one FQN (several per rank,
    or spread over ranks), as a rank holding ``ShardedTensor`` or ``DTensor`` shards saves."""

    def __init__(self, chunks: dict[str, list[tuple[int, torch.Tensor]]], full: torch.Size) -> None:
        super().__init__()
        self.chunks = chunks
        self.full = full

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        extra = []
        for fqn, pieces in self.chunks.items():
            for row, t in pieces:
                offsets = torch.Size([row] + [0] * (t.dim() - 1))
                extra.append(
                    WriteItem(
                        index=MetadataIndex(fqn, offsets),
                        type=WriteItemType.SHARD,
                        tensor_data=TensorWriteData(
                            chunk=ChunkStorageMetadata(offsets=offsets, sizes=t.size()),
                            properties=TensorProperties.create_from_tensor(t),
                            size=self.full,
                        ),
                    )
                )
        self.plan = dataclasses.replace(plan, items=list(plan.items) + extra)
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> Any:
        pieces = self.chunks.get(write_item.index.fqn)
        if pieces is not None and write_item.index.offset is not None:
            for row, t in pieces:
                if write_item.index.offset[0] == row:
                    return t
        return super().resolve_data(write_item)


Box = tuple[tuple[int, ...], tuple[int, ...]]


class BoxLoadPlanner(DefaultLoadPlanner):
    """torch's planner for the destination's own keys, plus sub-boxes of one stored tensor
    read into temporaries, as a resharded destination loads them."""

    def __init__(self, fqn: str, boxes: list[Box]) -> None:
        super().__init__()
        self.fqn = fqn
        self.boxes = boxes
        self.dest: dict[tuple[int, ...], torch.Tensor] = {}

    def create_local_plan(self) -> LoadPlan:
        plan = super().create_local_plan()
        md = self.metadata.state_dict_metadata.get(self.fqn) if self.metadata else None
        if not isinstance(md, TensorStorageMetadata):
            raise KeyError(f"the checkpoint's metadata has no tensor {self.fqn!r}")
        items: list[ReadItem] = list(plan.items)
        for offsets, sizes in self.boxes:
            chunk = ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes))
            self.dest[offsets] = torch.zeros(sizes, dtype=md.properties.dtype)
            items.extend(create_read_items_for_chunk_list(self.fqn, md, [chunk]))
        self.plan = dataclasses.replace(plan, items=items)
        return self.plan

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        if read_item.dest_index.fqn != self.fqn:
            found: torch.Tensor = super().resolve_tensor(read_item)
            return found
        view = self.dest[tuple(read_item.dest_index.offset or ())]
        for dim, (start, length) in enumerate(
            zip(read_item.dest_offsets, read_item.lengths, strict=True)
        ):
            view = view.narrow(dim, start, length)
        return view

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        if read_item.dest_index.fqn != self.fqn:
            super().commit_tensor(read_item, tensor)


def reshard_boxes(rows: int, cols: int, ranks: int, rank: int) -> list[Box]:
    """Rank ``rank``'s two row boxes of a destination split over ``ranks`` ranks at
    boundaries shifted off the saved chunks' (one row past each even split)."""
    edges = sorted(
        {0, rows, *(min(rows - 1, rows * i // (2 * ranks) + 1) for i in range(1, 2 * ranks))}
    )
    pieces = list(itertools.pairwise(edges))
    mine = pieces[rank::ranks]
    return [((lo, 0), (hi - lo, cols)) for lo, hi in mine]


def _size_words(case: Case, built: Built | None) -> str:
    if built is None:
        return f"item of about {SIZES[case['size']]} bytes"
    n = built.main.numel() * built.main.element_size()
    words = f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n} bytes"
    return f"item of {words} ({case['dtype']}, {n} bytes)" if n >= 2**20 else f"item of {words}"


def describe_case(case: Case, built: Built | None = None, *, rank: int | None = None) -> str:
    """The case's dimension point in words, for a failure reason (CONF-61)."""
    v = case.values
    spread = ""
    if built is not None:
        per_rank = [sum(len(p) for p in c.values()) for c in built.chunks]
        spread = " (" + ", ".join(f"{n} on rank {r}" for r, n in enumerate(per_rank)) + ")"
    parts = [
        f"case {case.number} of {case.total} (seed {SEED})",
        f"ranks={v['ranks']} (coordinator rank 0)",
        f"thread_count={v['thread_count']}",
        _size_words(case, built),
        f"{v['chunks']} chunk(s) of one FQN{spread}",
        f"dtype {v['dtype']} with {v['bits']} finite bits",
        f"{v['keys']} keys",
        {
            "none": "fresh writers and readers",
            "writer": "writers reused through reset() on every rank",
            "reader": "readers reused through reset() on every rank",
            "both": "writers and readers reused through reset() on every rank",
        }[v["reuse"]],
        {
            "full": "full load",
            "subset": "subset load (skipping items in the middle)",
            "resharded": "resharded load (row boxes off the saved chunks)",
        }[v["load"]],
        {
            "fresh": "at a fresh location",
            "over_larger": "over a larger committed checkpoint",
            "over_smaller": "over a smaller committed checkpoint",
        }[v["overwrite"]],
    ]
    if rank is not None:
        parts.append(f"rank {rank}")
    return ", ".join(parts)
