"""Coordinator planning at thousands of simulated ranks: refdcp against torch, same local plans.

Each measurement runs in a fresh subprocess: it builds the local plans every
rank would send, then times ``create_global_plan`` of refdcp's
``DefaultSavePlanner`` or torch's on the same plans, and records

* the wall time of the call,
* the coordinator's extra peak RSS during the call (``VmHWM`` reset through
  ``/proc/self/clear_refs`` just before it, minus the resident size then),
* the size of the pickled global ``Metadata`` the coordinator would write.

Workloads (issue 16, item 3):

* ``fsdp``: every rank holds one row-shard of each of ``--items`` tensors
  (``ranks * items`` write items, no replicas);
* ``hsdp``: replicated groups of 8: ranks form 8 replicas of a sharded
  model, each tensor split ``ranks / 8`` ways, so every chunk is held by 8
  ranks and dedup picks one writer for it.

The implementations alternate per size; the growth exponent is fitted on
log(time) against log(total items) over the sizes run.

    .venv/bin/python -m benchmarks.bench_scale [--ranks 1024 4096 16384] [--items 500]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pickle
import statistics
import subprocess
import sys
import time
from typing import Any

REPLICAS = 8


def _rss_kib() -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError("no VmRSS in /proc/self/status")


def _hwm_kib() -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    raise RuntimeError("no VmHWM in /proc/self/status")


def _reset_hwm() -> None:
    with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
        f.write("5")


def build_plans(kind: str, ranks: int, items: int) -> list[list[Any]]:
    """The write items of every rank; shared objects where torch's own ranks would share values."""
    import torch
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        MetadataIndex,
        TensorProperties,
    )
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

    props = TensorProperties(dtype=torch.float32)
    shards = ranks if kind == "fsdp" else ranks // REPLICAS
    glob = torch.Size((4 * shards, 8))
    sizes = torch.Size((4, 8))
    per_shard: list[list[WriteItem]] = []
    for s in range(shards):
        off = torch.Size((4 * s, 0))
        chunk = ChunkStorageMetadata(offsets=off, sizes=sizes)
        per_shard.append(
            [
                WriteItem(
                    index=MetadataIndex(f"layers.{i}.weight", off),
                    type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(chunk=chunk, properties=props, size=glob),
                )
                for i in range(items)
            ]
        )
    # hsdp: rank r is shard r % shards of replica r // shards (a list shared by its 8 holders).
    return [per_shard[r % shards] for r in range(ranks)]


def _local_plans(impl: str, per_rank: list[list[Any]]) -> list[Any]:
    from benchmarks.bench_planning import refdcp_local_plans, torch_local_plans

    return refdcp_local_plans(per_rank) if impl == "refdcp" else torch_local_plans(per_rank)


def measure_once(impl: str, kind: str, ranks: int, items: int, gc_mode: str) -> dict[str, float]:
    """Run in the child process: build plans, time one global plan, report figures.

    ``gc_mode`` "as-run" runs each planner as its library's ``save`` does:
    refdcp's with the cyclic collector paused (API-20), torch's with it on;
    "on" and "off" force one setting for both.
    """
    import gc

    from torch.distributed.checkpoint import default_planner as tp

    from refdcp.planning import DefaultSavePlanner

    if gc_mode == "off" or (gc_mode == "as-run" and impl == "refdcp"):
        gc.disable()

    plans = _local_plans(impl, build_plans(kind, ranks, items))
    planner = DefaultSavePlanner() if impl == "refdcp" else tp.DefaultSavePlanner()
    gc.collect()  # an explicit collection runs even while automatic collection is paused
    _reset_hwm()
    before = _rss_kib()
    t0 = time.perf_counter()
    _, metadata = planner.create_global_plan(plans)
    seconds = time.perf_counter() - t0
    peak = _hwm_kib()
    metadata_bytes = len(pickle.dumps(metadata, protocol=pickle.HIGHEST_PROTOCOL))
    return {
        "seconds": seconds,
        "extra_peak_mib": max(0, peak - before) / 1024,
        "metadata_mib": metadata_bytes / 2**20,
    }


