"""Failure checks: no metadata, commit point, injected faults, overwrite, reuse (CONF-20..27, 29)."""

from __future__ import annotations

from typing import Any

from conformance.checks.common import committed, load_into, rank_sd, sample_sd, save_at
from conformance.drive import SAVE_STEPS, Fault, InjectedFault, save_ranks
from conformance.registry import CheckFailed, Context, NotApplicable, spec
from conformance.truth import assert_same, clone_truth


def _world(ctx: Context) -> int:
    return 2 if ctx.backend.capabilities.shared_location else 1


@spec("CONF-20", title="a location without a committed checkpoint is not loadable")
def empty_location(ctx: Context) -> None:
    loc = ctx.location()
    if committed(ctx, loc):
        raise CheckFailed("CONF-20: read_metadata succeeded on a fresh, empty location")


@spec("CONF-21", title="nothing is loadable before the coordinator's finish returns")
def no_commit_before_finish(ctx: Context) -> None:
    loc = ctx.location()
    world = _world(ctx)
    seen: list[bool] = []
    writers = [ctx.backend.writer(loc, rank=r) for r in range(world)]
    sds = [rank_sd(r, 210 + r) for r in range(world)]
    save_ranks(
        writers, sds, checkpoint_id=loc, before_finish=lambda: seen.append(committed(ctx, loc))
    )
    if seen != [False]:
        raise CheckFailed("CONF-21: the checkpoint was loadable after write_data, before finish")
    if not committed(ctx, loc):
        raise CheckFailed("CONF-21: the checkpoint is not loadable after finish")


def _run_fault(ctx: Context, loc: Any, fault: Fault, seed: int) -> BaseException | None:
    world = _world(ctx)
    writers = [ctx.backend.writer(loc, rank=r) for r in range(world)]
    sds = [rank_sd(r, seed + r) for r in range(world)]
    try:
        save_ranks(writers, sds, checkpoint_id=loc, fault=fault)
    except Exception as exc:
        return exc
    return None


def _faults(ctx: Context) -> list[Fault]:
    world = _world(ctx)
    out: list[Fault] = []
    for step in SAVE_STEPS:
        ranks = [0] if step in ("prepare_global_plan", "finish", "finish:inside") else range(world)
        out.extend(Fault(step, r) for r in ranks)
    return out


@spec("CONF-22", title="an exception inside write_data surfaces, never a result list")
def write_error_surfaces(ctx: Context) -> None:
    for rank in range(_world(ctx)):
        loc = ctx.location()
        err = _run_fault(ctx, loc, Fault("write_data:inside", rank), 220)
        if err is None:
            raise CheckFailed(
                f"CONF-22: rank {rank}'s write_data swallowed an exception raised while writing"
            )
        if not _mentions_fault(err):
            raise CheckFailed(f"CONF-22: the surfaced error hides the cause: {err!r}")


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
    for fault in _faults(ctx):
        if fault.step == "finish:inside":
            continue
        loc = ctx.location()
        err = _run_fault(ctx, loc, fault, 230)
        if err is None:
            raise CheckFailed(f"CONF-23: the save did not fail with {fault}")
        if committed(ctx, loc):
            raise CheckFailed(f"CONF-23: a checkpoint is loadable after a failure at {fault}")


@spec("CONF-24", title="finish that raises leaves nothing loadable")
def finish_failure(ctx: Context) -> None:
    loc = ctx.location()
    err = _run_fault(ctx, loc, Fault("finish:inside", 0), 240)
    if err is None:
        if not committed(ctx, loc):
            raise CheckFailed(
                "CONF-24: finish returned normally although it could not store the metadata, "
                "and nothing is loadable: finish swallowed its own error"
            )
        raise NotApplicable("finish does not serialise the Metadata object, so nothing to inject")
    if committed(ctx, loc):
        raise CheckFailed(f"CONF-24: a checkpoint is loadable after finish raised {err!r}")


def _atomic_overwrite(ctx: Context, requirement: str) -> None:
    for fault in _faults(ctx):
        loc = ctx.location()
        (truth,) = save_at(ctx, loc, [sample_sd(250)])
        _run_fault(ctx, loc, fault, 260)
        try:
            (dest,) = load_into(ctx, loc, [truth])
        except Exception as exc:
            raise CheckFailed(
                f"{requirement}: the earlier checkpoint is not loadable after a failed save at "
                f"{fault}: {type(exc).__name__}: {exc}"
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
