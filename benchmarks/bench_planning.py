"""Global save planning: refdcp's DefaultSavePlanner against torch's, same simulated plans.

Three workloads (issue 3): 128 simulated ranks x 20,000 replicated items;
32 ranks x 20,000 sharded items (one row-slice of each tensor per rank); and
128 ranks x 2,000 replicated items plus one item of each rank's own, so no two
ranks' plans are identical (refdcp's identical-plan fast path cannot apply;
its block digests, PLAN-15, let the shared items be deduplicated once).
Runs alternate between the planners; the table shows the median of
``--repeats`` runs and refdcp/torch ratios. Targets: <= 0.15x, <= 0.25x and
<= 0.33x (the last through block digests, PLAN-15 / DEDUP-14).

    .venv/bin/python benchmarks/bench_planning.py [--repeats 3] [--scale 1.0]

``--cached`` measures instead the steady state of plan caching (PLAN-9..12,
torch's ``enable_plan_caching``): 128 ranks x 20,000 replicated tensors, the
caches primed by one save, then per save the critical path of planning: the
slower of the coordinator's and a non-coordinator's ``set_up_planner`` +
``create_local_plan`` (ranks run them in parallel; every non-coordinator's is
the same in this workload), the coordinator's
``create_global_plan`` over the 128 plans received, and one ``finish_plan``.
refdcp is measured with its default replica check (DEDUP-13, which torch
does not do) and with ``check_replicas=False`` (torch's semantics). Target:
refdcp <= 0.2x torch.
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
from refdcp.planning.local_plan import plan_and_block_digests

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
    """What refdcp's create_local_plan sends: items, FQN paths, plan and block digests
    (computed per rank, locally; PLAN-15)."""
    out = []
    digests: dict[int, tuple[str, Any]] = {}
    for items in per_rank:
        key = id(items)
        if key not in digests:  # identical lists: the same digests each rank would compute
            digests[key] = plan_and_block_digests(items)
        paths: dict[str, Any] = {i.index.fqn: (i.index.fqn,) for i in items}
        digest, blocks = digests[key]
        paths[RESERVED_KEY] = {
            "rich": {},
            "empties": [],
            "digest": digest,
            "blocks": blocks,
            "checksums": None,
        }
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


def _steady_state(planner_cls: Any, kw: dict[str, Any], sd: dict[str, Any], ranks: int) -> Any:
    """Prime the caches with one save, then return a function timing one cached save."""
    coord, other = planner_cls(**kw), planner_cls(**kw)

    def one_save() -> tuple[float, float, bool]:
        t0 = time.perf_counter()
        coord.set_up_planner(sd, None, True)
        mine = coord.create_local_plan()
        t1 = time.perf_counter()
        other.set_up_planner(sd, None, False)
        theirs = other.create_local_plan()  # the same on every non-coordinator rank
        # ranks plan locally in parallel: the slower of the two is on the critical path
        local = max(t1 - t0, time.perf_counter() - t1)
        t1 = time.perf_counter()
        plans, _ = coord.create_global_plan([mine] + [theirs] * (ranks - 1))
        coord.finish_plan(plans[0])
        glob = time.perf_counter() - t1
        other.finish_plan(plans[1])
        return local, glob, not theirs.usable

    one_save()  # prime
    return one_save


def run_cached(ranks: int, items: int, repeats: int) -> None:
    import warnings

    warnings.filterwarnings("ignore")
    sd = {f"layer{i // 10}.p{i % 10}": torch.zeros(16 + (i * 37) % 256) for i in range(items)}
    variants: list[tuple[str, Any, dict[str, Any]]] = [
        ("torch", tp.DefaultSavePlanner, {"enable_plan_caching": True}),
        ("refdcp", DefaultSavePlanner, {"enable_plan_caching": True}),
        (
            "refdcp check_replicas=False",
            DefaultSavePlanner,
            {"enable_plan_caching": True, "check_replicas": False},
        ),
    ]
    runs = {name: _steady_state(cls, kw, sd, ranks) for name, cls, kw in variants}
    got: dict[str, list[tuple[float, float, bool]]] = {name: [] for name in runs}
    for r in range(repeats):  # alternate the implementations
        order = list(runs) if r % 2 == 0 else list(reversed(runs))
        for name in order:
            got[name].append(runs[name]())
    print(f"cached steady state, {ranks} ranks x {items} replicated tensors, median of {repeats}")
    print(f"{'planner':30} {'local s':>9} {'global s':>9} {'total s':>9} {'vs torch':>9} cached")
    base = statistics.median(a + b for a, b, _ in got["torch"])
    base_g = statistics.median(b for _, b, _ in got["torch"])
    for name, rows in got.items():
        loc = statistics.median(a for a, _, _ in rows)
        glo = statistics.median(b for _, b, _ in rows)
        tot = statistics.median(a + b for a, b, _ in rows)
        hit = all(h for _, _, h in rows)
        print(f"{name:30} {loc:9.4f} {glo:9.4f} {tot:9.4f} {tot / base:9.3f} {hit}")
    print(f"(global step alone, torch: {base_g:.5f} s)")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--scale", type=float, default=1.0, help="multiply item counts (e.g. 0.1 for a quick run)"
    )
    parser.add_argument("--cached", action="store_true", help="plan caching steady state")
    args = parser.parse_args(argv)
    if args.cached:
        run_cached(128, max(1, int(20_000 * args.scale)), args.repeats)
        return
    n = max(1, int(20_000 * args.scale))
    m = max(1, int(2_000 * args.scale))
    rows = [
        run(f"replicated 128 ranks x {n}", replicated_plans(128, n), args.repeats),
        run(f"sharded 32 ranks x {n}", sharded_plans(32, n), args.repeats),
        run(f"mixed 128 ranks x {m}+1", mixed_plans(128, m), args.repeats),
    ]
    targets = [0.15, 0.25, 0.33]
    print(f"{'workload':32} {'refdcp s':>10} {'torch s':>10} {'ratio':>7} {'target':>7}")
    for (name, ours, theirs), target in zip(rows, targets):
        print(f"{name:32} {ours:10.3f} {theirs:10.3f} {ours / theirs:7.3f} {target:7.2f}")


if __name__ == "__main__":
    main()
