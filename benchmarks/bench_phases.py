"""Per-item cost of every step of a small-item save and load (µs/item), refdcp against torch.

One workload of many small tensors (default 20,000 x 4 KiB, float32), saved
with ``sync_files=False`` into a fresh directory and loaded back into zeroed
tensors, each trial in a fresh child process (warmed by one untimed save and
load of the same state first). refdcp's driver reports the wall time of each
protocol step through its ``observer`` hook; torch's save and load are timed
whole. Implementations alternate trial by trial; medians are reported.

``--before PATH`` also measures the refdcp source tree at ``PATH`` (for
example ``git worktree add /tmp/before <commit>``) in the same run, so the
per-step costs before and after a change come from one machine state.

    .venv/bin/python -m benchmarks.bench_phases [--items 20000] [--trials 3] [--before PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _child_main(impl: str, items: int, elems: int) -> dict[str, float]:
    import warnings

    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed.checkpoint as tdcp

    torch.set_num_threads(1)
    src = {f"layer{i // 16}.p{i % 16}": torch.full((elems,), float(i)) for i in range(items)}
    dst = {k: torch.zeros(elems) for k in src}
    root = tempfile.mkdtemp(prefix="bench_phases_")
    out: dict[str, float] = {}
    try:
        if impl == "torch":
            for tag in ("warm", "timed"):
                path = os.path.join(root, tag)
                w = tdcp.FileSystemWriter(path, sync_files=False)
                t0 = time.perf_counter()
                tdcp.save(src, storage_writer=w, no_dist=True)
                t1 = time.perf_counter()
                tdcp.load(dst, storage_reader=tdcp.FileSystemReader(path), no_dist=True)
                t2 = time.perf_counter()
            out["save total"], out["load total"] = t1 - t0, t2 - t1
            return out
        import refdcp

        records: list[Any] = []
        for tag in ("warm", "timed"):
            records.clear()
            path = os.path.join(root, tag)
            w = refdcp.FileSystemWriter(path, sync_files=False)
            t0 = time.perf_counter()
            refdcp.save(src, storage_writer=w, no_dist=True, observer=records.append)
            t1 = time.perf_counter()
            save_steps = list(records)
            records.clear()
            refdcp.load(
                dst,
                storage_reader=refdcp.FileSystemReader(path),
                no_dist=True,
                observer=records.append,
            )
            t2 = time.perf_counter()
        out["save total"], out["load total"] = t1 - t0, t2 - t1
        for op, recs in (("save", save_steps), ("load", records)):
            for r in recs:
                name = f"{op} {getattr(r.step, 'value', r.step)}"
                out[name] = out.get(name, 0.0) + r.seconds
        return out
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _run_child(impl: str, items: int, elems: int, tree: str) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": tree, "OMP_NUM_THREADS": "1"}
    code = (
        "import json, sys; from benchmarks.bench_phases import _child_main; "
        f"print(json.dumps(_child_main({impl!r}, {items}, {elems})))"
    )
    # cwd=tree: `python -c` puts the working directory first on sys.path, before PYTHONPATH
    res = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tree, check=False
    )
    if res.returncode != 0:
        raise RuntimeError(f"{impl} child failed:\n{res.stderr[-3000:]}")
    data: dict[str, float] = json.loads(res.stdout.strip().splitlines()[-1])
    return data


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--items", type=int, default=20_000)
    parser.add_argument("--bytes", type=int, default=4096, help="bytes per tensor")
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--before", default=None, help="another refdcp source tree to measure")
    parser.add_argument(
        "--json",
        default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "phases.json"),
        help="also write the medians here (benchmarks/plots.py draws from it; '' to skip)",
    )
    args = parser.parse_args(argv)
    elems = args.bytes // 4
    impls: list[tuple[str, str, str]] = [("refdcp", "refdcp", HERE), ("torch", "torch", HERE)]
    if args.before:
        impls.insert(0, ("refdcp before", "refdcp", os.path.abspath(args.before)))
    runs: dict[str, list[dict[str, float]]] = {label: [] for label, _, _ in impls}
    for trial in range(args.trials):
        order = impls if trial % 2 == 0 else impls[::-1]
        for label, impl, tree in order:
            runs[label].append(_run_child(impl, args.items, elems, tree))
    med = {
        label: {k: statistics.median(r.get(k, 0.0) for r in rs) for k in rs[0]}
        for label, rs in runs.items()
    }
    names = [k for k in med["refdcp"] if not k.endswith("total")]
    names += [k for k in med.get("refdcp before", {}) if k not in names and not k.endswith("total")]
    labels = [label for label, _, _ in impls]
    print(f"{args.items} items x {args.bytes} B; µs per item, medians of {args.trials}")
    print(f"{'step':28}" + "".join(f"{label:>15}" for label in labels))
    for n in [*names, "save total", "load total"]:
        cells = "".join(
            f"{med[label][n] / args.items * 1e6:15.1f}" if n in med[label] else f"{'-':>15}"
            for label in labels
        )
        print(f"{n:28}{cells}")
    for op in ("save", "load"):
        t = med["torch"][f"{op} total"]
        print(f"{op}: torch/refdcp = {t / med['refdcp'][f'{op} total']:.2f}x", end="")
        if args.before:
            print(f" (before: {t / med['refdcp before'][f'{op} total']:.2f}x)", end="")
        print()
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"items": args.items, "bytes": args.bytes, "medians": med}, f, indent=1)


if __name__ == "__main__":
    main()
