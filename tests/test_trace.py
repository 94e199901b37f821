"""Golden-output tests for ``refdcp trace`` (spec/trace.md)."""

from __future__ import annotations

import io
import os
import re
from pathlib import Path

import pytest

from refdcp.tools.cli import main as cli_main
from refdcp.tools.trace import render_mermaid, render_text, run_trace, trace_command

GOLDEN = Path(__file__).parent / "golden"
CASES = {
    "trace_rows_4to2.txt": dict(save_world=4, load_world=2, sharding="rows", fmt="text"),
    "trace_cols_2to3.mmd": dict(save_world=2, load_world=3, sharding="cols", fmt="mermaid"),
    "trace_nodedup_2.txt": dict(
        save_world=2, load_world=2, sharding="replicated", fmt="text", dedup=False
    ),
    "trace_rows_3to2.md": dict(save_world=3, load_world=2, sharding="rows", fmt="markdown"),
}


def _run(**kw: object) -> str:
    buf = io.StringIO()
    trace_command(out=buf, **kw)  # type: ignore[arg-type]
    return buf.getvalue()


@pytest.mark.spec("TRACE-1", "TRACE-2", "TRACE-3", "TRACE-4", "TRACE-5", "TRACE-6")
@pytest.mark.parametrize("name", sorted(CASES))
def test_trace_matches_golden(name: str) -> None:
    got = _run(**CASES[name])
    path = GOLDEN / name
    if os.environ.get("REFDCP_REGEN_GOLDEN"):
        path.write_text(got, encoding="utf-8")
    assert got == path.read_text(encoding="utf-8")
    assert _run(**CASES[name]) == got  # deterministic


@pytest.mark.spec("TRACE-1", "TRACE-4")
@pytest.mark.parametrize("sharding", ["rows", "cols", "replicated"])
@pytest.mark.parametrize(("save", "load"), [(1, 4), (3, 2), (4, 4), (5, 3)])
def test_trace_round_trips_for_any_worlds(sharding: str, save: int, load: int) -> None:
    res = run_trace(save, load, sharding)
    assert res.verified and res.metadata is not None
    text = render_text(res)
    assert "loaded values equal the saved ones: yes" in text and "(!)" not in text
    # every replicated chunk is written exactly once
    written = [(wr.index.fqn, wr.index.offset) for results in res.writes for wr in results]
    assert len(written) == len(set(written))
    assert render_mermaid(res).startswith("sequenceDiagram\n")
    assert render_mermaid(res, markdown=True).startswith("```mermaid\nsequenceDiagram\n")


@pytest.mark.spec("TRACE-3")
def test_dedup_reasons_match_the_planner_choices() -> None:
    res = run_trace(4, 2, "rows")
    assert res.decisions
    for d in res.decisions:
        assert d.writer in d.holders
        if d.fqn != "step":
            named = dict(p.split("=") for p in d.reason.split("; ")[1].rstrip(")").split(", "))
            loads = {int(k[1:]): int(v) for k, v in named.items()}
            assert loads[d.writer] == min(loads.values())


# --- mermaid: valid .mmd, honest collectives (TRACE-10..12) -------------------------------------

_PARTICIPANT = re.compile(r"^    participant (\w+) as [\w ]+$")
_NOTE = re.compile(r"^    Note over (\w+)(?:,(\w+))?: [^;#\n]+$")
_MESSAGE = re.compile(r"^    (\w+)->>(\w+): [^;#\n]+$")


def mermaid_problems(src: str) -> list[str]:
    """Where ``src`` is not a mermaid sequence diagram of the statements the trace uses."""
    lines = src.splitlines()
    if not lines or lines[0] != "sequenceDiagram":
        return [f"first line is {lines[:1]!r}, not 'sequenceDiagram'"]
    declared: set[str] = set()
    problems = []
    for n, line in enumerate(lines[1:], 2):
        if m := _PARTICIPANT.match(line):
            declared.add(m.group(1))
            continue
        m = _NOTE.match(line) or _MESSAGE.match(line)
        if m is None:
            problems.append(f"line {n}: not a participant, note or message: {line!r}")
        elif not {g for g in m.groups() if g} <= declared:
            problems.append(f"line {n}: undeclared participant: {line!r}")
    return problems