def _child(impl: str, kind: str, ranks: int, items: int, gc_mode: str) -> dict[str, float]:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.bench_scale",
            "--child",
            impl,
            kind,
            str(ranks),
            str(items),
            gc_mode,
        ],
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, "PYTHONHASHSEED": "0"},
    )
    if out.returncode != 0:
        raise RuntimeError(f"{impl} {kind} {ranks}: child failed\n{out.stderr[-2000:]}")
    result: dict[str, float] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def _exponent(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of log(y) on log(x)."""
    lx = [math.log(x) for x in xs]
    ly = [math.log(max(y, 1e-9)) for y in ys]
    mx, my = statistics.fmean(lx), statistics.fmean(ly)
    den = sum((a - mx) ** 2 for a in lx)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly)) / den if den else float("nan")


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--child"]:
        impl, kind, ranks, items, gc_mode = argv[1], argv[2], int(argv[3]), int(argv[4]), argv[5]
        print(json.dumps(measure_once(impl, kind, ranks, items, gc_mode)))
        return
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--items", type=int, default=500, help="items per rank")
    parser.add_argument("--kinds", nargs="+", default=["fsdp", "hsdp"])
    parser.add_argument("--repeats", type=int, default=1, help="runs per implementation and size")
    parser.add_argument(
        "--json",
        default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "scale.json"),
        help="also write the rows here (benchmarks/plots.py draws from it; '' to skip)",
    )
    parser.add_argument(
        "--gc",
        choices=["as-run", "on", "off"],
        default="as-run",
        help="cyclic GC during the call: as each library's save runs it (refdcp pauses it), or forced",
    )
    args = parser.parse_args(argv)
    print(f"gc: {args.gc}", flush=True)

    rows: list[dict[str, Any]] = []
    print(
        f"{'workload':6} {'ranks':>6} {'items':>9} | {'refdcp s':>9} {'torch s':>9} {'ratio':>6} | "
        f"{'ref MiB':>8} {'torch MiB':>9} | {'meta MiB':>8}",
        flush=True,
    )
    for kind in args.kinds:
        for ranks in args.ranks:
            runs: dict[str, list[dict[str, float]]] = {"refdcp": [], "torch": []}
            for rep in range(args.repeats):
                order = ("torch", "refdcp") if rep % 2 == 0 else ("refdcp", "torch")
                for impl in order:
                    runs[impl].append(_child(impl, kind, ranks, args.items, args.gc))
            med = {
                impl: {k: statistics.median(r[k] for r in rs) for k in rs[0]}
                for impl, rs in runs.items()
            }
            row = {
                "kind": kind,
                "ranks": ranks,
                "items": ranks * args.items,
                **{f"{impl}_{k}": v for impl, m in med.items() for k, v in m.items()},
            }
            rows.append(row)
            print(
                f"{kind:6} {ranks:6d} {ranks * args.items:9d} | "
                f"{row['refdcp_seconds']:9.2f} {row['torch_seconds']:9.2f} "
                f"{row['refdcp_seconds'] / row['torch_seconds']:6.3f} | "
                f"{row['refdcp_extra_peak_mib']:8.0f} {row['torch_extra_peak_mib']:9.0f} | "
                f"{row['refdcp_metadata_mib']:8.1f}",
                flush=True,
            )
        sel = [r for r in rows if r["kind"] == kind]
        if len(sel) >= 2:
            xs = [float(r["items"]) for r in sel]
            print(
                f"{kind}: time ~ items^{_exponent(xs, [r['refdcp_seconds'] for r in sel]):.2f} "
                f"(refdcp), items^{_exponent(xs, [r['torch_seconds'] for r in sel]):.2f} (torch); "
                f"peak ~ items^{_exponent(xs, [r['refdcp_extra_peak_mib'] for r in sel]):.2f} "
                f"(refdcp), items^{_exponent(xs, [r['torch_extra_peak_mib'] for r in sel]):.2f} (torch)",
                flush=True,
            )
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
