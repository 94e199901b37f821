"""One writer contract, one reader contract: every driver calls storage in torch 2.13's order.

spec/protocol.md, "Storage contracts" (PROTO-14, PROTO-15, PROTO-16). A spy
writer/reader (around refdcp's in-memory storage) and a spy planner record
each call; torch's own ``dcp.save``/``dcp.load``, the conformance driver
(``conformance/drive.py``) and ``refdcp.save``/``refdcp.load`` are each run
with them, and the per-rank call sequences are compared.
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter

import refdcp
from conformance import drive
from refdcp.comm import FakeWorld
from refdcp.protocol.load import LOAD
from refdcp.protocol.save import SAVE
from refdcp.storage.memory import MemoryStorage

CKPT = "order"
Log = list[str]

#: What the spec's writer table lists for the coordinator (planner calls prefixed "planner.").
WRITER_ORDER = [
    "reset",
    "storage_meta",
    "planner.set_up_planner",
    "set_up_storage_writer",
    "planner.create_local_plan",
    "prepare_local_plan",
    "planner.create_global_plan",
    "prepare_global_plan",
    "planner.finish_plan",
    "write_data",
    "finish",
]
READER_ORDER = [
    "reset",
    "read_metadata",
    "planner.set_up_planner",
    "set_up_storage_reader",
    "planner.create_local_plan",
    "prepare_local_plan",
    "planner.create_global_plan",
    "prepare_global_plan",
    "planner.finish_plan",
    "read_data",
]
COORDINATOR_ONLY = {"planner.create_global_plan", "prepare_global_plan", "finish"}
#: Calls refdcp adds; outside the protocol tables (PROTO-16).
REFDCP_ONLY = {"set_verify", "abort_save"}


def _spy(cls: type, log: Log, names: list[str], prefix: str = "") -> type:
    """A subclass of ``cls`` whose ``names`` methods append ``prefix + name`` to ``log``.

    Only calls from outside are logged: a spied method that the object calls on
    itself while one of its spied methods runs (a writer's ``finish`` asking its
    own ``storage_meta``) is the object's business, not the driver's.
    """
    depth = threading.local()

    def wrap(name: str) -> Callable[..., Any]:
        inner = getattr(cls, name)

        def method(self: Any, *args: Any, **kwargs: Any) -> Any:
            outer = getattr(depth, "n", 0) == 0
            if outer:
                log.append(prefix + name)
            depth.n = getattr(depth, "n", 0) + 1
            try:
                return inner(self, *args, **kwargs)
            finally:
                depth.n -= 1

        method.__signature__ = inspect.signature(inner)  # type: ignore[attr-defined]
        return method

    return type(f"Spy{cls.__name__}", (cls,), {n: wrap(n) for n in names})


_WRITER_METHODS = [
    "reset",
    "storage_meta",
    "set_up_storage_writer",
    "prepare_local_plan",
    "prepare_global_plan",
    "write_data",
    "finish",
    "abort_save",
]
_READER_METHODS = [
    "reset",
    "set_verify",
    "read_metadata",
    "set_up_storage_reader",
    "prepare_local_plan",
    "prepare_global_plan",
    "read_data",
]
_PLANNER_METHODS = ["set_up_planner", "create_local_plan", "create_global_plan", "finish_plan"]


class _Spies:
    """Spy storage and planners over one MemoryStorage, one log per rank."""

    def __init__(self, world: int, directory: Path | None = None) -> None:
        self.store = MemoryStorage()
        self.directory = directory  # a FileSystemWriter there instead (it has abort_save)
        self.logs: list[Log] = [[] for _ in range(world)]

    def writer(self, rank: int) -> StorageWriter:
        w: StorageWriter
        if self.directory is not None:
            w = refdcp.FileSystemWriter(self.directory)
        else:
            w = self.store.writer(CKPT)
        cls = _spy(type(w), self.logs[rank], [m for m in _WRITER_METHODS if hasattr(w, m)])
        w.__class__ = cls
        return w

    def reader(self, rank: int) -> StorageReader:
        r = self.store.reader(CKPT)
        cls = _spy(type(r), self.logs[rank], [m for m in _READER_METHODS if hasattr(r, m)])
        r.__class__ = cls
        return r

    def planner(self, base: type, rank: int) -> Any:
        return _spy(base, self.logs[rank], _PLANNER_METHODS, "planner.")()

    def clear(self) -> None:
        for log in self.logs:
            log.clear()


def _state(rank: int) -> dict[str, Any]:
    return {f"w{rank}": torch.arange(4.0) + rank, "shared": torch.ones(2), "step": 3}


def _torch_orders() -> tuple[Log, Log]:
    spies = _Spies(1)
    sd = _state(0)
    dcp.save(
        sd,
        checkpoint_id=CKPT,
        storage_writer=spies.writer(0),
        planner=spies.planner(DefaultSavePlanner, 0),
        no_dist=True,
    )
    save = list(spies.logs[0])
    spies.clear()
    dcp.load(
        sd,
        checkpoint_id=CKPT,
        storage_reader=spies.reader(0),
        planner=spies.planner(DefaultLoadPlanner, 0),
        no_dist=True,
    )
    return save, list(spies.logs[0])


def _drive_orders(world: int, monkeypatch: pytest.MonkeyPatch) -> tuple[list[Log], list[Log]]:
    spies = _Spies(world)
    made = iter(range(world))
    monkeypatch.setattr(
        drive, "DefaultSavePlanner", lambda: spies.planner(DefaultSavePlanner, next(made))
    )
    sds = [_state(r) for r in range(world)]
    drive.save_ranks([spies.writer(r) for r in range(world)], sds, checkpoint_id=CKPT)
    saves = [list(log) for log in spies.logs]
    spies.clear()
    planners = [spies.planner(DefaultLoadPlanner, r) for r in range(world)]
    drive.load_ranks(
        [spies.reader(r) for r in range(world)], sds, checkpoint_id=CKPT, planners=planners
    )
    return saves, [list(log) for log in spies.logs]


def _refdcp_orders(
    impl: ModuleType, world: int, fail: bool = False, directory: Path | None = None
) -> tuple[list[Log], list[Log]]:
    spies = _Spies(world, directory)
    ckpt = CKPT if directory is None else str(directory)

    def save(comm: Any) -> Any:
        r = comm.rank
        fault = None
        if fail:

            def fault(i: int, action: Any) -> None:
                if r == world - 1 and action.phase == "write":
                    raise RuntimeError("injected")

        try:
            return impl.save(
                _state(r),
                checkpoint_id=ckpt,
                storage_writer=spies.writer(r),
                planner=spies.planner(impl.DefaultSavePlanner, r),
                comm=comm,
                fault=fault,
            )
        except refdcp.CheckpointError as exc:
            if not fail:
                raise
            return exc

    FakeWorld(world).run(save)
    saves = [list(log) for log in spies.logs]
    if fail:
        return saves, []
    spies.clear()

    def load(comm: Any) -> None:
        r = comm.rank
        impl.load(
            _state(r),
            checkpoint_id=CKPT,
            storage_reader=spies.reader(r),
            planner=spies.planner(impl.DefaultLoadPlanner, r),
            comm=comm,
        )

    FakeWorld(world).run(load)
    return saves, [list(log) for log in spies.logs]


def _without(log: Log, names: set[str]) -> Log:
    return [c for c in log if c not in names]


@pytest.mark.spec("PROTO-14", "PROTO-15")
def test_torch_calls_storage_in_the_order_the_contracts_list() -> None:
    save, load = _torch_orders()
    assert save == WRITER_ORDER
    assert load == READER_ORDER


@pytest.mark.spec("PROTO-14", "PROTO-15")
@pytest.mark.parametrize("world", [1, 3])
def test_the_conformance_driver_follows_torchs_order(
    world: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch_save, torch_load = _torch_orders()
    saves, loads = _drive_orders(world, monkeypatch)
    assert saves[0] == torch_save and loads[0] == torch_load
    for r in range(1, world):
        assert saves[r] == _without(torch_save, COORDINATOR_ONLY)
        assert loads[r] == _without(torch_load, COORDINATOR_ONLY)


@pytest.mark.spec("PROTO-14", "PROTO-15", "PROTO-16")
@pytest.mark.parametrize("world", [1, 3])
def test_refdcp_calls_storage_in_torchs_order_plus_set_verify(world: int, impl: ModuleType) -> None:
    torch_save, torch_load = _torch_orders()
    saves, loads = _refdcp_orders(impl, world)
    for r in range(world):
        want_save = torch_save if r == 0 else _without(torch_save, COORDINATOR_ONLY)
        want_load = torch_load if r == 0 else _without(torch_load, COORDINATOR_ONLY)
        assert saves[r] == want_save  # no abort_save after a save that returned
        assert _without(loads[r], REFDCP_ONLY) == want_load
        # set_verify: once, right after reset, before read_metadata
        assert loads[r][:3] == ["reset", "set_verify", "read_metadata"]
        assert loads[r].count("set_verify") == 1


@pytest.mark.spec("PROTO-16")
def test_abort_save_comes_after_the_protocol_on_every_rank_of_a_failed_save(
    tmp_path: Path,
    impl: ModuleType,
) -> None:
    torch_save, _ = _torch_orders()
    saves, _ = _refdcp_orders(impl, 3, fail=True, directory=tmp_path)
    assert not (tmp_path / ".metadata").exists()
    for r, log in enumerate(saves):
        assert log[-1] == "abort_save" and log.count("abort_save") == 1, (r, log)
        protocol = log[:-1]
        assert "finish" not in protocol
        # what ran before the failure is a prefix of torch's order for that rank
        want = torch_save if r == 0 else _without(torch_save, COORDINATOR_ONLY)
        assert protocol == want[: len(protocol)], (r, log)


@pytest.mark.spec("PROTO-16")
def test_no_protocol_row_names_a_call_refdcp_adds() -> None:
    for table in (SAVE, LOAD):
        text = repr(table)
        assert text, "the table renders"
        for name in REFDCP_ONLY:
            assert name not in text
