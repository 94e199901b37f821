"""Protocol checks: reset, set-up arguments, coordinator-only steps, plans, results (CONF-1..9)."""

from __future__ import annotations

import pickle
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan
from torch.futures import Future

from conformance.checks.common import (
    blank_dest,
    committed,
    load_error,
    rank_sd,
    roundtrip,
    sample_sd,
    world,
)
from conformance.drive import SaveTrace, load_ranks, save_ranks
from conformance.registry import CheckFailed, Context, backend_error, describe, spec
from conformance.truth import assert_same, clone_truth


@spec("CONF-1", title="reset(checkpoint_id) retargets a writer and a reader")
def reset_with_id(ctx: Context) -> None:
    built_for, first, second = ctx.location(), ctx.location(), ctx.location()
    saved: list[tuple[str, Any, dict[str, Any]]] = []
    for name, loc, seed in (("first", first, 1), ("second", second, 101)):
        sd = sample_sd(seed, 2 if name == "first" else 3)
        saved.append((name, loc, clone_truth(sd)))
        # A writer built for another location, retargeted by reset(checkpoint_id).
        save_ranks([ctx.backend.writer(built_for, rank=0)], [sd], checkpoint_id=loc)
    for name, loc, truth in saved:
        seen = load_error(ctx, loc)
        if seen is not None:
            raise CheckFailed(
                f"CONF-1: after a save through a writer built for another location and reset to "
                f"the {name} location, a reader for that location raised {describe(seen)}"
            )
        dest = blank_dest(truth)
        try:
            load_ranks([ctx.backend.reader(built_for)], [dest], checkpoint_id=loc)
        except BaseException as exc:
            if not backend_error(exc):
                raise
            raise CheckFailed(
                f"CONF-1: a load through a reader built for another location and reset to the "
                f"{name} location raised {describe(exc)}"
            ) from exc
        try:
            assert_same(dest, truth, "CONF-1")
        except CheckFailed as exc:
            raise CheckFailed(
                f"{exc} (read through a reader built for another location and reset to the "
                f"{name} location)"
            ) from exc
    if committed(ctx, built_for):
        raise CheckFailed(
            "CONF-1: the location the writers were built for is loadable although every save "
            "was reset to another location"
        )


@spec("CONF-2", title="reset() with no id keeps the location given at construction")
def reset_without_id(ctx: Context) -> None:
    loc = ctx.location()
    sd = sample_sd(2)
    truth = clone_truth(sd)
    save_ranks([ctx.backend.writer(loc, rank=0)], [sd], checkpoint_id=None)
    dest = blank_dest(truth)
    load_ranks([ctx.backend.reader(loc)], [dest], checkpoint_id=None)
    assert_same(dest, truth, "CONF-2")


@spec("CONF-3", title="set_up_storage_writer/reader accept torch 2.13's arguments")
def set_up_arguments(ctx: Context) -> None:
    loc = ctx.location()
    ranks = world(ctx)  # two ranks in one location only with shared_location (CONF-55)
    rank = ranks - 1
    writer = ctx.backend.writer(loc, rank=rank)
    writer.reset(loc)
    try:
        writer.set_up_storage_writer(rank == 0, rank=rank, use_collectives=True)
    except TypeError as exc:
        # Only a signature without **kwargs may refuse keywords; torch then passes none.
        import inspect

        if "kwargs" in inspect.signature(writer.set_up_storage_writer).parameters:
            raise CheckFailed(f"CONF-3: set_up_storage_writer(**kwargs) refused: {exc}") from exc
        writer.set_up_storage_writer(rank == 0)
    roundtrip(ctx, [rank_sd(r, 3 + r) for r in range(ranks)], "CONF-3")


@spec("CONF-4", title="only the coordinator receives prepare_global_plan and finish")
def coordinator_only(ctx: Context) -> None:
    if not ctx.backend.capabilities.shared_location:
        roundtrip(ctx, [sample_sd(5)], "CONF-4")
        return
    roundtrip(ctx, [rank_sd(0, 5), rank_sd(1, 6, 2), rank_sd(2, 7, 1)], "CONF-4")


def _items(plan: SavePlan | LoadPlan) -> list[Any]:
    return sorted(repr(i) for i in plan.items)


def _save_trace(ctx: Context, n: int) -> SaveTrace:
    loc = ctx.location()
    tr = SaveTrace()
    sds = [rank_sd(r, 10 + r) for r in range(n)]
    save_ranks(
        [ctx.backend.writer(loc, rank=r) for r in range(n)], sds, checkpoint_id=loc, trace=tr
    )
    return tr


