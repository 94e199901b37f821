"""Multi-rank and concurrency checks (CONF-16..19)."""

from __future__ import annotations

import io
import threading
from typing import Any

import torch

from conformance.checks.common import load_into, roundtrip, sample_sd, save_at
from conformance.registry import CheckFailed, Context, NotApplicable, spec
from conformance.truth import assert_same, finite_tensor


def _rank_sds(world: int) -> list[dict[str, Any]]:
    shared = finite_tensor((6, 3), torch.float64, torch.Generator().manual_seed(99))
    sds = []
    for r in range(world):
        sd = sample_sd(100 + r, 2 + r)
        sd = {f"rank{r}.{k}": v for k, v in sd.items()}
        sd["replicated"] = shared.clone()
        sds.append(sd)
    return sds


@spec(
    "CONF-16",
    title="a 4-rank save with one writer per rank loads back on every rank",
    needs=("shared_location",),
)
def multi_rank(ctx: Context) -> None:
    roundtrip(ctx, _rank_sds(4), "CONF-16")


@spec(
    "CONF-17",
    title="a multi-rank refdcp.save/load under FakeWorld round-trips",
    needs=("shared_location",),
)
def fake_world(ctx: Context) -> None:
    try:
        import refdcp
        from refdcp.comm import FakeWorld
    except ImportError as exc:
        raise NotApplicable(f"refdcp.comm.FakeWorld is not available: {exc}") from exc
    from conformance.checks.common import blank_dest
    from conformance.truth import clone_truth

    loc = ctx.location()
    sds = [{k: v for k, v in sd.items() if not isinstance(v, io.BytesIO)} for sd in _rank_sds(3)]
    everything: dict[str, Any] = {}
    for sd in sds:
        everything.update(clone_truth(sd))
    # refdcp.load rejects checkpoint keys missing from the destination, so every rank loads all.
    truths = [dict(everything) for _ in sds]
    backend = ctx.backend

    def save(comm: Any) -> None:
        w = backend.writer(loc, rank=comm.rank)
        refdcp.save(sds[comm.rank], storage_writer=w, checkpoint_id=loc, comm=comm)

    FakeWorld(3).run(save, timeout=120.0)
    dests = [blank_dest(t) for t in truths]

    def load(comm: Any) -> None:
        r = backend.reader(loc)
        refdcp.load(dests[comm.rank], storage_reader=r, checkpoint_id=loc, comm=comm)

    FakeWorld(3).run(load, timeout=120.0)
    for dest, truth in zip(dests, truths, strict=True):
        assert_same(dest, truth, "CONF-17")


@spec(
    "CONF-18",
    title="several readers load one checkpoint at the same time",
    needs=("concurrent_readers",),
)
def concurrent_readers(ctx: Context) -> None:
    loc = ctx.location()
    (truth,) = save_at(ctx, loc, [sample_sd(180, 6)])
    errors: list[BaseException] = []
    results: list[dict[str, Any]] = []
    lock = threading.Lock()
    start = threading.Barrier(4, timeout=30.0)

    def worker() -> None:
        try:
            start.wait()
            (dest,) = load_into(ctx, loc, [truth])
            with lock:
                results.append(dest)
        except BaseException as exc:  # reported below
            with lock:
                errors.append(exc)

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60.0)
    if any(t.is_alive() for t in threads):
        raise CheckFailed("CONF-18: a concurrent load did not finish within 60 s")
    if errors:
        raise CheckFailed(f"CONF-18: concurrent load failed: {errors[0]!r}")
    for dest in results:
        assert_same(dest, truth, "CONF-18")


@spec("CONF-19", title="a writer with thread_count=4 round-trips", needs=("thread_count",))
def thread_count(ctx: Context) -> None:
    gen = torch.Generator().manual_seed(19)
    sd: dict[str, Any] = {f"p{i}": finite_tensor((i + 1, 9), torch.float32, gen) for i in range(12)}
    sd.update(sample_sd(190))
    roundtrip(ctx, [sd], "CONF-19", thread_count=4)
