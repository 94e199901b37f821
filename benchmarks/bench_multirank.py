"""Save and load on real Gloo process groups: refdcp against torch DCP, same state, one run.

Every rank holds its row-shard of a sharded state (``--sharded-mib`` in all, as ``LocalShards``, which both libraries' planners accept;
split evenly over the ranks) and a full copy of a replicated state
(``--replicated-mib``, identical on every rank). Both libraries save it with
``sync_files=True`` into a fresh directory and load it back into zeroed
tensors. Per run and rank: save and load wall time (the slowest rank counts,
as the job waits for it) and the bytes the rank wrote (sizes of its
``__{rank}_*.distcp`` files), which shows how dedup spread the replicated
state. Implementations alternate run by run; the table gives medians.

The 2-core machine runs N ranks on 2 cores and one disk: the figures show
relative costs of the two libraries under the same contention, not scaling.

    .venv/bin/python -m benchmarks.bench_multirank [--ranks 2 4] [--trials 3]
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import statistics
import tempfile
import time
from typing import Any

MiB = 1 << 20
TENSORS = 8  # the sharded and the replicated state are each split into this many tensors


def _state(
    rank: int, world: int, sharded_mib: int, replicated_mib: int, fill: bool
) -> dict[str, Any]:
    import torch

    from refdcp.planning import LocalShards

    rows_total = sharded_mib * MiB // 4 // TENSORS // 256
    rows = rows_total // world
    out: dict[str, Any] = {}
    for i in range(TENSORS):
        local = (
            torch.full((rows, 256), float(rank + i), dtype=torch.float32)
            if fill
            else torch.zeros(rows, 256)
        )
        out[f"sharded.{i}"] = LocalShards((rows * world, 256), [((rank * rows, 0), local)])
    n = replicated_mib * MiB // 4 // TENSORS
    for i in range(TENSORS):
        out[f"replicated.{i}"] = (
            torch.full((n,), float(i), dtype=torch.float32) if fill else torch.zeros(n)
        )
    return out


def _rank_fn(
    rank: int, world: int, impl: str, path: str, sharded_mib: int, replicated_mib: int
) -> dict[str, float]:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as tdcp

    import refdcp

    torch.set_num_threads(1)
    state = _state(rank, world, sharded_mib, replicated_mib, fill=True)
    if impl == "refdcp":
        writer: Any = refdcp.FileSystemWriter(path, sync_files=True)
        save: Any = refdcp.save
        load: Any = refdcp.load
        reader: Any = refdcp.FileSystemReader(path)
    else:
        writer = tdcp.FileSystemWriter(path, sync_files=True)
        save, load = tdcp.save, tdcp.load
        reader = tdcp.FileSystemReader(path)
    dist.barrier()
    t0 = time.perf_counter()
    save(state, storage_writer=writer)
    dist.barrier()
    t_save = time.perf_counter() - t0
    written = sum(os.path.getsize(f) for f in glob.glob(os.path.join(path, f"__{rank}_*.distcp")))
    target = _state(rank, world, sharded_mib, replicated_mib, fill=False)
    dist.barrier()
    t0 = time.perf_counter()
    load(target, storage_reader=reader)
    dist.barrier()
    t_load = time.perf_counter() - t0
    return {"save": t_save, "load": t_load, "written": float(written)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--sharded-mib", type=int, default=1024)
    parser.add_argument("--replicated-mib", type=int, default=256)
    args = parser.parse_args(argv)

    from refdcp.testing.spawn import run_gloo

    print(
        f"{'ranks':>5} | {'refdcp save':>11} {'torch save':>10} {'ratio':>6} | "
        f"{'refdcp load':>11} {'torch load':>10} {'ratio':>6} | written per rank MiB (refdcp; torch)",
        flush=True,
    )
    for world in args.ranks:
        res: dict[str, list[list[dict[str, float]]]] = {"refdcp": [], "torch": []}
        for trial in range(args.trials):
            order = ("torch", "refdcp") if trial % 2 == 0 else ("refdcp", "torch")
            for impl in order:
                d = tempfile.mkdtemp(prefix=f"bench_mr_{impl}_")
                try:
                    res[impl].append(
                        run_gloo(
                            world,
                            _rank_fn,
                            impl,
                            d,
                            args.sharded_mib,
                            args.replicated_mib,
                            timeout=900,
                        )
                    )
                finally:
                    shutil.rmtree(d, ignore_errors=True)

        def med(impl: str, key: str, res: dict[str, list[list[dict[str, float]]]] = res) -> float:
            return statistics.median(max(r[key] for r in run) for run in res[impl])

        def per_rank(impl: str, res: dict[str, list[list[dict[str, float]]]] = res) -> str:
            return "/".join(f"{r['written'] / MiB:.0f}" for r in res[impl][-1])

        rs, ts, rl, tl = (
            med("refdcp", "save"),
            med("torch", "save"),
            med("refdcp", "load"),
            med("torch", "load"),
        )
        print(
            f"{world:5d} | {rs:11.2f} {ts:10.2f} {rs / ts:6.2f} | {rl:11.2f} {tl:10.2f} {rl / tl:6.2f} | "
            f"{per_rank('refdcp')}; {per_rank('torch')}",
            flush=True,
        )


if __name__ == "__main__":
    main()
