"""What the replica check costs a real multi-rank save (DEDUP-13, DEDUP-17), in % of the save.

Two Gloo ranks save the storage benchmark's large (4 x 256 MiB) and medium
(1,000 x 1 MiB) workloads, float32, into a fresh directory on the benchmark
disk, three ways, alternating run by run:

* ``off``: ``DefaultSavePlanner(check_replicas=False)`` (torch's behaviour);
* ``deferred``: the default: tensor digests computed on a worker while the rank
  writes, compared before the commit (DEDUP-17);
* ``early``: the same digests in the local plans, compared in the global plan
  before anything is written (DEDUP-13 as torch's ``dcp.save`` drives it, and
  refdcp's default before DEDUP-17);
* ``torch``: torch's own ``dcp.save`` (its planner and ``FileSystemWriter``, no
  replica check), the same state in the same run: ``deferred / torch`` is refdcp's
  default save time as a ratio to torch's.

Two layouts: ``replicated`` (both ranks hold the same keys and values: dedup
splits the writing, every rank digests every tensor) and ``distinct`` (each
rank its own keys: nothing is replicated, but the non-coordinator rank cannot
know that and digests all it holds). A save's time is the slowest rank's
(max over ranks, from a barrier to the save's return). Reported: medians per
mode and the cost of ``deferred`` and ``early`` as % of ``off`` (ratio of medians,
and the median of per-trial pairs). The order of the three modes rotates from
trial to trial, so each runs first, second and third equally often (a trial's
first save runs on memory the previous trial's last one freed). The two ranks share the 2 cores and the disk
of the benchmark VM, so a digest competes with the other rank's write: a
pessimistic setting for the overlap. First, the coordinator's own cost: comparing
the digests of 128 ranks before the commit, with and without the groups equal
plans send (``RankDigests.group``).

    .venv/bin/python -m benchmarks.bench_replica_check [--trials 7] [--only large|medium] [--dir /dev/shm]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from typing import Any

MiB = 1 << 20
WORKLOADS: dict[str, tuple[int, int]] = {  # name -> (count, bytes each)
    "large 4 x 256 MiB": (4, 256 * MiB),
    "medium 1,000 x 1 MiB": (1000, MiB),
}
LAYOUTS = ("replicated", "distinct")
MODES = ("off", "deferred", "early", "torch")


def _state(rank: int, count: int, nbytes: int, layout: str) -> dict[str, Any]:
    import torch

    prefix = "" if layout == "replicated" else f"r{rank}."
    return {
        f"{prefix}t{i}": torch.full((nbytes // 4,), float(i % 97), dtype=torch.float32)
        for i in range(count)
    }


def _planner(mode: str) -> Any:
    from refdcp.planning import DefaultSavePlanner

    class EarlyDigests(DefaultSavePlanner):
        """Digests in the local plans, as when torch's ``dcp.save`` drives (DEDUP-13)."""

        def defer_replica_digests(self) -> None:
            pass

    if mode == "off":
        return DefaultSavePlanner(check_replicas=False)
    return DefaultSavePlanner() if mode == "deferred" else EarlyDigests()


def _rank(rank: int, world: int, names: list[str], trials: int, base: str) -> list[Any]:
    import torch
    import torch.distributed as dist

    import refdcp

    rows: list[Any] = []
    for name in names:
        count, nbytes = WORKLOADS[name]
        for layout in LAYOUTS:
            sd = _state(rank, count, nbytes, layout)
            for trial in range(-1, trials):  # trial -1 warms up every mode, uncounted
                k = trial % len(MODES)  # each mode takes each place in the order equally
                order = MODES[k:] + MODES[:k]
                for mode in order:
                    path = os.path.join(base, f"{layout}-{mode}-{trial}")
                    dist.barrier()
                    t0 = time.perf_counter()
                    if mode == "torch":
                        import torch.distributed.checkpoint as dcp

                        dcp.save(sd, checkpoint_id=path)
                    else:
                        refdcp.save(sd, checkpoint_id=path, planner=_planner(mode))
                    took = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
                    dist.all_reduce(took, op=dist.ReduceOp.MAX)
                    dist.barrier()
                    if rank == 0:
                        shutil.rmtree(path)
                        if trial >= 0:
                            rows.append((name, layout, mode, trial, float(took.item())))
                    dist.barrier()
            del sd
    return rows


