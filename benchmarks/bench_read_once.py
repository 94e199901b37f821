"""Read-once loads (spec/read_once.md): bytes read from storage and wall time, against reading N times.

(a) Real Gloo process groups of 2 and 4 ranks on this machine, a fully
replicated state (``--mib`` in all, 8 float32 tensors, identical on every
rank), saved once by ``refdcp.save``; then, alternating within each trial,
``refdcp.load(read_once=True)``, ``refdcp.load(read_once=False)`` (every rank
reads every item: read-N) and torch's ``dcp.load``, each into zeroed tensors.
Per load: the slowest rank's wall time and each rank's bytes read from
storage, counted by ``refdcp.testing.storage_wrappers.CountingReader`` (the
stored bytes of each item its reads touch), wrapped around each library's own
``FileSystemReader``. The checkpoint is in the page cache (it was just
written): this is local storage at its fastest, where reading N times costs
least. Every refdcp load is checked bit-exact.

(b) A modelled shared storage at 8, 16, 32 and 64 ``FakeWorld`` ranks (threads
of this process): ``ModelledReader`` makes every request wait its turn on one
link of ``--bandwidth-mib`` MiB/s plus ``--latency-ms`` per request, shared by
all ranks. Per load: total bytes read, the link's busy time (the modelled
storage time) and the wall time (which includes the in-process exchange).

    python -m benchmarks.bench_read_once [--mib 512] [--ranks 2 4] [--trials 3]
        [--sim-ranks 8 16 32 64] [--sim-mib 8] [--bandwidth-mib 200] [--latency-ms 5]
        [--json benchmarks/results/read_once.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from typing import Any

MiB = 1 << 20
TENSORS = 8
MODES = ("read_once", "read_n", "torch")


def _state(mib: float, fill: bool) -> dict[str, Any]:
    import torch

    n = int(mib * MiB) // 4 // TENSORS
    return {
        f"w.{i}": (torch.arange(n, dtype=torch.float32) + i) if fill else torch.zeros(n)
        for i in range(TENSORS)
    }


def _gloo_rank(rank: int, world: int, path: str, mib: float, trials: int) -> list[Any]:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as tdcp

    import refdcp
    from refdcp.testing.storage_wrappers import CountingReader

    torch.set_num_threads(1)
    expected = _state(mib, fill=True)
    refdcp.save(expected, checkpoint_id=path)
    out: list[Any] = []
    for trial in range(trials):
        order = MODES if trial % 2 == 0 else MODES[::-1]
        for mode in order:
            sd = _state(mib, fill=False)
            if mode == "torch":
                reader = CountingReader(tdcp.FileSystemReader(path))
            else:
                reader = CountingReader(refdcp.FileSystemReader(path))
            dist.barrier()
            t0 = time.perf_counter()
            if mode == "torch":
                tdcp.load(sd, storage_reader=reader)
            else:
                refdcp.load(sd, storage_reader=reader, read_once=mode == "read_once")
            dist.barrier()
            seconds = time.perf_counter() - t0
            exact = all(torch.equal(sd[k], expected[k]) for k in expected)
            out.append((trial, mode, seconds, reader.bytes_read, exact))
            del sd
    return out


def gloo_part(worlds: list[int], mib: float, trials: int) -> list[dict[str, Any]]:
    from refdcp.testing.spawn import run_gloo

    print(f"(a) Gloo, fully replicated {mib:g} MiB, {trials} trials, alternating")
    print(f"load average at start: {os.getloadavg()}")
    print("world  mode        wall s (median)  bytes read per rank (MiB)   total / checkpoint")
    rows: list[dict[str, Any]] = []
    for world in worlds:
        d = tempfile.mkdtemp(prefix="bench_read_once_")
        try:
            ranks = run_gloo(world, _gloo_rank, f"{d}/ckpt", mib, trials, timeout=3600)
        finally:
            shutil.rmtree(d, ignore_errors=True)
        walls: dict[str, list[float]] = {m: [] for m in MODES}
        reads: dict[str, list[int]] = {}
        for t in range(trials):
            for m in MODES:
                got = [next(r for r in rank if r[0] == t and r[1] == m) for rank in ranks]
                walls[m].append(max(r[2] for r in got))
                reads[m] = [r[3] for r in got]
                assert m == "torch" or all(r[4] for r in got), f"{m} not bit-exact"
        total = mib * MiB
        for m in MODES:
            rows.append(
                {
                    "part": "gloo",
                    "ranks": world,
                    "mode": m,
                    "wall_s": walls[m],
                    "bytes_per_rank": reads[m],
                    "checkpoint_bytes": total,
                }
            )
            per = " ".join(f"{b / MiB:.0f}" for b in reads[m])
            print(
                f"{world:5d}  {m:10s}  {statistics.median(walls[m]):8.3f} "
                f"({' '.join(f'{w:.3f}' for w in walls[m])})  {per:24s}  "
                f"{sum(reads[m]) / total:.2f}x"
            )
        print(
            f"       read_once / read_n wall: "
            f"{statistics.median(walls['read_once']) / statistics.median(walls['read_n']):.2f}; "
            f"read_once / torch: "
            f"{statistics.median(walls['read_once']) / statistics.median(walls['torch']):.2f}"
        )
    print(f"load average at end: {os.getloadavg()}")
    return rows


def _sim_rank(comm: Any, path: str, mib: float, once: bool, link: Any) -> tuple[int, bool]:
    import torch

    import refdcp
    from refdcp.testing.storage_wrappers import ModelledReader

    expected = _state(mib, fill=True)
    sd = _state(mib, fill=False)
    reader = ModelledReader(refdcp.FileSystemReader(path), link)
    refdcp.load(sd, storage_reader=reader, comm=comm, read_once=once)
    return reader.bytes_read, all(torch.equal(sd[k], expected[k]) for k in expected)


def sim_part(
    worlds: list[int], mib: float, bandwidth_mib: float, latency_ms: float
) -> list[dict[str, Any]]:
    import refdcp
    from refdcp.comm import FakeWorld
    from refdcp.testing.storage_wrappers import SharedLink

    print(
        f"(b) modelled shared storage: {bandwidth_mib:g} MiB/s link, {latency_ms:g} ms per "
        f"request; fully replicated {mib:g} MiB; FakeWorld ranks"
    )
    print("ranks  mode       total read (MiB)  x checkpoint  link busy s  wall s")
    rows: list[dict[str, Any]] = []
    d = tempfile.mkdtemp(prefix="bench_read_once_sim_")
    try:
        refdcp.save(_state(mib, fill=True), checkpoint_id=d, no_dist=True)
        for world in worlds:
            for once in (True, False):
                link = SharedLink(bandwidth_mib * MiB, latency_ms / 1000)
                t0 = time.perf_counter()
                got = FakeWorld(world, timeout=600).run(_sim_rank, d, mib, once, link)
                wall = time.perf_counter() - t0
                assert all(ok for _, ok in got), "not bit-exact"
                total = sum(b for b, _ in got)
                rows.append(
                    {
                        "part": "modelled",
                        "ranks": world,
                        "mode": "read_once" if once else "read_n",
                        "wall_s": [wall],
                        "link_busy_s": link.busy_s,
                        "bytes_total": total,
                        "checkpoint_bytes": mib * MiB,
                        "bandwidth_mib": bandwidth_mib,
                        "latency_ms": latency_ms,
                    }
                )
                print(
                    f"{world:5d}  {'read_once' if once else 'read_n':9s}  {total / MiB:16.1f}  "
                    f"{total / (mib * MiB):12.2f}  {link.busy_s:11.3f}  {wall:6.2f}"
                )
    finally:
        shutil.rmtree(d, ignore_errors=True)
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--mib", type=float, default=512)
    ap.add_argument("--ranks", type=int, nargs="*", default=[2, 4])
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--sim-ranks", type=int, nargs="*", default=[8, 16, 32, 64])
    ap.add_argument("--sim-mib", type=float, default=8)
    ap.add_argument("--bandwidth-mib", type=float, default=200)
    ap.add_argument("--latency-ms", type=float, default=5)
    ap.add_argument(
        "--json",
        default=os.path.join(
            os.path.dirname(os.path.abspath(__file__)), "results", "read_once.json"
        ),
        help="where to write the rows (benchmarks.plots draws read_once.png from it); '' for none",
    )
    args = ap.parse_args(argv)
    rows: list[dict[str, Any]] = []
    if args.ranks:
        rows += gloo_part(args.ranks, args.mib, args.trials)
    if args.sim_ranks:
        rows += sim_part(args.sim_ranks, args.sim_mib, args.bandwidth_mib, args.latency_ms)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"load_average": os.getloadavg(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
