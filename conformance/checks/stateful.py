"""A hypothesis state machine of save / load / overwrite / failed-save sequences (CONF-28).

The model is the suite's own record of the last committed state dict at
each location; the backend must agree with it after every step.
"""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from conformance.checks.common import committed, load_into, sample_sd, save_at
from conformance.drive import SAVE_STEPS, Fault, save_ranks
from conformance.registry import CheckFailed, Context, spec
from conformance.truth import assert_same


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

        @rule(where=st.integers(0, 1), seed=st.integers(0, 1000), n=st.integers(1, 4))
        def save(self, where: int, seed: int, n: int) -> None:
            if where in self.model and not caps.overwrite:
                return
            (truth,) = save_at(ctx, self.locs[where], [sample_sd(seed, n)])
            self.model[where] = truth
            self.maybe_broken.discard(where)

        @rule(where=st.integers(0, 1), seed=st.integers(0, 1000), step=st.sampled_from(steps))
        def failed_save(self, where: int, seed: int, step: str) -> None:
            if where in self.model and not caps.overwrite:
                return
            writer = ctx.backend.writer(self.locs[where], rank=0)
            try:
                save_ranks(
                    [writer],
                    [sample_sd(seed)],
                    checkpoint_id=self.locs[where],
                    fault=Fault(step, 0),
                )
            except Exception:
                if where in self.model and not caps.atomic_overwrite:
                    self.maybe_broken.add(where)
                return
            raise CheckFailed(f"CONF-28: a save with a fault at {step} did not fail")

        @rule(where=st.integers(0, 1))
        def load(self, where: int) -> None:
            if where in self.maybe_broken:
                return
            truth = self.model.get(where)
            if truth is None:
                if committed(ctx, self.locs[where]):
                    raise CheckFailed("CONF-28: a location that never committed is loadable")
                return
            (dest,) = load_into(ctx, self.locs[where], [truth])
            assert_same(dest, truth, "CONF-28")

        @invariant()
        def committed_matches_model(self) -> None:
            for where in range(2):
                if where in self.maybe_broken:
                    continue
                if (where in self.model) != committed(ctx, self.locs[where]):
                    raise CheckFailed(
                        f"CONF-28: location {where}: model committed={where in self.model}, "
                        "backend disagrees"
                    )

    return SaveLoad


@spec("CONF-28", title="random save/load/overwrite/failed-save sequences agree with the model")
def stateful(ctx: Context) -> None:
    machine = _machine(ctx)
    run_state_machine_as_test(
        machine,
        settings=settings(
            max_examples=ctx.examples,
            stateful_step_count=6,
            deadline=None,
            derandomize=True,
            database=None,
            suppress_health_check=list(HealthCheck),
        ),
    )
