"""Power loss: the states a power cut can leave during a save load as the old or the new
checkpoint, or as nothing (CONF-58, CONF-59, CONF-60).

A SIGKILL (CONF-48) leaves the page cache intact; a power cut does not. Each check saves
once with the file-system calls below the location's scratch directory recorded
(``conformance/powerloss.py`` states the model and its limits), then rebuilds, at up to
``MAX_POINTS`` crash points of that save, the trees a power cut could leave there
(fixed policies plus ``RANDOM_STATES`` random ones, seeded by ``SEED``, the point and
the state's number, so a run is reproducible), writes each tree into the scratch
directory and loads it with a fresh reader.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from conformance.checks.common import load_error, save_at, world
from conformance.checks.failures import exact_state, old_state
from conformance.drive import save_ranks
from conformance.powerloss import (
    POLICIES,
    CrashState,
    Policy,
    Recorder,
    Trace,
    crash_state,
    differences,
    materialize,
)
from conformance.registry import (
    CheckFailed,
    Context,
    NotApplicable,
    backend_error,
    describe,
    spec,
)
from conformance.truth import clone_truth, finite_tensor

#: The seed of the random crash states (with the crash point and the state's number).
SEED = 58
#: Crash points per save: every call when there are fewer, else this many spread over it.
MAX_POINTS = 48
#: Random crash states per crash point, besides the fixed policies.
RANDOM_STATES = 3


def power_new(rank: int, ranks: int) -> dict[str, Any]:
    """The checkpoint saved under power loss: one tensor spans four 4 KiB pages and a bit."""
    gen = torch.Generator().manual_seed(580 + rank)
    sd = {
        "layer0.weight": finite_tensor((41, 100), torch.float32, gen),
        "layer0.bias": finite_tensor((7,), torch.float64, gen),
        "step": torch.tensor(2, dtype=torch.int64),
    }
    return {f"rank{rank}.{k}": v for k, v in sd.items()} if ranks > 1 else sd


def power_old(rank: int, ranks: int) -> dict[str, Any]:
    sd = old_state()
    return {f"rank{rank}.{k}": v for k, v in sd.items()} if ranks > 1 else sd


def _merge(truths: Sequence[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for t in truths:
        out.update(t)
    return out


@dataclass
class Scenario:
    """A recorded save: where, what the location held before it, and what it saved."""

    what: str
    loc: Any
    scratch: Path
    trace: Trace
    old: dict[str, Any] | None
    new: dict[str, Any]
    verdicts: dict[str, tuple[str, str]]


def record(ctx: Context, requirement: str, *, overwrite: bool) -> Scenario:
    """Save once with the shim installed; n/a when the model cannot judge the backend."""
    loc, scratch = ctx.location_in_scratch()
    n = world(ctx)
    old = _merge(save_at(ctx, loc, [power_old(r, n) for r in range(n)])) if overwrite else None
    sds = [power_new(r, n) for r in range(n)]
    new = _merge([clone_truth(sd) for sd in sds])
    writers = [ctx.backend.writer(loc, rank=r) for r in range(n)]
    rec = Recorder(scratch)
    try:
        with rec.recording():
            save_ranks(writers, sds, checkpoint_id=loc, before_finish=rec.mark_finish)
    except BaseException as exc:
        if not backend_error(exc):
            raise
        raise NotApplicable(
            f"{requirement} cannot be judged: the save without a power loss failed: {describe(exc)}"
        ) from exc
    trace = rec.trace
    if not trace.ops:
        raise NotApplicable(
            f"{requirement} does not apply: the save made no file-system call below the "
            "scratch directory its location was made in (not a POSIX file backend)"
        )
    if trace.unsupported:
        raise NotApplicable(
            f"{requirement} cannot be judged: the save made calls the power-loss model does "
            f"not follow: {'; '.join(trace.unsupported[:3])}"
        )
    full = crash_state(trace, len(trace.ops), POLICIES[1], random.Random(SEED))
    missed = differences(scratch, full)
    if missed:
        raise NotApplicable(
            f"{requirement} cannot be judged: the disk after the save differs from the "
            f"recorded calls ({'; '.join(missed[:3])}): it wrote through calls the recorder "
            "does not see (memory maps, C code)"
        )
    sc = Scenario(
        "over a committed checkpoint" if overwrite else "at a fresh location",
        loc, scratch, trace, old, new, {},
    )  # fmt: skip
    seen, detail = judge(ctx, sc, full)
    if seen != "new":
        raise NotApplicable(
            f"{requirement} cannot be judged: the completed save does not load as the new "
            f"checkpoint ({seen}: {detail})"
        )
    return sc


def judge(ctx: Context, sc: Scenario, state: CrashState) -> tuple[str, str]:
    """Write ``state`` into the scratch directory and say what a fresh reader finds there:
    ("none", why), ("old", ""), ("new", "") or ("wrong", what)."""
    key = state.digest()
    if key in sc.verdicts:
        return sc.verdicts[key]
    materialize(sc.scratch, state)
    err = load_error(ctx, sc.loc)
    verdict: tuple[str, str]
    if err is not None:
        verdict = ("none", f"read_metadata raised {describe(err)}")
    else:
        verdict = ("wrong", "")
        candidates = [("new", sc.new)] + ([("old", sc.old)] if sc.old is not None else [])
        failures = []
        for name, truth in candidates:
            try:
                exact_state(ctx, sc.loc, truth, "as the " + name + " checkpoint")
            except CheckFailed as exc:
                failures.append(str(exc))
                continue
            except BaseException as exc:
                if not backend_error(exc):
                    raise
                failures.append(f"loading it as the {name} checkpoint raised {describe(exc)}")
                continue
            verdict = (name, "")
            break
        else:
            verdict = ("wrong", "read_metadata succeeded but " + "; ".join(failures))
    sc.verdicts[key] = verdict
    return verdict


def crash_points(trace: Trace, final_only: bool) -> list[int]:
    """How many calls were made when the power went: 0 .. all of them."""
    n = len(trace.ops)
    if final_only:
        return [n]
    if n + 1 <= MAX_POINTS:
        return list(range(n + 1))
    start = trace.finish_from if trace.finish_from >= 0 else n
    before, inside = range(start), range(start, n + 1)
    half = MAX_POINTS // 2
    pts = {0, n}
    pts.update(before[len(before) * i // half] for i in range(half) if before)
    pts.update(inside[len(inside) * i // half] for i in range(half) if inside)
    return sorted(pts)


def _where(trace: Trace, done: int) -> str:
    n = len(trace.ops)
    if done == n:
        return "after the save returned"
    if 0 <= trace.finish_from <= done:
        return "inside finish"
    return "before finish"


def explore(
    ctx: Context, sc: Scenario, requirement: str, allowed: set[str], *, final_only: bool = False
) -> None:
    """Fail unless every crash state of ``sc`` at the chosen points is in ``allowed``."""
    expected = " or ".join(
        {"none": "not loadable", "old": "the old checkpoint", "new": "the new checkpoint"}[a]
        for a in sorted(allowed)
    )
    trace = sc.trace
    for done in crash_points(trace, final_only):
        policies: list[tuple[Policy, random.Random, str]] = [
            (p, random.Random(SEED), "") for p in POLICIES
        ]
        for k in range(RANDOM_STATES):
            seed = f"{SEED}:{done}:{k}"
            policies.append(
                (Policy("random", "random", "random", "random"), random.Random(seed), seed)
            )
        for policy, rng, seed in policies:
            state = crash_state(trace, done, policy, rng)
            seen, detail = judge(ctx, sc, state)
            if seen in allowed:
                continue
            last = trace.ops[done - 1].text(trace.names) if done else "none yet"
            label = f"random state, seed {seed!r}" if seed else policy.label
            lost = list(state.lost)
            lost_text = "; ".join(lost[:4]) + (f" (+{len(lost) - 4} more)" if len(lost) > 4 else "")
            observed = {"none": "is not loadable", "old": "loads as the old checkpoint",
                        "new": "loads as the new checkpoint"}.get(seen, "loads wrong data")  # fmt: skip
            raise CheckFailed(
                f"{requirement}: a power loss {_where(trace, done)} of a save {sc.what} (after "
                f"call {done} of {len(trace.ops)}, the last made: {last}) can leave a state "
                f"({label}) that {observed}{': ' + detail if detail else ''}; expected "
                f"{expected}. Lost at that point: {lost_text or 'nothing'}"
            )


@spec(
    "CONF-58",
    title="a power loss during a save at a fresh location leaves the new checkpoint or nothing",
)
def power_loss_fresh(ctx: Context) -> None:
    sc = record(ctx, "CONF-58", overwrite=False)
    explore(ctx, sc, "CONF-58", {"none", "new"})


@spec(
    "CONF-59",
    title="a power loss during a save over a committed checkpoint leaves the old or the new",
    needs=("overwrite", "atomic_overwrite"),
)
def power_loss_overwrite(ctx: Context) -> None:
    sc = record(ctx, "CONF-59", overwrite=True)
    explore(ctx, sc, "CONF-59", {"old", "new"})


@spec("CONF-60", title="a save that returned survives a power loss")
def power_loss_after_return(ctx: Context) -> None:
    sc = record(ctx, "CONF-60", overwrite=False)
    explore(ctx, sc, "CONF-60", {"new"}, final_only=True)
    if ctx.backend.capabilities.overwrite:
        sc = record(ctx, "CONF-60", overwrite=True)
        explore(ctx, sc, "CONF-60", {"new"}, final_only=True)