def _coordinator_compare(ranks: int, shared: int, own: int, grouped: bool) -> float:
    """Seconds the coordinator takes to compare the digests ``ranks`` ranks send: each
    holds ``shared`` replicated tensors and ``own`` of its own (DEDUP-17). With ``grouped``
    the non-coordinator ranks' plans are equal, so they send one group."""
    import random

    import torch

    from refdcp.planning.dedup.deferred import RankDigests, group_of, replica_problems

    values = [random.getrandbits(32) for _ in range(shared)]
    digests = []
    for r in range(ranks):
        keys = [(f"layer{i}.weight", torch.Size([0])) for i in range(shared)]
        sums = dict(zip(keys, values))
        sums.update({(f"own{r}.{i}", torch.Size([0])): r for i in range(own)})
        group = group_of(b"plan", sums) if grouped and r else None
        digests.append(RankDigests(sums, group))
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        assert replica_problems(digests) == []
        best = min(best, time.perf_counter() - t0)
    return best


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=7)
    parser.add_argument("--only", default=None, help="workloads whose name contains this")
    parser.add_argument("--dir", default=None, help="where to save (default: a temp dir on disk)")
    args, _ = parser.parse_known_args(argv)
    from refdcp.testing.spawn import run_gloo

    print("coordinator's compare before the commit (best of 3):")
    for ranks, shared, own, grouped, what in (
        (128, 20_000, 0, True, "replicated 128 ranks x 20,000 (equal plans: one group)"),
        (128, 20_000, 0, False, "same, no groups (every rank screened)"),
        (128, 2_000, 1, False, "mixed 128 ranks x 2,000+1 (plans differ)"),
    ):
        print(f"  {what:56} {_coordinator_compare(ranks, shared, own, grouped) * 1e3:7.1f} ms")
    names = [n for n in WORKLOADS if args.only is None or args.only in n] or list(WORKLOADS)
    base = tempfile.mkdtemp(prefix="refdcp-bench-replica-", dir=args.dir)
    print(f"load average before: {os.getloadavg()[0]:.2f}; 2 Gloo ranks; {args.trials} trials")
    try:
        rows = run_gloo(2, _rank, names, args.trials, base, timeout=3600)[0]
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    head = f"{'workload':22} {'layout':10} " + " ".join(f"{m + ' s':>8}" for m in MODES)
    print(head + f" {'deferred %':>16} {'early %':>16} {'deferred/torch':>14}")
    for name in names:
        for layout in LAYOUTS:
            t: dict[str, dict[int, float]] = {m: {} for m in MODES}
            for n, lay, mode, trial, s in rows:
                if n == name and lay == layout:
                    t[mode][trial] = s
            med = {m: statistics.median(t[m].values()) for m in MODES}
            cells = " ".join(f"{med[m]:8.3f}" for m in MODES)
            costs = []
            for m in ("deferred", "early"):
                pairs = statistics.median(t[m][i] / t["off"][i] - 1 for i in t["off"])
                costs.append(f"{100 * (med[m] / med['off'] - 1):+6.1f} ({100 * pairs:+6.1f})")
            vs_torch = med["deferred"] / med["torch"]
            print(f"{name:22} {layout:10} {cells} {costs[0]:>16} {costs[1]:>16} {vs_torch:10.2f}")
    print("cost: ratio of medians - 1, in brackets the median of per-trial ratios - 1;")
    print("deferred/torch: refdcp's default save time / torch's dcp.save (medians, lower is better)")


if __name__ == "__main__":
    main()