@spec("CONF-5", title="prepare_local_plan keeps every write item unchanged")
def local_plan_keeps_items(ctx: Context) -> None:
    tr = _save_trace(ctx, world(ctx))
    for rank, (before, after) in enumerate(zip(tr.local_in, tr.local_out, strict=True)):
        if not isinstance(after, SavePlan):
            raise CheckFailed(f"CONF-5: rank {rank} prepare_local_plan returned {type(after)}")
        if _items(before) != _items(after):
            raise CheckFailed(f"CONF-5: rank {rank} prepare_local_plan changed the write items")


@spec("CONF-6", title="prepare_global_plan returns one plan per rank, keeping every item")
def global_plan_keeps_items(ctx: Context) -> None:
    tr = _save_trace(ctx, world(ctx))
    if len(tr.global_out) != len(tr.global_in):
        raise CheckFailed(
            f"CONF-6: prepare_global_plan returned {len(tr.global_out)} plans "
            f"for {len(tr.global_in)} ranks"
        )
    for rank, (before, after) in enumerate(zip(tr.global_in, tr.global_out, strict=True)):
        if _items(before) != _items(after):
            raise CheckFailed(f"CONF-6: prepare_global_plan changed rank {rank}'s write items")


@spec("CONF-7", title="the reader's prepare_local_plan/prepare_global_plan keep every read item")
def load_plans_keep_items(ctx: Context) -> None:
    loc = ctx.location()
    n = world(ctx)
    sds = [rank_sd(r, 20 + r) for r in range(n)]
    truths = [clone_truth(sd) for sd in sds]
    save_ranks([ctx.backend.writer(loc, rank=r) for r in range(n)], sds, checkpoint_id=loc)
    seen: list[tuple[list[LoadPlan], list[LoadPlan]]] = []
    dests = [blank_dest(t) for t in truths]
    load_ranks(
        [ctx.backend.reader(loc) for _ in range(n)], dests, checkpoint_id=loc, plans_seen=seen
    )
    for stage, (before, after) in zip(("local", "global"), seen, strict=True):
        if len(before) != len(after):
            raise CheckFailed(f"CONF-7: {stage} plan count changed {len(before)}->{len(after)}")
        for rank, (b, a) in enumerate(zip(before, after, strict=True)):
            if _items(b) != _items(a):
                raise CheckFailed(f"CONF-7: prepare_{stage}_plan changed rank {rank}'s read items")


@spec("CONF-8", title="write_data's future covers every write item exactly once")
def write_results_cover_items(ctx: Context) -> None:
    tr = _save_trace(ctx, world(ctx))
    for rank, (plan, fut, results) in enumerate(
        zip(tr.final_plans, tr.futures, tr.results, strict=True)
    ):
        if not isinstance(fut, Future):
            raise CheckFailed(f"CONF-8: rank {rank} write_data returned {type(fut).__name__}")
        want = sorted(repr(i.index) for i in plan.items)
        got = sorted(repr(r.index) for r in results)
        if want != got:
            lost = sorted(set(want) - set(got))
            extra = sorted(set(got) - set(want))
            dup = len(got) - len(set(got))
            raise CheckFailed(
                f"CONF-8: rank {rank} results do not match its items: missing {lost[:3]}, "
                f"unexpected {extra[:3]}, {dup} duplicate(s)"
            )


@spec("CONF-9", title="storage_data survives pickling inside Metadata and read_metadata returns it")
def storage_data_roundtrip(ctx: Context) -> None:
    loc = ctx.location()
    tr = SaveTrace()
    sd = sample_sd(30)
    save_ranks([ctx.backend.writer(loc, rank=0)], [sd], checkpoint_id=loc, trace=tr)
    for result in tr.results[0]:
        try:
            pickle.loads(pickle.dumps(result))
        except Exception as exc:
            raise CheckFailed(
                f"CONF-9: WriteResult for {result.index} does not pickle: {exc}"
            ) from exc
    reader = ctx.backend.reader(loc)
    reader.reset(loc)
    md = reader.read_metadata()
    if not isinstance(md, Metadata):
        raise CheckFailed(f"CONF-9: read_metadata returned {type(md).__name__}")
    if set(md.state_dict_metadata) != set(sd):
        raise CheckFailed(f"CONF-9: metadata keys {sorted(md.state_dict_metadata)} != saved")
    stored = md.storage_data
    if not isinstance(stored, dict):
        raise CheckFailed("CONF-9: read_metadata's storage_data is not a dict keyed by index")
    missing = [r.index for r in tr.results[0] if r.index not in stored]
    if missing:
        raise CheckFailed(f"CONF-9: storage_data lacks {missing[:3]}")
    md2 = pickle.loads(pickle.dumps(md))
    if set(md2.storage_data) != set(stored):
        raise CheckFailed("CONF-9: storage_data keys change through pickling")
