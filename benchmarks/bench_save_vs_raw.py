"""refdcp's save of one large tensor against raw write+fsync, in ONE process, alternating.

``bench_storage`` pairs each save with a raw write+fsync run in another process
just before or after it; on the benchmark VM the disk's rate is bimodal (about
2 GiB/s or about 0.4 GiB/s, switching between neighbouring measurements), so those
pairs are noisy. Here the three writers run in one process, in alternating order,
on the same tensor memory:

* ``raw buffer``: a reused 64 MiB buffer written until the size is reached (the
  baseline ``bench_storage`` uses), then fsync;
* ``raw tensor``: the tensor's own memory written in 4 MiB pieces, then fsync;
* ``refdcp``: ``refdcp.save`` with ``FileSystemWriter(sync_files=True)``: framing,
  CRC-32C of every piece (STORE-51), ``.metadata``, renames and directory fsyncs.

Reported: GiB/s per writer, median and best, and refdcp's ratio to each raw writer.

Run: ``.venv/bin/python -m benchmarks.bench_save_vs_raw [--gib 4] [--runs 4] [--dir DIR]``,
or ``make bench BENCH=save-vs-raw`` (part of ``make bench``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
import warnings

MiB = 1 << 20


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=4.0, help="tensor size in GiB (+ 16 KiB)")
    parser.add_argument("--runs", type=int, default=4, help="runs of each writer")
    parser.add_argument("--dir", default=None, help="directory on the disk to measure")
    args, _ = parser.parse_known_args(argv)  # make bench passes every suite the same options
    warnings.filterwarnings("ignore")
    import numpy.ma  # noqa: F401  (imported lazily by the save's global plan: not I/O)
    import torch

    import refdcp
    from benchmarks.bench_storage import raw_bandwidth
    from refdcp.storage.fs.filesystem import FileSystemWriter

    torch.set_num_threads(1)
    nbytes = int(args.gib * (1 << 30)) + (16 << 10)
    state = {"t0": torch.full((nbytes,), 90, dtype=torch.uint8)}
    data = memoryview(state["t0"].numpy()).cast("B")
    root = tempfile.mkdtemp(prefix="bench_save_vs_raw_", dir=args.dir)

    def raw_buffer() -> float:  # bench_storage's baseline, the same function
        return nbytes / (1 << 30) / raw_bandwidth(root, nbytes, read=False)[0]

    def raw_tensor() -> float:
        path = os.path.join(root, "rawt.bin")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        t0 = time.perf_counter()
        for at in range(0, nbytes, 4 * MiB):
            os.write(fd, data[at : at + 4 * MiB])
        os.fsync(fd)
        os.close(fd)
        seconds = time.perf_counter() - t0
        os.unlink(path)
        return seconds

    def save() -> float:
        path = os.path.join(root, "ckpt")
        writer = FileSystemWriter(path, sync_files=True)
        t0 = time.perf_counter()
        refdcp.save(state, storage_writer=writer, no_dist=True)
        seconds = time.perf_counter() - t0
        shutil.rmtree(path)
        return seconds

    writers = {"raw buffer": raw_buffer, "raw tensor": raw_tensor, "refdcp": save}
    rates: dict[str, list[float]] = {name: [] for name in writers}
    gib = nbytes / (1 << 30)
    load_before = os.getloadavg()
    try:
        for run in range(args.runs):
            order = list(writers) if run % 2 == 0 else list(reversed(writers))
            for name in order:
                rates[name].append(gib / writers[name]())
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(
        f"one {gib:.2f} GiB uint8 tensor, {args.runs} run(s) per writer, one process, alternating"
    )
    for name, rs in rates.items():
        print(
            f"  {name:10s} GiB/s median {statistics.median(rs):.2f}, best {max(rs):.2f}"
            f" (all: {', '.join(f'{r:.2f}' for r in rs)})"
        )
    ref = rates["refdcp"]
    for name in ("raw buffer", "raw tensor"):
        print(
            f"  refdcp / {name}: medians {statistics.median(ref) / statistics.median(rates[name]):.2f},"
            f" best {max(ref) / max(rates[name]):.2f}"
        )
    after = os.getloadavg()
    print(
        f"  load average before / after: {' '.join(f'{x:.1f}' for x in load_before)}"
        f" / {' '.join(f'{x:.1f}' for x in after)}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
