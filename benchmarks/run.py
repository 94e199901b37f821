"""``make bench``: every benchmark, refdcp beside torch DCP in one run, reported as ratios.

``python -m benchmarks.run [planning] [storage] [async] [convert] [-- OPTIONS]`` runs the
named ones (all by default); options after ``--`` go to each benchmark's own
parser (e.g. ``-- --trials 5``). Each module's ``main()`` prints its own table. Timings are
never asserted: they are measurements to read, not tests.
"""

from __future__ import annotations

import importlib
import sys
import time

SUITES = {
    "planning": "benchmarks.bench_planning",
    "phases": "benchmarks.bench_phases",
    "storage": "benchmarks.bench_storage",
    "save-vs-raw": "benchmarks.bench_save_vs_raw",
    "async": "benchmarks.bench_async",
    "multirank": "benchmarks.bench_multirank",
    "read-once": "benchmarks.bench_read_once",
    "replica-check": "benchmarks.bench_replica_check",
    "scale": "benchmarks.bench_scale",
    "gpu": "benchmarks.bench_gpu_staging",
    "convert": "benchmarks.bench_convert",
}


def main(argv: list[str]) -> int:
    extra: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1 :]
    names = argv or list(SUITES)
    unknown = [n for n in names if n not in SUITES]
    if unknown:
        print(f"unknown benchmark(s) {unknown}; choose from {list(SUITES)}", file=sys.stderr)
        return 2
    for name in names:
        print(f"\n=== {name} ===", flush=True)
        t0 = time.perf_counter()
        module = importlib.import_module(SUITES[name])
        module.main(extra)
        print(f"[{name}: {time.perf_counter() - t0:.0f} s]", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
