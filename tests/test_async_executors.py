"""async_save's executors as strategies, and the checkpoint group registry (STAGE-20, COMM-54)."""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import pytest
import torch

from refdcp.api import load
from refdcp.asyncsave.executors import Plan, ProcessExecutor, ThreadExecutor, executor_for
from refdcp.asyncsave.groups import GroupRegistry
from refdcp.asyncsave.save import async_save
from tests.test_layering import imports_of

#: Why this module runs on refdcp only (REF-6).
SINGLE_PATH = (
    "executor strategy objects and the checkpoint-group registry are refdcp.async_save's "
    "internals; refdcp.reference.async_save runs on a thread only (REF-12)"
)


class _PG:
    """A stand-in process group: only its ranks matter to the registry."""

    def __init__(self, ranks: tuple[int, ...]) -> None:
        self.ranks = ranks


def _registry(world: list[object]) -> tuple[GroupRegistry, list[Any]]:
    made: list[Any] = []

    def new_group(ranks: Any) -> Any:
        made.append(("group", ranks))
        return ("gloo", ranks, len(made))

    reg = GroupRegistry(
        ranks_of=lambda pg: None if pg is None else pg.ranks,
        new_group=new_group,
        default_group=lambda: world[0],
        make_comm=lambda group: ("comm", group),  # type: ignore[arg-type, return-value]
    )
    return reg, made


@pytest.mark.spec("COMM-54")
def test_registry_keys_groups_by_ranks_not_by_object_identity() -> None:
    reg, made = _registry([object()])
    a = _PG((0, 1))
    group_a = reg.group(a)
    assert reg.group(_PG((0, 1))) is group_a  # same ranks, another object: same group
    del a
    gc.collect()
    b = _PG((2, 3))  # may reuse the collected object's id: must not get its group
    assert reg.group(b) != group_a and reg.group(b)[1] == (2, 3)
    assert reg.group(None)[1] is None
    assert reg.comm(b) is reg.comm(_PG((2, 3))) and reg.comm(b)[1] == reg.group(b)  # type: ignore[index]
    assert [m[1] for m in made] == [(0, 1), (2, 3), None]


@pytest.mark.spec("COMM-54")
def test_registry_drops_its_groups_when_the_default_group_changes() -> None:
    world: list[object] = [object()]
    reg, made = _registry(world)
    first = reg.group(None)
    world[0] = object()  # destroy_process_group + init_process_group
    second = reg.group(None)
    assert first != second and len(made) == 2


@pytest.mark.spec("STAGE-20")
def test_executor_is_a_strategy_chosen_once() -> None:
    assert isinstance(executor_for("thread"), ThreadExecutor)
    assert isinstance(executor_for("process"), ProcessExecutor)
    with pytest.raises(ValueError, match="executor must be"):
        executor_for("fork")
    for module in ("refdcp.asyncsave.executors", "refdcp.asyncsave.process_executor"):
        reached, _, _ = imports_of(module)
        assert "refdcp.asyncsave.save" not in reached, module
    with pytest.raises(ValueError, match="save_fn"):
        ProcessExecutor().plan(
            comm=None, process_group=None, no_dist=True, save_fn=lambda *a, **k: None
        )


class _Recording(ThreadExecutor):
    def __init__(self) -> None:
        self.calls = 0

    def plan(self, **kw: Any) -> Plan:
        self.calls += 1
        return super().plan(**kw)


@pytest.mark.spec("STAGE-20", "ASYNC-1")
def test_async_save_accepts_an_executor_object(tmp_path: Path) -> None:
    ex = _Recording()
    w = torch.arange(6.0)
    async_save({"w": w}, checkpoint_id=str(tmp_path), executor=ex, no_dist=True).result(timeout=60)
    out = {"w": torch.zeros(6)}
    load(out, checkpoint_id=str(tmp_path), no_dist=True)
    assert ex.calls == 1 and torch.equal(out["w"], w)
