"""The model checker over the real tables: 0 violations, and it catches planted bugs (MODEL-*)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from refdcp.errors_core import CommAborted, Failure
from refdcp.protocol import LOAD, SAVE, Phase, State, Table, outcomes
from refdcp.protocol.machine import On, Role
from refdcp.protocol.model import FAULT_KINDS, Config, explore
from refdcp.protocol.mutants import equivalence, judge, mutants
from refdcp.tools.model_check import main

SINGLE_PATH = "checks the protocol tables, which both implementations share"


@pytest.mark.spec("MODEL-1", "MODEL-2", "MODEL-3", "MODEL-4", "MODEL-5")
@pytest.mark.parametrize("table", [SAVE, LOAD], ids=["save", "load"])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_every_run_with_up_to_two_faults_keeps_every_invariant(table: Table, world: int) -> None:
    result = explore(Config(table, world, 2))
    assert result.violations == [], result.violations[0].table(world)
    assert result.ends > world  # faults were placed: more than the one fault-free end


def _with_row(table: Table, phase: Phase, on: On, role: Role, **change: object) -> Table:
    rows = [
        replace(r, **change) if (r.phase, r.on, r.role) == (phase, on, role) else r
        for r in table.rows
    ]  # type: ignore[arg-type]
    assert rows != table.rows
    return Table(table.name, rows)


@pytest.mark.spec("MODEL-3", "MODEL-6")
def test_a_table_that_skips_the_commit_is_caught_with_the_shortest_run() -> None:
    bad = _with_row(
        SAVE, Phase.GATHER_RESULTS, On.GOT_OK, Role.COORD,
        next=Phase.BROADCAST_OUTCOME, kind=SAVE.rows[-7].kind, step=None,
        send=SAVE.rows[-7].send, recv=SAVE.rows[-7].recv,
    )  # fmt: skip
    result = explore(Config(bad, 2, 0))
    assert result.violations and result.violations[0].invariant == "MODEL-3 commit safety"
    text = result.violations[0].table(2)
    assert "gather_results --got_ok--> broadcast_outcome [SAVE-6]" in text
    assert text.splitlines()[1].startswith("rank 0") and "rank 1" in text.splitlines()[1]


@pytest.mark.spec("MODEL-5")
def test_a_missing_row_is_caught() -> None:
    rows = [r for r in SAVE.rows if (r.phase, r.on) != (Phase.WRITE, On.ERR)]
    result = explore(Config(Table("save", rows), 2, 1))
    assert result.violations[0].invariant == "MODEL-5 no missing row or slot"
    assert "'err' is not allowed in phase 'write'" in result.violations[0].detail


@pytest.mark.spec("MODEL-2", "MODEL-4", "MODEL-5")
def test_a_peer_that_skips_the_outcome_broadcast_is_caught() -> None:
    """A driver bug in table form: a peer returns after the results gather."""
    bad = _with_row(
        SAVE, Phase.GATHER_RESULTS, On.SENT, Role.PEER,
        next=Phase.DONE, kind=SAVE.rows[-4].kind, send=SAVE.rows[-4].send, recv=None,
    )  # fmt: skip
    result = explore(Config(bad, 2, 0))
    assert result.violations
    assert result.violations[0].invariant in (
        "MODEL-3 commit safety",
        "MODEL-4 liveness",
        "MODEL-5 no missing row or slot",  # it returns metadata no broadcast delivered
    )


@pytest.mark.spec("MODEL-3", "SAVE-15", "SAVE-16")
def test_the_old_comm_status_rule_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The rule before the checker found it: a coordinator whose finish raised then lost a
    peer at the outcome broadcast reported False, whatever the writer declared."""

    def old(table: Table, state: State, exc: object, coordinator_rank: int) -> bool | None:
        if state.committed or state.coordinator:
            return state.committed
        return False

    monkeypatch.setattr("refdcp.protocol.model.comm_failure", _comm_failure_with(old))
    result = explore(Config(SAVE, 2, 2, frozenset({"commit", "partial"})))
    assert result.violations and "commit safety" in result.violations[0].invariant


def _comm_failure_with(rule: object) -> object:
    def comm_failure(table, state, action, rank, coordinator_rank, exc):  # type: ignore[no-untyped-def]
        report = outcomes.comm_failure(table, state, action, rank, coordinator_rank, exc)
        return replace(report, committed=rule(table, state, exc, coordinator_rank))  # type: ignore[operator]

    return comm_failure


@pytest.mark.spec("SAVE-15", "SAVE-16", "PROTO-17")
@pytest.mark.parametrize("declared", [True, False, None, "unmarked"])
def test_a_coordinator_whose_finish_raised_reports_what_the_writer_declared(
    declared: object,
) -> None:
    exc = RuntimeError("finish")
    if declared != "unmarked":
        outcomes.mark(exc, declared)  # type: ignore[arg-type]
    failure = Failure(0, "commit", exc, "")
    state = State(Phase.BROADCAST_OUTCOME, 0, True, failure=failure)
    lost = CommAborted("peer left")
    lost.ranks = (1,)
    got = outcomes.status_after_comm_error(SAVE, state, lost, 0)
    assert got is (False if declared == "unmarked" else declared)


@pytest.mark.spec("MODEL-6")
def test_the_command_prints_counts_and_exits_zero(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--worlds", "1,2", "--faults", "1"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].split() == [
        "table",
        "N",
        "K",
        "states",
        "ends",
        "seconds",
        "violations",
    ]
    assert len(out.splitlines()) == 5 and all(
        line.split()[-1] == "0" for line in out.splitlines()[1:]
    )
    with pytest.raises(SystemExit):
        main(["--kinds", "raise,nonsense"])
    assert {"raise", "lose", "partial", "commit", "after_last"} == FAULT_KINDS


@pytest.mark.spec("MODEL-7")
@pytest.mark.parametrize("table", [SAVE, LOAD], ids=["save", "load"])
def test_row_mutants_sampled_are_killed_or_listed(table: Table) -> None:
    """Every 12th mutant here; ``make model-check`` (and the slow test) judges them all."""
    sample = list(mutants(table))[::12]
    assert len(sample) > 20
    for m in sample:
        if judge(m, table) is None:
            assert equivalence(table, m) is not None, m


@pytest.mark.slow
@pytest.mark.spec("MODEL-7")
@pytest.mark.parametrize("table", [SAVE, LOAD], ids=["save", "load"])
def test_every_row_mutant_is_killed_or_listed(table: Table) -> None:
    survivors = [m for m in mutants(table) if judge(m, table) is None]
    unexplained = [m for m in survivors if equivalence(table, m) is None]
    assert not unexplained, unexplained
