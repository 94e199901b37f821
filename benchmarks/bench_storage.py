"""refdcp's FileSystemWriter/Reader vs torch's, same workloads, one run (spec/storage.md).

Each trial runs in a fresh child process (forked from a server that has
imported torch) so peak RSS is per run.  Implementations alternate within a
workload; the page cache is warmed (files read once) before each load trial.
Reported per workload: median save and load seconds for both, the
torch/refdcp ratio, the storage-phase times (``write_data`` / ``read_data``
only), and extra peak RSS as a fraction of the state size: the peak resident
size during the call (``VmHWM``, reset just before it) minus the resident
size just before it.  Also measured in the same run: raw disk write bandwidth
with fsync and page-cache read bandwidth.  The last row is one uint8 tensor of
4 GiB + 16 KiB (zip64, FMT-20), ``--large-trials`` times, its save throughput
compared with a raw write+fsync of the same size measured alternately just before
and just after each save.  The 1 GiB workloads (``large``, ``1,000 x 1 MiB``) are
paired the same way; each load of them is paired, in the same process and
alternately just before or after it, with a raw page-cache ``readinto`` of the
checkpoint's own data files into page-aligned memory (tensors are page-aligned;
a ``bytearray``'s 16-byte offset makes the kernel's copy 2-3x slower on the
benchmark VM, so it would flatter the loads).
Each workload also prints the median CPU seconds of each call (user + system, all
threads of the trial's process) and their torch/refdcp ratio, which a loaded
machine's waits for a CPU do not change.

Run: ``.venv/bin/python -m benchmarks.bench_storage [--trials N] [--only NAME]``.

``--defaults-cost`` instead measures what refdcp's safe defaults cost: refdcp
with its defaults (replica digests, DEDUP-13; checksums checked on load,
LOAD-10) against refdcp with both opted out (``check_replicas=False``,
``verify=False``), alternating, same storage and driver; reported as the
defaults' extra time in % of the opted-out time (medians). A one-rank save is
the coordinator, which digests only items other ranks also hold (none), so the
digests a non-coordinator rank would compute for the same state (every plain
tensor) in its local plan are timed separately after each save and reported as
% of the save: what they cost when torch's ``dcp.save`` drives refdcp's planner
(DEDUP-13). Under refdcp's own driver they overlap the write (DEDUP-17); their
cost there is measured on two real ranks by ``benchmarks/bench_replica_check.py``.
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
#: One uint8 tensor past the 4 GiB zip64 boundary (FMT-20, FMT-21); ``--large-trials`` trials.
OVER_4GIB = "over 4 GiB: 1 x (4 GiB + 16 KiB) uint8"
OVER_4GIB_BYTES = (4 << 30) + (16 << 10)


def _state(count: int, nbytes: int, fill: bool) -> dict[str, Any]:
    import torch

    if nbytes == OVER_4GIB_BYTES:  # resident before the call: filled either way
        return {"t0": torch.full((nbytes,), 90 if fill else 0, dtype=torch.uint8)}
    n = nbytes // 4
    if fill:
        return {f"t{i}": torch.full((n,), float(i), dtype=torch.float32) for i in range(count)}
    return {f"t{i}": torch.zeros(n, dtype=torch.float32) for i in range(count)}


def _aligned(nbytes: int) -> memoryview:
    """``nbytes`` of page-aligned, already touched memory (as a large tensor's)."""
    import mmap

    buf = mmap.mmap(-1, max(nbytes, 1))
    view = memoryview(buf)
    for at in range(0, nbytes, 4096):
        view[at] = 1
    return view[:nbytes]


def _raw_read_files(path: str, view: memoryview) -> tuple[float, float]:
    """(wall, CPU) seconds to ``readinto`` every data file of ``path`` (page cache hot) into ``view``."""
    names = sorted(n for n in os.listdir(path) if n.endswith(".distcp"))
    c0 = time.process_time()
    t0 = time.perf_counter()
    pos = 0
    for name in names:
        with open(os.path.join(path, name), "rb", buffering=0) as f:
            while got := f.readinto(view[pos : pos + 64 * MiB]):
                pos += got
    return time.perf_counter() - t0, time.process_time() - c0


def _data_bytes(path: str) -> int:
    return sum(
        os.path.getsize(os.path.join(path, n)) for n in os.listdir(path) if n.endswith(".distcp")
    )


def _maxrss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _rss_now_and_reset_peak() -> int | None:
    """Resident size now, after resetting the kernel's peak (VmHWM); None where unsupported."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return None


def _peak_since_reset() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


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


def _trial(
    impl: str, op: str, path: str, count: int, nbytes: int, driver: str, raw_at: int, out: Any
) -> None:
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
    raw_s = raw_cpu = 0.0
    raw_view = _aligned(_data_bytes(path)) if op == "load" and raw_at else None
    if op == "load":
        for name in sorted(os.listdir(path)):  # warm the page cache
            with open(os.path.join(path, name), "rb") as f:
                while f.read(64 * MiB):
                    pass
        if raw_view is not None and raw_at < 0:  # the paired raw read, just before the load
            raw_s, raw_cpu = _raw_read_files(path, raw_view)
    base = _maxrss()
    now = _rss_now_and_reset_peak()  # extra peak = peak during the call - resident before it
    if op == "save":
        w = writer_cls(path, sync_files=True)
        w.write_data = _phase_timed(w.write_data, phase)
        c0, t0 = time.process_time(), time.perf_counter()
        save_fn(sd, storage_writer=w, no_dist=True)
    else:
        r = reader_cls(path)
        r.read_data = _phase_timed(r.read_data, phase)
        c0, t0 = time.process_time(), time.perf_counter()
        load_fn(sd, storage_reader=r, no_dist=True)
    elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
    extra = _maxrss() - base if now is None else _peak_since_reset() - now
    if raw_view is not None and raw_at > 0:  # the paired raw read, just after the load
        raw_s, raw_cpu = _raw_read_files(path, raw_view)
    if op == "load" and nbytes == OVER_4GIB_BYTES:
        v = sd["t0"]
        if not bool((v[:: 1 << 20] == 90).all()) or int(v[-1]) != 90:
            raise RuntimeError(f"{impl} load returned wrong data for the > 4 GiB tensor")
    elif op == "load":
        bad = [k for i, (k, v) in enumerate(sd.items()) if float(v[0]) != float(int(k[1:]))]
        if bad:
            raise RuntimeError(f"{impl} load returned wrong data for {bad[:3]}")
    if driver == "refdcp" and op == "save" and impl in DEFAULTS_IMPLS:
        phase[0] = plan_s[0]  # defaults-cost: the local plan (digests) instead of write_data
        if impl == "refdcp-defaults":
            # a one-rank save is the coordinator, which digests only items other ranks hold:
            # nothing here (DEDUP-13). A non-coordinator rank holding the same state digests
            # every plain tensor in its local plan: time that work too (in the raw slot)
            import gc

            from refdcp.planning.local_plan import replica_checksums, save_items

            items = save_items(sd)
            gc.disable()  # as in the planner, which plans with the collector paused (API-20)
            t0 = time.perf_counter()
            replica_checksums(sd, items)
            raw_s = time.perf_counter() - t0
            gc.enable()
    out.put((elapsed, phase[0], extra, raw_s, cpu, raw_cpu))


#: The two sides of ``--defaults-cost``: refdcp opted out of its safe defaults, and with them.
DEFAULTS_IMPLS = ("refdcp-optout", "refdcp-defaults")


def _run(ctx: Any, *args: Any) -> tuple[float, float, int, float, float, float]:
    q = ctx.Queue()
    p = ctx.Process(target=_trial, args=(*args, q))
    p.start()
    result = q.get(timeout=600)
    p.join(60)
    if p.exitcode != 0:
        raise RuntimeError(f"trial {args[:2]} exited with {p.exitcode}")
    return result  # type: ignore[no-any-return]


def _raw_trial(root: str, out: Any, nbytes: int = 1024 * MiB, read: bool = True) -> None:
    out.put(raw_bandwidth(root, nbytes, read))


def raw_bandwidth(root: str, nbytes: int = 1024 * MiB, read: bool = True) -> tuple[float, float]:
    """(disk write GiB/s with fsync, page-cache read GiB/s, or 0 when not ``read``) for one file."""
    buf = bytearray(os.urandom(64 * MiB))
    path = os.path.join(root, "raw.bin")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    t0 = time.perf_counter()
    for _ in range(nbytes // len(buf)):
        os.write(fd, buf)
    os.write(fd, buf[: nbytes % len(buf)])
    os.fsync(fd)
    os.close(fd)
    write_s = time.perf_counter() - t0
    if not read:
        os.unlink(path)
        return nbytes / (1 << 30) / write_s, 0.0
    view = _aligned(nbytes)
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


def _row(
    name: str,
    size: int,
    res: dict[tuple[str, str], list[tuple[float, float, int, float, float, float]]],
    impls: tuple[str, str] = ("torch", "refdcp"),
) -> None:
    for op in ("save", "load"):
        t = [statistics.median(r[0] for r in res[(i, op)]) for i in impls]
        ph = [statistics.median(r[1] for r in res[(i, op)]) for i in impls]
        if impls == DEFAULTS_IMPLS:
            cpu = [statistics.median(r[4] for r in res[(i, op)]) for i in impls]
            digest = statistics.median(r[3] for r in res[(impls[1], op)])
            extra = (
                f" {ph[0]:.3f} / {ph[1]:.3f} | {100 * (ph[1] - ph[0]) / t[0]:.1f}% (coordinator);"
                f" non-coordinator {digest:.3f} s = {100 * digest / t[0]:.1f}% |"
                if op == "save"
                else f" CPU {cpu[0]:.3f} / {cpu[1]:.3f} | CPU {100 * (cpu[1] / cpu[0] - 1):+.1f}% |"
            )
            print(
                f"| {name} | {op} | {t[0]:.3f} | {t[1]:.3f} | {100 * (t[1] / t[0] - 1):+.1f}% |"
                + extra,
                flush=True,
            )
            continue
        rss = [statistics.median(r[2] for r in res[(i, op)]) / size for i in impls]
        print(
            f"| {name} | {op} | {t[0]:.3f} | {t[1]:.3f} | {t[0] / t[1]:.2f}x | {ph[0]:.3f} |"
            f" {ph[1]:.3f} | {size / t[1] / (1 << 30):.2f} | {rss[0]:.3f} | {rss[1]:.3f} |",
            flush=True,
        )


def _cpu_line(
    name: str,
    res: dict[tuple[str, str], list[tuple[float, float, int, float, float, float]]],
    impls: tuple[str, str],
) -> None:
    """Median CPU seconds of the call (user + system, every thread of the trial's process)
    per implementation: a ratio that a loaded machine's waits for a CPU do not change."""
    parts = []
    for op in ("save", "load"):
        cpu = [statistics.median(r[4] for r in res[(i, op)]) for i in impls]
        parts.append(
            f"{op} {impls[0]} {cpu[0]:.3f} / {impls[1]} {cpu[1]:.3f} = {cpu[0] / cpu[1]:.2f}x"
        )
    print(f"  {name} CPU s (median): " + "; ".join(parts), flush=True)


def _loadavg(avg: tuple[float, float, float]) -> str:
    return " ".join(f"{x:.1f}" for x in avg)


def _stats(xs: list[float]) -> str:
    return f"median {statistics.median(xs):.2f} (min {min(xs):.2f}, max {max(xs):.2f})"


def _paired_lines(
    name: str,
    size: int,
    res: dict[tuple[str, str], list[tuple[float, float, int, float, float, float]]],
    paired: dict[str, list[float]],
    impls: tuple[str, str],
) -> None:
    """Per implementation: save GiB/s over a raw write+fsync of the same size paired with
    it, and the load over a raw page-cache readinto of the same files paired with it."""
    gib = size / (1 << 30)
    for impl in impls:
        saves = res[(impl, "save")] if impls != DEFAULTS_IMPLS else []  # its phase: the plan
        if saves:
            phase = [gib / r[1] / w for r, w in zip(saves, paired[impl])]
            whole = [gib / r[0] / w for r, w in zip(saves, paired[impl])]
            rates, raws = [gib / r[0] for r in saves], paired[impl]
            print(
                f"  {name} {impl} save vs raw write+fsync of {gib:.2f} GiB (paired per trial):"
                f" write_data {_stats(phase)}, whole save {_stats(whole)};"
                f" raw {', '.join(f'{w:.2f}' for w in raws)} GiB/s;"
                # the disk's rate is bimodal on the benchmark VM (a pair can straddle a mode
                # change), so also the capability each side reached: best against best
                f" best of {len(rates)}: save {max(rates):.2f} vs raw {max(raws):.2f} GiB/s"
                f" = {max(rates) / max(raws):.2f}; medians {statistics.median(rates):.2f}"
                f" vs {statistics.median(raws):.2f} = "
                f"{statistics.median(rates) / statistics.median(raws):.2f}",
                flush=True,
            )
        loads = [r for r in res[(impl, "load")] if r[3] > 0]
        if loads:
            print(
                f"  {name} {impl} load vs raw page-cache readinto of the same files (paired):"
                f" read_data {_stats([r[3] / r[1] for r in loads])},"
                f" whole load {_stats([r[3] / r[0] for r in loads])},"
                f" whole load CPU time {_stats([r[5] / r[4] for r in loads])};"
                f" raw {', '.join(f'{gib / r[3]:.1f}' for r in loads)} GiB/s",
                flush=True,
            )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--only", default=None, help="run only workloads whose name contains this")
    parser.add_argument("--dir", default=None, help="directory on the disk to measure")
    parser.add_argument(
        "--large-trials",
        type=int,
        default=1,
        help="trials of the > 4 GiB row (0 skips it; it needs about 9 GiB of free memory)",
    )
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
    impls = DEFAULTS_IMPLS if args.defaults_cost else ("torch", "refdcp")
    if args.defaults_cost:
        args.driver = "refdcp"
    ctx = mp.get_context("forkserver")
    # every module a timed call would otherwise import lazily (once per process: the trials run
    # in fresh processes, and without bytecode caching an import compiles its module, ~5 ms)
    ctx.set_forkserver_preload(
        [
            "torch",
            "torch.distributed.checkpoint",
            "numpy.ma",  # numpy.unique's lazy import (global plan): 11 ms the first time
            "refdcp",
            "refdcp.storage",
            "refdcp.storage.metadata.bulk",
            "refdcp.storage.metadata.shape",
        ]
    )
    root = tempfile.mkdtemp(prefix="bench_storage_", dir=args.dir)
    try:
        raws: list[tuple[float, float]] = []

        def raw(nbytes: int = 1024 * MiB, read: bool = True) -> tuple[float, float]:
            q = ctx.Queue()
            p = ctx.Process(target=_raw_trial, args=(root, q, nbytes, read))
            p.start()
            got: tuple[float, float] = q.get(timeout=600)
            p.join(60)
            return got

        def trials(name: str, count: int, nbytes: int, n: int) -> None:
            res: dict[tuple[str, str], list[tuple[float, float, int, float, float, float]]] = {}
            # the >= 1 GiB saves are paired with a raw write+fsync of the same size,
            # alternately just before and just after them (the disk is shared and noisy);
            # their loads with a raw page-cache readinto of the same files (in _trial)
            pair = count * nbytes >= 1000 * MiB
            paired: dict[str, list[float]] = {}
            load_before = os.getloadavg()
            for trial in range(n):
                order = list(impls) if trial % 2 == 0 else list(reversed(impls))
                # the disk and page cache, measured between the trials they bound
                raws.append(raw())
                for impl in order:
                    path = os.path.join(root, f"{impl}")
                    shutil.rmtree(path, ignore_errors=True)
                    if pair and trial % 2 == 0:
                        paired.setdefault(impl, []).append(raw(count * nbytes, read=False)[0])
                    res.setdefault((impl, "save"), []).append(
                        _run(ctx, impl, "save", path, count, nbytes, args.driver, 0)
                    )
                    if pair and trial % 2 == 1:
                        paired.setdefault(impl, []).append(raw(count * nbytes, read=False)[0])
                    # not for > 4 GiB: the raw read's own buffer would double its memory
                    raw_at = (1 if trial % 2 == 0 else -1) if pair and nbytes < 2 << 30 else 0
                    res.setdefault((impl, "load"), []).append(
                        _run(ctx, impl, "load", path, count, nbytes, args.driver, raw_at)
                    )
                    shutil.rmtree(path, ignore_errors=True)
            _row(name, count * nbytes, res, impls)
            if impls != DEFAULTS_IMPLS:
                _cpu_line(name, res, impls)
            if pair:
                _paired_lines(name, count * nbytes, res, paired, impls)
            print(
                f"  load average before / after: {_loadavg(load_before)} / {_loadavg(os.getloadavg())}"
            )

        raws.append(raw())
        print(f"driver: {args.driver}.save/load; sync_files=True; {args.trials} trial(s) per cell")
        if args.defaults_cost:
            print(
                "| workload | op | opted-out s | defaults s | defaults' cost |"
                " local plan s (opted-out / defaults); load: CPU s | digest cost, % of save;"
                " load: CPU cost |"
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
            trials(name, count, nbytes, args.trials)
        if (
            not args.defaults_cost
            and args.large_trials > 0
            and (not args.only or args.only in OVER_4GIB)
        ):
            trials(OVER_4GIB, 1, OVER_4GIB_BYTES, args.large_trials)
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