def _messages(src: str, label: str) -> set[tuple[str, str]]:
    return {
        (a, b) for a, b, lab in re.findall(r"^    (\w+)->>(\w+): (.*)$", src, re.M) if lab == label
    }


@pytest.mark.spec("TRACE-12")
@pytest.mark.parametrize(("save", "load"), [(1, 1), (2, 3), (4, 2)])
def test_mermaid_is_a_valid_mmd_file_and_markdown_wraps_it(save: int, load: int) -> None:
    res = run_trace(save, load, "rows")
    src = render_mermaid(res)
    assert "```" not in src and mermaid_problems(src) == []
    md = render_mermaid(res, markdown=True)
    assert md == f"```mermaid\n{src}```\n"
    assert _run(save_world=save, load_world=load, fmt="mermaid") == src
    assert _run(save_world=save, load_world=load, fmt="markdown") == md


@pytest.mark.spec("TRACE-11")
@pytest.mark.parametrize("world", [2, 3, 4])
def test_mermaid_all_gathers_reach_every_rank(world: int) -> None:
    src = render_mermaid(run_trace(2, world, "rows"))
    everyone = {(f"R{a}", f"R{b}") for a in range(world) for b in range(world) if a != b}
    for payload in ("read_outcome", "apply_outcome"):
        assert _messages(src, f"all_gather({payload})") == everyone
    # gathers go to the coordinator only, and nothing is called a gather that is not one
    assert _messages(src, "gather(local_plan)") == {(f"R{r}", "R0") for r in range(1, world)}
    assert "gather_read" not in src and "gather_applied" not in src


@pytest.mark.spec("TRACE-10")
def test_text_names_collectives_by_what_they_do() -> None:
    text = render_text(run_trace(2, 3, "rows"))
    load = text[text.index("== LOAD ==") :]
    for r in range(3):
        line = next(x for x in load.splitlines() if x.startswith(f"  rank {r}: set_up"))
        assert "all_gather(read_outcome):got_ok" in line
        assert "all_gather(apply_outcome):got_ok" in line
    assert "gather_read" not in text and "gather_applied" not in text
    assert "all_gather: every rank\n   receives every rank's outcome" in text


# --- CLI arguments (TOOL-23) --------------------------------------------------------------------


@pytest.mark.spec("TOOL-23")
@pytest.mark.parametrize(
    "argv",
    [
        ["trace", "--save-world", "0"],
        ["trace", "--load-world", "-1"],
        ["trace", "--load-world", "0"],
        ["trace", "--save-world", "two"],
        ["trace", "--save-world", "1.5"],
        ["trace", "--save-world", "65"],
        ["trace", "--format", "svg"],
        ["trace", "--sharding", "diagonal"],
        ["conformance", "x:y", "--examples", "0"],
        ["convert", "a.distcp"],
        ["convert", "a", "b.pt", "--to", "zip"],
        ["demo", "--save-world", "0"],
    ],
)
def test_bad_cli_arguments_are_usage_errors(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        cli_main(argv)
    assert exc.value.code == 2
    out, err = capsys.readouterr()
    assert out == "" and "usage: refdcp" in err and "Traceback" not in err


@pytest.mark.spec("TOOL-23")
@pytest.mark.parametrize("bad", [{"save_world": 0}, {"load_world": -1}, {"load_world": True}])
def test_run_trace_refuses_worlds_below_one(bad: dict[str, object]) -> None:
    with pytest.raises(ValueError, match="must be an int >= 1"):
        run_trace(**bad)  # type: ignore[arg-type]


@pytest.mark.spec("TRACE-13")
def test_the_text_trace_says_its_file_names_come_from_memory_storage() -> None:
    import re

    text = _run(save_world=2, load_world=2, sharding="rows", fmt="text")
    heading = text.splitlines()[1]
    assert "MemoryStorage" in heading and "g1" in heading and "hex token" in heading
    names = set(re.findall(r"__\d+_\d+\.(\w+)\.distcp", text))
    assert names == {"g1"}  # the generation the heading announces, not a hex token
