"""A hypothesis state machine of save / load / overwrite / failed-save sequences (CONF-28).

The model is the suite's own record of the last committed state dict at
each location; the backend must agree with it after every step. A failure is
reported as the shortest sequence found, as numbered steps (CONF-54):
hypothesis finds a failing sequence, then the suite drops every step whose
removal keeps it failing (faster than hypothesis's own shrinking of stateful
runs, which replays hundreds of sequences).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hypothesis import HealthCheck, Phase, Verbosity, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
    run_state_machine_as_test,
)

from conformance.checks.common import load_error, load_into, sample_sd, save_at
from conformance.drive import SAVE_STEPS, Fault, save_ranks
from conformance.registry import CheckFailed, Context, backend_error, describe, spec
from conformance.truth import assert_same

_NAMES = ("A", "B")

Op = tuple[str, dict[str, Any]]


class SequenceFailed(CheckFailed):
    """CONF-28 failed after the operations ``ops``; the message lists them as steps."""

    def __init__(self, message: str, ops: Sequence[Op]) -> None:
        super().__init__(message)
        self.ops = list(ops)


def _machine(ctx: Context) -> type[RuleBasedStateMachine]:
    caps = ctx.backend.capabilities
    steps = [s for s in SAVE_STEPS if s != "finish:inside"]

    class SaveLoad(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            # Fresh locations per run: the model starts empty.
            self.locs = [ctx.location() for _ in range(2)]
            self.model: dict[int, dict[str, Any]] = {}
            self.maybe_broken: set[int] = set()
            self.steps: list[str] = []
            self.ops: list[Op] = []

        def record(self, text: str, op: str, **args: Any) -> None:
            self.steps.append(text)
            self.ops.append((op, args))

        def fail(self, what: str) -> None:
            lines = "\n".join(f"  {i}. {s}" for i, s in enumerate(self.steps, 1))
            raise SequenceFailed(f"CONF-28: after the steps\n{lines}\n{what}", self.ops)

        def attempt(self, fn: Any) -> Any:
            try:
                return fn()
            except SequenceFailed:
                raise
            except CheckFailed as exc:
                self.fail(str(exc).removeprefix("CONF-28: "))
            except BaseException as exc:
                if not backend_error(exc):
                    raise
                self.fail(f"the last step raised {describe(exc)}")

        @initialize(seed=st.integers(0, 1000), n=st.integers(1, 4))
        def first_save(self, seed: int, n: int) -> None:
            # Location A starts committed, so that later saves there are overwrites.
            self.save(0, seed, n)

        @rule(where=st.integers(0, 1), seed=st.integers(0, 1000), n=st.integers(1, 4))
        def save(self, where: int, seed: int, n: int) -> None:
            if where in self.model and not caps.overwrite:
                return
            verb = "overwrite" if where in self.model else "save"
            self.record(
                f"{verb} {n + 1} tensors at location {_NAMES[where]} (seed {seed})",
                "save",
                where=where,
                seed=seed,
                n=n,
            )
            (truth,) = self.attempt(lambda: save_at(ctx, self.locs[where], [sample_sd(seed, n)]))
            self.model[where] = truth
            self.maybe_broken.discard(where)

        @rule(where=st.integers(0, 1), seed=st.integers(0, 1000), step=st.sampled_from(steps))
        def failed_save(self, where: int, seed: int, step: str) -> None:
            if where in self.model and not caps.overwrite:
                return
            check_now = where in self.model and caps.atomic_overwrite
            self.record(
                f"save at location {_NAMES[where]} with a fault injected at {step} (seed {seed})"
                + (f", then load location {_NAMES[where]}" if check_now else ""),
                "failed_save",
                where=where,
                seed=seed,
                step=step,
            )
            writer = ctx.backend.writer(self.locs[where], rank=0)
            try:
                save_ranks(
                    [writer],
                    [sample_sd(seed)],
                    checkpoint_id=self.locs[where],
                    fault=Fault(step, 0),
                )
            except BaseException as exc:
                if not backend_error(exc):
                    raise
                if where in self.model and not caps.atomic_overwrite:
                    self.maybe_broken.add(where)
                elif check_now:  # the committed checkpoint must be intact at once
                    self.check_load(where)
                return
            self.fail("that save returned normally although the injected fault raised")

        @rule(where=st.integers(0, 1))
        def load(self, where: int) -> None:
            if where in self.maybe_broken:
                return
            self.record(f"load location {_NAMES[where]}", "load", where=where)
            self.check_load(where)

        def check_load(self, where: int) -> None:
            truth = self.model.get(where)
            if truth is None:
                if load_error(ctx, self.locs[where]) is None:
                    self.fail(f"location {_NAMES[where]} never committed a save but is loadable")
                return
            (dest,) = self.attempt(lambda: load_into(ctx, self.locs[where], [truth]))
            self.attempt(lambda: assert_same(dest, truth, "CONF-28"))

        @invariant()
        def committed_matches_model(self) -> None:
            for where in range(2):
                if where in self.maybe_broken:
                    continue
                err = load_error(ctx, self.locs[where])
                if where in self.model and err is not None:
                    self.fail(
                        f"location {_NAMES[where]} holds a committed save, but read_metadata "
                        f"raised {describe(err)}"
                    )
                if where not in self.model and err is None:
                    self.fail(f"location {_NAMES[where]} never committed a save but is loadable")

    return SaveLoad


def replay(machine: type[RuleBasedStateMachine], ops: Sequence[Op]) -> SequenceFailed | None:
    """Run ``ops`` on a fresh machine, checking the invariant after each; the failure or None."""
    m: Any = machine()
    try:
        m.committed_matches_model()
        for name, args in ops:
            getattr(m, name)(**args)
            m.committed_matches_model()
    except SequenceFailed as exc:
        return exc
    return None


def shortest(machine: type[RuleBasedStateMachine], failure: SequenceFailed) -> SequenceFailed:
    """Drop steps one at a time while the sequence still fails (greedy, to a fixpoint)."""
    best = failure
    changed = True
    while changed:
        changed = False
        for i in range(len(best.ops)):
            found = replay(machine, best.ops[:i] + best.ops[i + 1 :])
            if found is not None:
                best, changed = found, True
                break
    return best


def _first_sequence_failure(exc: BaseException) -> SequenceFailed | None:
    if isinstance(exc, SequenceFailed):
        return exc
    for inner in getattr(exc, "exceptions", ()):
        found = _first_sequence_failure(inner)
        if found is not None:
            return found
    return None


@spec("CONF-28", title="random save/load/overwrite/failed-save sequences agree with the model")
def stateful(ctx: Context) -> None:
    machine = _machine(ctx)
    try:
        run_state_machine_as_test(
            machine,
            settings=settings(
                max_examples=ctx.examples,
                stateful_step_count=10,
                deadline=None,
                derandomize=True,
                database=None,
                report_multiple_bugs=False,
                phases=[Phase.explicit, Phase.reuse, Phase.generate],
                verbosity=Verbosity.quiet,
                suppress_health_check=list(HealthCheck),
            ),
        )
    except BaseException as exc:
        found = _first_sequence_failure(exc)
        if found is None:
            raise
        raise CheckFailed(str(shortest(machine, found))) from None
