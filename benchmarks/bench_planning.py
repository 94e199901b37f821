"""Global save planning: refdcp's DefaultSavePlanner against torch's, same simulated plans.

Three workloads (issue 3): 128 simulated ranks x 20,000 replicated items;
32 ranks x 20,000 sharded items (one row-slice of each tensor per rank); and
128 ranks x 2,000 replicated items plus one item of each rank's own, so no two
ranks' plans are identical (refdcp's identical-plan fast path cannot apply).
Runs alternate between the planners; the table shows the median of
``--repeats`` runs and refdcp/torch ratios. Targets: <= 0.15x and <= 0.25x.

    .venv/bin/python benchmarks/bench_planning.py [--repeats 3] [--scale 1.0]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.checkpoint import default_planner as tp
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

from refdcp.planning import DefaultSavePlanner
from refdcp.planning.flatten import RESERVED_KEY
from refdcp.planning.local_plan import plan_digest

PROPS = TensorProperties(dtype=torch.float32)


def _item(
    fqn: str,
    off: tuple[int, ...],
    sizes: tuple[int, ...],
    glob: tuple[int, ...],
    kind: WriteItemType,
) -> WriteItem:
    o = torch.Size(off)
    return WriteItem(
        index=MetadataIndex(fqn, o),
        type=kind,
        tensor_data=TensorWriteData(
            chunk=ChunkStorageMetadata(offsets=o, sizes=torch.Size(sizes)),
            properties=PROPS,
            size=torch.Size(glob),
        ),
    )


def replicated_plans(ranks: int, items: int) -> list[list[WriteItem]]:
    """Every rank holds the same ``items`` plain tensors of varied sizes."""
    shared = [
        _item(
            f"layer{i // 10}.p{i % 10}",
            (0,),
            (16 + (i * 37) % 256,),
            (16 + (i * 37) % 256,),
            WriteItemType.TENSOR,
        )
        for i in range(items)
    ]
    return [shared for _ in range(ranks)]


def sharded_plans(ranks: int, items: int) -> list[list[WriteItem]]:
    """Rank r holds rows [4r, 4r+4) of each of ``items`` (4*ranks, 8) tensors."""
    return [
        [
            _item(f"w{i}", (4 * r, 0), (4, 8), (4 * ranks, 8), WriteItemType.SHARD)
            for i in range(items)
        ]
        for r in range(ranks)
    ]


def mixed_plans(ranks: int, items: int) -> list[list[WriteItem]]:
    """Replicated items plus one rank-local item per rank: every plan differs."""
    base = replicated_plans(1, items)[0]
    own = [_item(f"own{r}", (0,), (8,), (8,), WriteItemType.TENSOR) for r in range(ranks)]
    return [[*base, own[r]] for r in range(ranks)]


def refdcp_local_plans(per_rank: list[list[WriteItem]]) -> list[SavePlan]:
    """What refdcp's create_local_plan sends: items, FQN paths, digest (computed per rank, locally)."""
    out = []
    digests: dict[int, str] = {}
    for items in per_rank:
        key = id(items)
        if key not in digests:  # identical lists: the same digest each rank would compute
            digests[key] = plan_digest(items)
        paths: dict[str, Any] = {i.index.fqn: (i.index.fqn,) for i in items}
        paths[RESERVED_KEY] = {"rich": {}, "empties": [], "digest": digests[key], "checksums": None}
        out.append(SavePlan(items, planner_data=paths))
    return out


def torch_local_plans(per_rank: list[list[WriteItem]]) -> list[SavePlan]:
    return [
        SavePlan(items, planner_data={i.index.fqn: (i.index.fqn,) for i in items})
        for items in per_rank
    ]


def _time(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def run(name: str, per_rank: list[list[WriteItem]], repeats: int) -> tuple[str, float, float]:
    ours_plans = refdcp_local_plans(per_rank)
    torch_plans = torch_local_plans(per_rank)
    ours: list[float] = []
    theirs: list[float] = []
    for _ in range(repeats):
        theirs.append(_time(lambda: tp.DefaultSavePlanner().create_global_plan(torch_plans)))
        ours.append(_time(lambda: DefaultSavePlanner().create_global_plan(ours_plans)))
    return name, statistics.median(ours), statistics.median(theirs)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--scale", type=float, default=1.0, help="multiply item counts (e.g. 0.1 for a quick run)"
    )
    args = parser.parse_args(argv)
    n = max(1, int(20_000 * args.scale))
    m = max(1, int(2_000 * args.scale))
    rows = [
        run(f"replicated 128 ranks x {n}", replicated_plans(128, n), args.repeats),
        run(f"sharded 32 ranks x {n}", sharded_plans(32, n), args.repeats),
        run(f"mixed 128 ranks x {m}+1", mixed_plans(128, m), args.repeats),
    ]
    targets = [0.15, 0.25, 1.0]
    print(f"{'workload':32} {'refdcp s':>10} {'torch s':>10} {'ratio':>7} {'target':>7}")
    for (name, ours, theirs), target in zip(rows, targets):
        print(f"{name:32} {ours:10.3f} {theirs:10.3f} {ours / theirs:7.3f} {target:7.2f}")


if __name__ == "__main__":
    main()
