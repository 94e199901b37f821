"""refdcp's FileSystemWriter/Reader vs torch's, same workloads, one run (spec/storage.md).

Each trial runs in a fresh child process (forked from a server that has
imported torch) so peak RSS is per run.  Implementations alternate within a
workload; the page cache is warmed (files read once) before each load trial.
Reported per workload: median save and load seconds for both, the
torch/refdcp ratio, the storage-phase times (``write_data`` / ``read_data``
only), and extra peak RSS as a fraction of the state size.  Also measured in
the same run: raw disk write bandwidth with fsync and page-cache read
bandwidth.

Run: ``.venv/bin/python -m benchmarks.bench_storage [--trials N] [--only NAME]``.

``--defaults-cost`` instead measures what refdcp's safe defaults cost: refdcp
with its defaults (replica digests, DEDUP-13; checksums checked on load,
LOAD-10) against refdcp with both opted out (``check_replicas=False``,
``verify=False``), alternating, same storage and driver; reported as the
defaults' extra time in % of the opted-out time (medians).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import resource
import shutil
import statistics
import tempfile
import time
import warnings
from typing import Any

MiB = 1 << 20
WORKLOADS: dict[str, tuple[int, int]] = {  # name -> (count, bytes each)
    "large 4 x 256 MiB": (4, 256 * MiB),
    "1,000 x 1 MiB": (1000, MiB),
    "20,000 x 4 KiB": (20_000, 4096),
}


def _state(count: int, nbytes: int, fill: bool) -> dict[str, Any]:
    import torch

    n = nbytes // 4
    if fill:
        return {f"t{i}": torch.full((n,), float(i), dtype=torch.float32) for i in range(count)}
    return {f"t{i}": torch.zeros(n, dtype=torch.float32) for i in range(count)}


def _maxrss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _classes(impl: str) -> tuple[Any, Any]:
    import torch.distributed.checkpoint as dcp

    if impl == "torch":
        return dcp.FileSystemWriter, dcp.FileSystemReader
    from refdcp.storage import FileSystemReader, FileSystemWriter

    return FileSystemWriter, FileSystemReader


def _phase_timed(inner: Any, phase: list[float]) -> Any:
    """Wrap write_data/read_data so ``phase[0]`` accumulates the storage phase alone."""

    def timed(*a: Any) -> Any:
        t = time.perf_counter()
        fut = inner(*a)
        fut.wait()
        phase[0] += time.perf_counter() - t
        return fut

    return timed


def _trial(impl: str, op: str, path: str, count: int, nbytes: int, driver: str, out: Any) -> None:
    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed.checkpoint as dcp

    torch.set_num_threads(1)
    writer_cls, reader_cls = _classes(impl)
    if driver == "refdcp":
        import functools

        import refdcp

        save_fn: Any = refdcp.save
        load_fn: Any = refdcp.load
        from refdcp.planning.save_planner import DefaultSavePlanner

        plan_s = [0.0]
        real_local_plan = DefaultSavePlanner.create_local_plan

        def timed_local_plan(self: Any) -> Any:
            t = time.perf_counter()
            try:
                return real_local_plan(self)
            finally:
                plan_s[0] += time.perf_counter() - t

        DefaultSavePlanner.create_local_plan = timed_local_plan  # type: ignore[method-assign]
        if impl == "refdcp-optout":
            planner = refdcp.DefaultSavePlanner(check_replicas=False)
            save_fn = functools.partial(refdcp.save, planner=planner)
            load_fn = functools.partial(refdcp.load, verify=False)
    else:
        save_fn, load_fn = dcp.save, dcp.load
    phase = [0.0]
    sd = _state(count, nbytes, fill=(op == "save"))
    if op == "load":
        for name in sorted(os.listdir(path)):  # warm the page cache
            with open(os.path.join(path, name), "rb") as f:
                while f.read(64 * MiB):
                    pass
    base = _maxrss()
    if op == "save":
        w = writer_cls(path, sync_files=True)
        w.write_data = _phase_timed(w.write_data, phase)
        t0 = time.perf_counter()
        save_fn(sd, storage_writer=w, no_dist=True)
    else:
        r = reader_cls(path)
        r.read_data = _phase_timed(r.read_data, phase)
        t0 = time.perf_counter()
        load_fn(sd, storage_reader=r, no_dist=True)
    elapsed = time.perf_counter() - t0
    if op == "load":
        bad = [k for i, (k, v) in enumerate(sd.items()) if float(v[0]) != float(int(k[1:]))]
        if bad:
            raise RuntimeError(f"{impl} load returned wrong data for {bad[:3]}")
    if driver == "refdcp" and op == "save":
        phase[0] = plan_s[0]  # the local plan (replica digests included) instead of write_data
    out.put((elapsed, phase[0], _maxrss() - base))


def _run(ctx: Any, *args: Any) -> tuple[float, float, int]:
    q = ctx.Queue()
    p = ctx.Process(target=_trial, args=(*args, q))
    p.start()
    result = q.get(timeout=600)
    p.join(60)
    if p.exitcode != 0:
        raise RuntimeError(f"trial {args[:2]} exited with {p.exitcode}")
    return result  # type: ignore[no-any-return]


def _raw_trial(root: str, out: Any) -> None:
    out.put(raw_bandwidth(root))


def raw_bandwidth(root: str, nbytes: int = 1024 * MiB) -> tuple[float, float]:
    """(disk write GiB/s with fsync, page-cache read GiB/s) for one file of ``nbytes``."""
    buf = bytearray(os.urandom(64 * MiB))
    path = os.path.join(root, "raw.bin")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    t0 = time.perf_counter()
    for _ in range(nbytes // len(buf)):
        os.write(fd, buf)
    os.fsync(fd)
    os.close(fd)
    write_s = time.perf_counter() - t0
    dest = bytearray(nbytes)
    view = memoryview(dest)
    with open(path, "rb", buffering=0) as f:
        f.readinto(view)  # warm
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        got = 0
        while got < nbytes:
            got += f.readinto(view[got:]) or 0
    read_s = time.perf_counter() - t0
    os.unlink(path)
    gib = nbytes / (1 << 30)
    return gib / write_s, gib / read_s


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--only", default=None, help="run only workloads whose name contains this")
    parser.add_argument("--dir", default=None, help="directory on the disk to measure")
    parser.add_argument(
        "--driver",
        choices=["torch", "refdcp"],
        default="torch",
        help="save/load entry points (and default planners) driving both storages",
    )
    parser.add_argument(
        "--defaults-cost",
        action="store_true",
        help="refdcp's defaults vs refdcp with check_replicas=False, verify=False",
    )
    args = parser.parse_args(argv)
    impls = ("refdcp-optout", "refdcp") if args.defaults_cost else ("torch", "refdcp")
    if args.defaults_cost:
        args.driver = "refdcp"
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed.checkpoint", "refdcp.storage"])
    root = tempfile.mkdtemp(prefix="bench_storage_", dir=args.dir)
    try:
        raws: list[tuple[float, float]] = []

        def raw() -> None:
            q = ctx.Queue()
            p = ctx.Process(target=_raw_trial, args=(root, q))
            p.start()
            raws.append(q.get(timeout=600))
            p.join(60)

        raw()
        print(f"driver: {args.driver}.save/load; sync_files=True; {args.trials} trial(s) per cell")
        if args.defaults_cost:
            print(
                "| workload | op | opted-out s | defaults s | defaults' cost |"
                " local plan s (opted-out / defaults) | digest cost, % of save |"
            )
            print("|---|---|---|---|---|---|---|")
        else:
            print(
                "| workload | op | torch s | refdcp s | speed-up | torch phase s | refdcp phase s |"
                " refdcp GiB/s | torch extra RSS | refdcp extra RSS |"
            )
            print("|---|---|---|---|---|---|---|---|---|---|")
        for name, (count, nbytes) in WORKLOADS.items():
            if args.only and args.only not in name:
                continue
            size = count * nbytes
            res: dict[tuple[str, str], list[tuple[float, float, int]]] = {}
            for trial in range(args.trials):
                order = list(impls) if trial % 2 == 0 else list(reversed(impls))
                raw()  # the disk and page cache, measured between the trials they bound
                for impl in order:
                    path = os.path.join(root, f"{impl}")
                    shutil.rmtree(path, ignore_errors=True)
                    res.setdefault((impl, "save"), []).append(
                        _run(ctx, impl, "save", path, count, nbytes, args.driver)
                    )
                    res.setdefault((impl, "load"), []).append(
                        _run(ctx, impl, "load", path, count, nbytes, args.driver)
                    )
                    shutil.rmtree(path, ignore_errors=True)
            for op in ("save", "load"):
                t = [statistics.median(r[0] for r in res[(i, op)]) for i in impls]
                if args.defaults_cost:
                    ph = [statistics.median(r[1] for r in res[(i, op)]) for i in impls]
                    extra = (
                        f" {ph[0]:.3f} / {ph[1]:.3f} | {100 * (ph[1] - ph[0]) / t[0]:.1f}% |"
                        if op == "save"
                        else " | |"
                    )
                    print(
                        f"| {name} | {op} | {t[0]:.3f} | {t[1]:.3f} |"
                        f" {100 * (t[1] / t[0] - 1):+.1f}% |" + extra
                    )
                    continue
                ph = [statistics.median(r[1] for r in res[(i, op)]) for i in impls]
                rss = [statistics.median(r[2] for r in res[(i, op)]) / size for i in impls]
                print(
                    f"| {name} | {op} | {t[0]:.3f} | {t[1]:.3f} | {t[0] / t[1]:.2f}x | {ph[0]:.3f} |"
                    f" {ph[1]:.3f} | {size / t[1] / (1 << 30):.2f} | {rss[0]:.3f} | {rss[1]:.3f} |"
                )
        w = statistics.median(r[0] for r in raws)
        rd = statistics.median(r[1] for r in raws)
        print(
            f"\nraw disk write with fsync: median {w:.2f} GiB/s (min {min(r[0] for r in raws):.2f},"
            f" max {max(r[0] for r in raws):.2f}); page-cache read: median {rd:.2f} GiB/s"
            f" ({len(raws)} measurements interleaved with the trials)"
        )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
