"""Async save: refdcp vs torch DCP in one run (spec/staging.md; issue 5).

For each configuration, in a fresh subprocess (so peak RSS is its own):
save a state dict of ``--gib`` GiB (float32 tensors of 64 MiB) ``1 + --steady``
times to a temporary directory; report the time the caller is blocked in
``async_save`` (first save, and the median of the steady-state saves, with
reused buffers where the configuration caches them), the time to commit, and
the process's peak RSS. Each save waits for the previous commit before it
starts, so the blocked time is staging only.

Run: ``python -m benchmarks.bench_async [--gib 1] [--steady 3] [--only NAME ...]``.
Nothing is asserted. "staged st" is when the source may change again (with
background staging it comes after the call returns). The targets (steady
blocked <= 0.06 s/GiB and <= 0.5x torch's default; peak RSS <= 2.1x the
state) are printed beside the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from typing import Any

CONFIGS = [
    "torch_thread_default",
    "torch_thread_defaultstager_shm",
    "torch_thread_defaultstager_async",
    "refdcp_thread_default",
    "refdcp_thread_fresh",
    "refdcp_thread_cached",
    "refdcp_thread_cached_bg",
    "refdcp_process_cached_shm",
]


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _current_rss_mib() -> float:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / (1 << 20)
    except OSError:  # not Linux: fall back to the high-water mark
        return _rss_mib()


def _make_state(gib: float) -> dict[str, Any]:
    import torch

    n_tensors = max(1, round(gib * 16))
    per = int(gib * (1 << 30)) // n_tensors // 4
    return {f"layer{i}.weight": torch.randn(per) for i in range(n_tensors)}


def _saver(name: str, root: str) -> tuple[Callable[[dict[str, Any], str], Any], Callable[[], None]]:
    """A function (state, checkpoint id) -> waitable, and a cleanup function."""
    import torch.distributed.checkpoint as dcp

    if name == "torch_thread_default":
        return (lambda sd, cid: dcp.async_save(sd, checkpoint_id=cid, no_dist=True)), lambda: None
    if name == "torch_thread_defaultstager_shm":
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        stager = DefaultStager(StagingOptions(False, True, False, False))

        def torch_cached(sd: dict[str, Any], cid: str) -> Any:
            return dcp.async_save(sd, checkpoint_id=cid, no_dist=True, async_stager=stager)

        return torch_cached, stager.close
    if name == "torch_thread_defaultstager_async":
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        bg = DefaultStager(StagingOptions(False, False, True, False))

        def torch_bg(sd: dict[str, Any], cid: str) -> Any:
            return dcp.async_save(sd, checkpoint_id=cid, no_dist=True, async_stager=bg)

        return torch_bg, bg.close

    from refdcp.asyncsave.save import InFlightLimiter, async_save
    from refdcp.staging import CpuStager

    limiter = InFlightLimiter(1)
    if name == "refdcp_thread_default":  # no stager: the cached default (ASYNC-30)
        return (
            lambda sd, cid: async_save(sd, checkpoint_id=cid, no_dist=True, limiter=limiter),
            lambda: None,
        )
    if name == "refdcp_thread_fresh":
        return (
            lambda sd, cid: async_save(
                sd, checkpoint_id=cid, no_dist=True, limiter=limiter, stager=CpuStager()
            ),
            lambda: None,
        )
    if name == "refdcp_thread_cached":
        cached = CpuStager(cache_staged_state_dict=True, pin_memory=False)
        return (
            lambda sd, cid: async_save(
                sd, checkpoint_id=cid, no_dist=True, stager=cached, limiter=limiter
            ),
            cached.close,
        )
    if name == "refdcp_thread_cached_bg":
        bgc = CpuStager(cache_staged_state_dict=True, pin_memory=False, background_copy=True)
        return (
            lambda sd, cid: async_save(
                sd, checkpoint_id=cid, no_dist=True, stager=bgc, limiter=limiter
            ),
            bgc.close,
        )
    if name == "refdcp_process_cached_shm":
        from refdcp.asyncsave.process_executor import shutdown_worker

        shm = CpuStager(cache_staged_state_dict=True, share_memory=True, pin_memory=False)

        def proc(sd: dict[str, Any], cid: str) -> Any:
            return async_save(
                sd, checkpoint_id=cid, no_dist=True, stager=shm, limiter=limiter, executor="process"
            )

        def close() -> None:
            shutdown_worker()
            shm.close()

        return proc, close
    raise ValueError(name)


def run_one(name: str, gib: float, steady: int, pause: float = 0.0) -> dict[str, Any]:
    """Measure one configuration in this process."""
    warnings.filterwarnings("ignore")
    import torch

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    base_rss = _current_rss_mib()  # resident now (torch loaded), not a high-water mark
    sd = _make_state(gib)
    state_mib = sum(t.numel() * t.element_size() for t in sd.values()) / (1 << 20)
    root = tempfile.mkdtemp(prefix=f"bench_async_{name}_")
    save, close = _saver(name, root)
    blocked: list[float] = []
    staged: list[float] = []
    commit: list[float] = []
    try:
        for i in range(1 + steady):
            if i and pause:  # "cold": memory freed this long ago comes back from the host slowly
                time.sleep(pause)
            for t in sd.values():
                t.add_(1.0)  # a training step between saves
            cid = os.path.join(root, f"c{i}")
            t0 = time.perf_counter()
            fut = save(sd, cid)
            t1 = time.perf_counter()
            staged_f, commit_f = _futures(fut)
            if staged_f is not None:
                staged_f.result()
            ts = time.perf_counter()
            commit_f.result()
            t2 = time.perf_counter()
            blocked.append(t1 - t0)
            staged.append(ts - t0)
            commit.append(t2 - t0)
            shutil.rmtree(cid, ignore_errors=True)
    finally:
        close()
        shutil.rmtree(root, ignore_errors=True)
    peak = _rss_mib()
    return {
        "name": name,
        "state_mib": state_mib,
        "blocked_first_s": blocked[0],
        "blocked_steady_s": statistics.median(blocked[1:]) if steady else blocked[0],
        "staged_steady_s": statistics.median(staged[1:]) if steady else staged[0],
        "commit_first_s": commit[0],
        "commit_steady_s": statistics.median(commit[1:]) if steady else commit[0],
        "peak_rss_mib": peak,
        "peak_rss_over_base_mib": peak - base_rss,
    }


def _futures(handle: Any) -> tuple[Any, Any]:
    """(staged future or None, committed future) of refdcp's handle or torch's response."""
    if hasattr(handle, "upload_completion"):  # torch's AsyncSaveResponse (async staging)
        return handle.staging_completion, handle.upload_completion
    if hasattr(handle, "committed"):  # refdcp's AsyncSaveHandle
        return handle.staged, handle.committed
    return None, handle  # torch's plain Future: staging happened inside the call


def _memcpy_gib_s(gib: float) -> float:
    import torch

    a = torch.empty(int(gib * (1 << 30)) // 4)
    b = torch.empty_like(a)
    b.copy_(a)
    t0 = time.perf_counter()
    b.copy_(a)
    return gib / (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--gib", type=float, default=1.0)
    p.add_argument("--sizes", type=float, nargs="*", default=None, help="several state sizes (GiB)")
    p.add_argument(
        "--pause",
        type=float,
        default=0.0,
        help="seconds between saves ('cold' memory: freed pages return from the host); 0 = warm",
    )
    p.add_argument(
        "--json",
        default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "async.json"),
        help="also write rows for benchmarks/plots.py here (benchmarks/plots.py draws from it; '' to skip)",
    )
    p.add_argument("--steady", type=int, default=3)
    p.add_argument("--only", nargs="*", default=None)
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    if args.one:
        print(json.dumps(run_one(args.one, args.gib, args.steady, args.pause)))
        return
    sizes = args.sizes or [args.gib]
    all_rows: list[dict[str, Any]] = []
    memcpy = 0.0
    for gib in sizes:
        args.gib = gib
        rows, memcpy = _run_size(args)
        all_rows += [
            {"config": r["name"], "gib": gib, "blocked_steady": r["blocked_steady_s"], **r}
            for r in rows
        ]
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(
                {"memcpy_gib_s": memcpy, "pause_s": args.pause, "rows": all_rows}, f, indent=1
            )


def _run_size(args: argparse.Namespace) -> tuple[list[dict[str, Any]], float]:
    """Every configuration at ``args.gib``; print the table; return its rows and memcpy GiB/s."""
    names = args.only or CONFIGS
    here = os.path.dirname(os.path.abspath(__file__))
    rows: list[dict[str, Any]] = []
    for name in names:
        cmd = [sys.executable, os.path.join(here, "bench_async.py"), "--one", name]
        cmd += ["--gib", str(args.gib), "--steady", str(args.steady), "--pause", str(args.pause)]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        if out.returncode != 0:
            print(f"{name}: FAILED\n{out.stderr[-2000:]}")
            continue
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    memcpy = _memcpy_gib_s(min(args.gib, 1.0))
    print(
        f"memcpy: {memcpy:.1f} GiB/s ({args.gib / memcpy:.3f} s for the state); state {args.gib} GiB; "
        f"{args.steady} steady-state saves after the first; pause {args.pause} s"
    )
    head = (
        "config",
        "blk first",
        "blk steady",
        "s/GiB",
        "staged st",
        "commit 1st",
        "commit st",
        "peak RSS",
        "RSS/state",
        "over base/state",
    )
    print("{:<32}{:>10}{:>11}{:>8}{:>10}{:>11}{:>10}{:>10}{:>10}{:>16}".format(*head))
    for r in rows:
        gib = r["state_mib"] / 1024
        print(
            f"{r['name']:<32}{r['blocked_first_s']:>10.3f}{r['blocked_steady_s']:>11.3f}"
            f"{r['blocked_steady_s'] / gib:>8.3f}{r['staged_steady_s']:>10.3f}"
            f"{r['commit_first_s']:>11.2f}"
            f"{r['commit_steady_s']:>10.2f}{r['peak_rss_mib']:>9.0f}M"
            f"{r['peak_rss_mib'] / r['state_mib']:>10.2f}"
            f"{r['peak_rss_over_base_mib'] / r['state_mib']:>16.2f}"
        )
    by = {r["name"]: r for r in rows}
    ref = by.get("torch_thread_default")
    mine_all = (
        "refdcp_thread_default",
        "refdcp_thread_cached",
        "refdcp_thread_cached_bg",
        "refdcp_process_cached_shm",
        "refdcp_thread_fresh",
    )
    for mine in mine_all:
        if ref and mine in by:
            ratio = by[mine]["blocked_steady_s"] / ref["blocked_steady_s"]
            vs_memcpy = by[mine]["blocked_steady_s"] / (args.gib / memcpy)
            print(
                f"{mine}: steady blocked = {ratio:.2f}x torch default (target <= 0.5x), "
                f"{vs_memcpy:.2f}x memcpy (target <= 1.5x)"
            )
    return rows, memcpy


if __name__ == "__main__":
    main()
