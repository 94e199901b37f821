"""GPU staging: D2H bandwidth of refdcp's stagers against a raw pinned copy, one run (issue 5).

Measured in the same process, alternating, median of ``--trials``:

* ``pinned copy``: ``dst.copy_(src, non_blocking=True)`` into preallocated
  pinned host memory, then ``torch.cuda.synchronize()``: the ceiling;
* ``refdcp CpuStager (cached, pinned)``: ``stage`` + release, steady state;
* ``refdcp CudaAsyncStager``: ``stage`` returns at once; the time until
  ``synchronize_staging`` returns, and how long the caller was blocked;
* ``torch DefaultStager`` (pinned, cached): torch's own, for the ratio.

Prints GB/s and the ratio to the pinned copy. Without CUDA it says so and
measures nothing.

Run: ``python -m benchmarks.bench_gpu_staging [--gib 1] [--trials 5]``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch


def _median_seconds(fn: Callable[[], float], trials: int) -> float:
    fn()  # warm: allocations, pinned registration, CUDA context
    return statistics.median(fn() for _ in range(trials))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--gib", type=float, default=1.0)
    p.add_argument("--trials", type=int, default=5)
    args = p.parse_args(argv or [])
    if not torch.cuda.is_available():
        print("no CUDA device here: GPU staging benchmark skipped (run it on a GPU machine)")
        return
    from refdcp.staging import CpuStager, CudaAsyncStager

    n_tensors = 16
    per = int(args.gib * (1 << 30)) // 4 // n_tensors
    src = {f"t{i}": torch.randn(per, device="cuda") for i in range(n_tensors)}
    nbytes = sum(t.numel() * 4 for t in src.values())
    torch.cuda.synchronize()

    pinned = {k: torch.empty(v.shape, dtype=v.dtype, pin_memory=True) for k, v in src.items()}

    def raw() -> float:
        t0 = time.perf_counter()
        for k, v in src.items():
            pinned[k].copy_(v, non_blocking=True)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    cached = CpuStager(cache_staged_state_dict=True)

    def refdcp_cached() -> float:
        t0 = time.perf_counter()
        snap = cached.stage(src)
        dt = time.perf_counter() - t0
        cached.release(snap)
        return dt

    cuda = CudaAsyncStager()
    blocked: list[float] = []

    def refdcp_cuda() -> float:
        t0 = time.perf_counter()
        fut = cuda.stage(src)
        blocked.append(time.perf_counter() - t0)
        cuda.synchronize_staging()
        snap = fut.result()
        dt = time.perf_counter() - t0
        cuda.release(snap)
        return dt

    rows: list[tuple[str, float]] = []
    fns: list[tuple[str, Callable[[], float]]] = [
        ("pinned copy (ceiling)", raw),
        ("refdcp CpuStager cached+pinned", refdcp_cached),
        ("refdcp CudaAsyncStager", refdcp_cuda),
    ]
    try:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        stager = DefaultStager(
            StagingOptions(
                use_pinned_memory=True,
                use_shared_memory=False,
                use_async_staging=False,
                use_non_blocking_copy=True,
            )
        )

        def torch_default() -> float:
            t0 = time.perf_counter()
            out = stager.stage(src)
            if hasattr(out, "result"):
                out = out.result()
            return time.perf_counter() - t0

        fns.append(("torch DefaultStager pinned+cached", torch_default))
    except Exception as exc:  # torch without DefaultStager: report, measure the rest
        print(f"torch DefaultStager unavailable: {type(exc).__name__}: {exc}")
    # alternate implementations trial by trial
    times: dict[str, list[float]] = {name: [] for name, _ in fns}
    for _, fn in fns:
        fn()
    for _ in range(args.trials):
        for name, fn in fns:
            times[name].append(fn())
    for name, _ in fns:
        rows.append((name, statistics.median(times[name])))
    ceiling = rows[0][1]
    print(f"{nbytes / 2**30:.2f} GiB in {n_tensors} tensors, {args.trials} trials (median)")
    print(f"{'path':36} {'s':>8} {'GB/s':>8} {'vs pinned':>10}")
    for name, s in rows:
        print(f"{name:36} {s:8.4f} {nbytes / s / 1e9:8.2f} {ceiling / s:10.2f}")
    if blocked:
        print(
            f"CudaAsyncStager: caller blocked in stage() median {statistics.median(blocked):.4f} s"
        )
    cached.close()
    cuda.close()


if __name__ == "__main__":
    main()
