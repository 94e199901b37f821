"""docs/glossary.md names only what exists, and its step table is the protocol's (TUT-6)."""

from __future__ import annotations

import importlib
import inspect
import re
from typing import Any

import pytest

from refdcp.protocol.load import LOAD_ROWS
from refdcp.protocol.machine import Kind, Row
from refdcp.protocol.names import Phase, Slot, Step
from refdcp.protocol.save import SAVE_ROWS
from refdcp.tools.spec_report import repo_root

GLOSSARY = repo_root() / "docs" / "glossary.md"
_CODE = re.compile(r"`([^`]+)`")
_ALIASES = {"dcp.": "torch.distributed.checkpoint.", "dist.": "torch.distributed."}
_ENUMS: dict[str, Any] = {"Phase": Phase, "Step": Step, "Slot": Slot, "Kind": Kind}


def _text() -> str:
    return GLOSSARY.read_text(encoding="utf-8")


def _table_rows(text: str) -> list[list[str]]:
    """Every row of every Markdown table, as its cells (header and rule rows left out)."""
    rows = []
    for block in re.split(r"\n(?!\|)", text):
        lines = [x for x in block.splitlines() if x.startswith("|")]
        for line in lines[2:]:
            rows.append([c.strip() for c in line.strip("|").split("|")])
    return rows


def resolve(dotted: str) -> Any:
    """The object a dotted name names: the longest importable module prefix, then attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            obj = getattr(obj, name)
        return obj
    raise ImportError(dotted)


def names(text: str) -> dict[str, list[str]]:
    """The code spans of ``text`` that name something, by kind: torch, refdcp, enum, path."""
    out: dict[str, list[str]] = {"torch": [], "refdcp": [], "enum": [], "path": []}
    for span in _CODE.findall(text):
        for alias, full in _ALIASES.items():
            if span.startswith(alias):
                span = full + span[len(alias) :]
        if re.fullmatch(r"torch(\.\w+)+", span):
            out["torch"].append(span)
        elif re.fullmatch(r"refdcp(\.\w+)+", span):
            out["refdcp"].append(span)
        elif re.fullmatch(r"(Phase|Step|Slot|Kind)\.\w+", span):
            out["enum"].append(span)
        elif re.fullmatch(r"refdcp/[\w/]+\.py", span):
            out["path"].append(span)
    return out


@pytest.mark.spec("TUT-6")
def test_every_torch_name_exists_in_the_installed_torch() -> None:
    found = names(_text())["torch"]
    assert len(found) > 40
    missing = []
    for name in sorted(set(found)):
        try:
            resolve(name)
        except (ImportError, AttributeError):
            missing.append(name)
    assert not missing, f"docs/glossary.md names torch objects that do not exist: {missing}"


@pytest.mark.spec("TUT-6")
def test_every_refdcp_name_exists() -> None:
    found = names(_text())
    assert found["refdcp"] and found["enum"] and found["path"]
    missing = []
    for name in sorted(set(found["refdcp"])):
        try:
            resolve(name)
        except (ImportError, AttributeError):
            missing.append(name)
    for name in sorted(set(found["enum"])):
        enum, _, member = name.partition(".")
        if not hasattr(_ENUMS[enum], member):
            missing.append(name)
    missing += [p for p in sorted(set(found["path"])) if not (repo_root() / p).is_file()]
    assert not missing, f"docs/glossary.md names refdcp objects that do not exist: {missing}"


def _step_table() -> list[list[str]]:
    return [r for r in _table_rows(_text()) if len(r) == 6 and r[0] in ("`SAVE`", "`LOAD`")]


def _member(cell: str, enum: Any) -> Any:
    [name] = re.findall(rf"`{enum.__name__}\.(\w+)`", cell)
    return getattr(enum, name)


@pytest.mark.spec("TUT-6", "PROTO-1")
def test_the_step_table_is_the_protocol_tables() -> None:
    """Each row names a transition of SAVE or LOAD (the phase entered, its kind, its step or
    slots), and every phase either table enters, but its end, has a row."""
    rows = _step_table()
    tables: dict[str, list[Row]] = {"`SAVE`": SAVE_ROWS, "`LOAD`": LOAD_ROWS}
    seen: dict[str, list[Phase]] = {"`SAVE`": [], "`LOAD`": []}
    for cells in rows:
        table, phase, kind = cells[0], _member(cells[1], Phase), _member(cells[2], Kind)
        if kind is Kind.LOCAL:
            want: dict[str, Any] = {"step": _member(cells[3], Step)}
        else:
            send, recv = re.findall(r"`Slot\.(\w+)`", cells[3])
            want = {"send": getattr(Slot, send), "recv": getattr(Slot, recv)}
        matching = [
            r
            for r in tables[table]
            if r.next is phase
            and r.kind is kind
            and all(getattr(r, k) is v for k, v in want.items())
        ]
        assert matching, f"{cells[:4]} is no transition of {table}"
        seen[table].append(phase)
        # the reference's body for a local step is the method that runs it
        body = resolve(re.findall(r"`(refdcp[\w.]+)`", cells[5])[0])
        if kind is Kind.LOCAL:
            assert body.__name__ == str(want["step"])
    for table, entered in seen.items():
        ends = {Phase.DONE, Phase.FAILED, Phase.IDLE}
        everything = {r.next for r in tables[table]} - ends
        assert set(entered) == everything, table
        assert len(entered) == len(set(entered)), f"{table}: a phase has two rows"


@pytest.mark.spec("TUT-6")
def test_torch_uses_the_composites_the_table_says() -> None:
    """torch 2.13's save plans with ``reduce_scatter`` and writes with ``all_reduce``; its load
    plans with ``reduce_scatter`` and reads with ``all_gather`` (``_DistWrapper``)."""
    from torch.distributed.checkpoint import state_dict_loader, state_dict_saver

    saver = inspect.getsource(state_dict_saver._save_state_dict)
    loader = inspect.getsource(state_dict_loader._load_state_dict)
    assert re.search(r"\.reduce_scatter\(\s*\"plan\"", saver)
    assert re.search(r"\.all_reduce\(\s*\"write\"", saver)
    assert re.search(r"\.reduce_scatter\(\s*\"plan\"", loader)
    assert re.search(r"\.all_gather\(\s*\"read\"", loader)
    assert "all_reduce" not in loader and "all_gather(" not in saver
    text = _text()
    for composite, where in (
        ('reduce_scatter`, step "plan"', "_save_state_dict"),
        ('all_reduce`, step "write"', "_save_state_dict"),
        ('all_gather`, step "read"', "_load_state_dict"),
    ):
        line = next(x for x in text.splitlines() if composite in x)
        assert where in line


@pytest.mark.spec("TUT-6")
def test_the_glossary_is_linked_from_the_readme_and_tutorial() -> None:
    readme = (repo_root() / "README.md").read_text(encoding="utf-8")
    assert "(docs/glossary.md)" in readme
    assert "docs/glossary.md" in (repo_root() / "docs" / "tutorial.md").read_text(encoding="utf-8")


@pytest.mark.spec("TUT-6")
def test_the_checker_catches_a_wrong_name() -> None:
    """The resolver refuses a name that is not there, in torch and in refdcp."""
    for wrong in (
        "torch.distributed.checkpoint.SavePlanner.create_local_plans",
        "refdcp.reference.run.SaveSteps.writes",
    ):
        with pytest.raises(AttributeError):
            resolve(wrong)
    assert resolve("torch.distributed.checkpoint.utils._DistWrapper.reduce_scatter")
