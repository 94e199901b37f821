"""Failure checks: no metadata, commit point, injected faults, overwrite, stale data, reuse
(CONF-20..27, CONF-29, CONF-47)."""

from __future__ import annotations

from typing import Any

import torch

from conformance.checks.common import (
    baseline_save,
    committed,
    load_all,
    load_error,
    load_into,
    rank_sd,
    read_metadata,
    sample_sd,
    save_at,
    try_save,
    world,
)
from conformance.drive import SAVE_STEPS, Fault, InjectedFault, save_ranks
from conformance.registry import CheckFailed, Context, NotApplicable, backend_error, describe, spec
from conformance.truth import assert_same, clone_truth, finite_tensor


@spec("CONF-20", title="a location without a committed checkpoint is not loadable")
def empty_location(ctx: Context) -> None:
    loc = ctx.location()
    if committed(ctx, loc):
        raise CheckFailed("CONF-20: read_metadata succeeded on a fresh, empty location")


@spec("CONF-21", title="nothing is loadable before the coordinator's finish returns")
def no_commit_before_finish(ctx: Context) -> None:
    loc = ctx.location()
    n = world(ctx)
    seen: list[bool] = []
    writers = [ctx.backend.writer(loc, rank=r) for r in range(n)]
    sds = [rank_sd(r, 210 + r) for r in range(n)]
    save_ranks(
        writers, sds, checkpoint_id=loc, before_finish=lambda: seen.append(committed(ctx, loc))
    )
    if seen != [False]:
        raise CheckFailed("CONF-21: the checkpoint was loadable after write_data, before finish")
    err = load_error(ctx, loc)
    if err is not None:
        raise CheckFailed(
            f"CONF-21: after finish returned, read_metadata at the location raised {describe(err)}"
        )


def _run_fault(ctx: Context, loc: Any, fault: Fault | None, seed: int) -> BaseException | None:
    return try_save(ctx, loc, [rank_sd(r, seed + r) for r in range(world(ctx))], fault)


def _faults(ctx: Context) -> list[Fault]:
    n = world(ctx)
    out: list[Fault] = []
    for step in SAVE_STEPS:
        ranks = [0] if step in ("prepare_global_plan", "finish", "finish:inside") else range(n)
        out.extend(Fault(step, r) for r in ranks)
    return out


@spec("CONF-22", title="an exception inside write_data surfaces, never a result list")
def write_error_surfaces(ctx: Context) -> None:
    for rank in range(world(ctx)):
        loc = ctx.location()
        err = _run_fault(ctx, loc, Fault("write_data:inside", rank), 220)
        if err is None:
            raise CheckFailed(
                f"CONF-22: rank {rank}'s write_data returned results although "
                "planner.resolve_data raised for its items, and the save returned normally"
            )
        if not _mentions_fault(err):
            raise CheckFailed(
                "CONF-22: the error raised for a failing planner.resolve_data neither is nor "
                f"chains nor mentions the original error: {describe(err)}"
            )


def _mentions_fault(err: BaseException) -> bool:
    seen: BaseException | None = err
    depth = 0
    while seen is not None and depth < 10:
        if isinstance(seen, InjectedFault) or "injected" in str(seen):
            return True
        seen = seen.__cause__ or seen.__context__
        depth += 1
    return False


@spec("CONF-23", title="a failure at any step on any rank before finish leaves nothing loadable")
def fault_leaves_nothing(ctx: Context) -> None:
    baseline_save(ctx, [rank_sd(r, 230 + r) for r in range(world(ctx))], "CONF-23")
    for fault in _faults(ctx):
        if fault.step == "finish:inside":
            continue
        loc = ctx.location()
        err = _run_fault(ctx, loc, fault, 230)
        if err is None:
            raise CheckFailed(f"CONF-23: the save returned normally although {fault} raised")
        if committed(ctx, loc):
            raise CheckFailed(
                f"CONF-23: a checkpoint is loadable after the save failed at {fault} "
                f"with {describe(err)}"
            )


@spec("CONF-24", title="finish that raises leaves nothing loadable")
def finish_failure(ctx: Context) -> None:
    baseline_save(ctx, [rank_sd(r, 240 + r) for r in range(world(ctx))], "CONF-24")
    loc = ctx.location()
    err = _run_fault(ctx, loc, Fault("finish:inside", 0), 240)
    if err is None:
        seen = load_error(ctx, loc)
        if seen is not None:
            raise CheckFailed(
                "CONF-24: finish returned normally although the Metadata it was given cannot "
                "be pickled, and afterwards read_metadata at the location raised "
                f"{describe(seen)} (the same save with picklable metadata is loadable)"
            )
        raise NotApplicable("finish does not serialise the Metadata object, so nothing to inject")
    if committed(ctx, loc):
        raise CheckFailed(f"CONF-24: a checkpoint is loadable after finish raised {describe(err)}")


def _atomic_overwrite(ctx: Context, requirement: str) -> None:
    for fault in _faults(ctx):
        loc = ctx.location()
        (truth,) = save_at(ctx, loc, [sample_sd(250)])
        _run_fault(ctx, loc, fault, 260)
        try:
            (dest,) = load_into(ctx, loc, [truth])
        except BaseException as exc:
            if not backend_error(exc):
                raise
            raise CheckFailed(
                f"{requirement}: the earlier checkpoint is not loadable after a failed save at "
                f"{fault}: {describe(exc)}"
            ) from exc
        try:
            assert_same(dest, truth, requirement)
        except CheckFailed as exc:
            raise CheckFailed(f"{exc} (after a failed save at {fault})") from exc


@spec(
    "CONF-25",
    title="a failed save keeps the earlier checkpoint at its location intact",
    needs=("overwrite",),
)
def failed_overwrite_keeps_old(ctx: Context) -> None:
    _atomic_overwrite(ctx, "CONF-25")


@spec(
    "CONF-29",
    title="a backend declaring atomic_overwrite keeps the earlier checkpoint on failure",
    needs=("overwrite", "atomic_overwrite"),
)
def declared_atomic_overwrite(ctx: Context) -> None:
    _atomic_overwrite(ctx, "CONF-29")


@spec("CONF-26", title="a second save at a location replaces the checkpoint", needs=("overwrite",))
def overwrite_replaces(ctx: Context) -> None:
    loc = ctx.location()
    save_at(ctx, loc, [sample_sd(261, 4)])
    (second,) = save_at(ctx, loc, [sample_sd(262, 2)])
    (dest,) = load_into(ctx, loc, [second])
    assert_same(dest, second, "CONF-26")


def old_state() -> dict[str, Any]:
    """The larger, earlier checkpoint of CONF-47 and CONF-48: more and bigger items."""
    gen = torch.Generator().manual_seed(470)
    sd: dict[str, Any] = {
        f"layer{i}.weight": finite_tensor((32, 33), torch.float32, gen) for i in range(4)
    }
    sd["layer0.bias"] = finite_tensor((33,), torch.float64, gen)
    sd["step"] = torch.tensor(1, dtype=torch.int64)
    return sd


def new_state() -> dict[str, Any]:
    """The later checkpoint: fewer, smaller items under partly the same keys."""
    gen = torch.Generator().manual_seed(471)
    return {
        "layer0.weight": finite_tensor((4, 5), torch.float32, gen),
        "step": torch.tensor(2, dtype=torch.int64),
    }


def exact_state(ctx: Context, loc: Any, truth: dict[str, Any], requirement: str) -> None:
    """Raise unless the metadata at ``loc`` lists exactly ``truth``'s keys and a load of
    everything it lists equals ``truth`` bit for bit."""
    keys = set(read_metadata(ctx, loc).state_dict_metadata)
    stale, lost = sorted(keys - set(truth)), sorted(set(truth) - keys)
    if stale or lost:
        raise CheckFailed(
            f"{requirement}: the metadata lists keys the last save did not write {stale[:4]}"
            + (f" and lacks keys it wrote {lost[:4]}" if lost else "")
        )
    assert_same(load_all(ctx, loc, truth), truth, requirement)


@spec(
    "CONF-47",
    title="an overwrite with fewer, smaller items leaves no stale key or data",
    needs=("overwrite",),
)
def overwrite_leaves_nothing_stale(ctx: Context) -> None:
    loc = ctx.location()
    save_at(ctx, loc, [old_state()])
    (truth,) = save_at(ctx, loc, [new_state()])
    exact_state(ctx, loc, truth, "CONF-47")


@spec("CONF-27", title="one writer reused through reset() for several checkpoints")
def writer_reuse(ctx: Context) -> None:
    first = ctx.location()
    writer = ctx.backend.writer(first, rank=0)
    saved: list[tuple[Any, dict[str, Any]]] = []
    for i in range(3):
        loc = first if i == 0 else ctx.location()
        sd = sample_sd(270 + i, 1 + i)
        saved.append((loc, clone_truth(sd)))
        save_ranks([writer], [sd], checkpoint_id=loc)
    for loc, truth in saved:
        (dest,) = load_into(ctx, loc, [truth])
        assert_same(dest, truth, "CONF-27")
