"""Which rank calls which planner and storage method, in which order, with what.

Recording subclasses of each implementation's planners (``impl``) and of the in-memory
storage log every protocol call; a save and a load run under ``FakeWorld`` (threads and
real collectives) on both implementations, and on the default path also under the
single-thread simulator, and the logs are checked against SAVE-1..5, LOAD-1..4 and
PROTO-2. ERR-2 and ERR-3 are checked on the error type at the end.
"""

from __future__ import annotations

import functools
import pickle
import threading
import traceback
from types import ModuleType
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.stateful import Stateful

import refdcp
from refdcp.comm import FakeWorld
from refdcp.driver import LoadContext, SaveContext, simulate
from refdcp.errors import CheckpointError, Failure
from refdcp.planning import DefaultLoadPlanner, DefaultSavePlanner
from refdcp.protocol import LOAD, SAVE
from refdcp.storage.memory import MemoryReader, MemoryStorage, MemoryWriter

Entry = tuple[int, str, Any]
WORLD = 3


def _keys(plan: Any) -> list[str]:
    out = set()
    for item in plan.items:
        index = item.index if hasattr(item, "index") else item.dest_index
        out.add(index.fqn)
    return sorted(out)


def _arg(args: tuple[Any, ...], kwargs: dict[str, Any], i: int, *names: str) -> Any:
    for n in names:
        if n in kwargs:
            return kwargs[n]
    return args[i]


def _summary(name: str, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> Any:
    if name in ("create_local_plan", "prepare_local_plan", "finish_plan"):
        return _keys(out)
    if name in ("create_global_plan", "prepare_global_plan"):
        plans = out[0] if isinstance(out, tuple) else out
        return (
            [_keys(p) for p in _arg(args, kwargs, 0, "plans", "all_plans")],
            [_keys(p) for p in plans],
        )
    if name in ("write_data", "read_data"):
        return _keys(_arg(args, kwargs, 0, "plan"))
    if name == "finish":
        return len(_arg(args, kwargs, 1, "results"))
    if name in ("set_up_storage_writer", "set_up_storage_reader", "set_up_planner"):
        where = {"set_up_storage_writer": 0, "set_up_storage_reader": 1, "set_up_planner": 2}
        coord = _arg(args, kwargs, where[name], "is_coordinator")
        return (bool(coord), sorted(k for k in kwargs if k != "is_coordinator"))
    return None


_METHODS = (
    "set_up_planner",
    "create_local_plan",
    "create_global_plan",
    "finish_plan",
    "set_up_storage_writer",
    "set_up_storage_reader",
    "prepare_local_plan",
    "prepare_global_plan",
    "write_data",
    "read_data",
    "finish",
    "storage_meta",
    "read_metadata",
)


def _recording(cls: type, tag: str) -> type:
    """A subclass of ``cls`` that appends ``(rank, "tag.method", summary)`` to ``self.log``."""

    def make(name: str) -> Any:
        @functools.wraps(getattr(cls, name))  # keeps the signature the driver inspects
        def method(self: Any, *args: Any, **kwargs: Any) -> Any:
            out = getattr(super(sub, self), name)(*args, **kwargs)
            with self.lock:
                self.log.append((self.rank, f"{tag}.{name}", _summary(name, args, kwargs, out)))
            return out

        return method

    attrs = {n: make(n) for n in _METHODS if callable(getattr(cls, n, None))}
    sub = type(f"Recording{cls.__name__}", (cls,), attrs)
    return sub


RSavePlanner = _recording(DefaultSavePlanner, "planner")
RLoadPlanner = _recording(DefaultLoadPlanner, "planner")
RWriter = _recording(MemoryWriter, "writer")
RReader = _recording(MemoryReader, "reader")
#: recording planners of each implementation, by module name
_PLANNERS: dict[str, tuple[type, type]] = {
    refdcp.__name__: (RSavePlanner, RLoadPlanner),
}


def _planners(impl: ModuleType) -> tuple[type, type]:
    if impl.__name__ not in _PLANNERS:
        _PLANNERS[impl.__name__] = (
            _recording(impl.DefaultSavePlanner, "planner"),
            _recording(impl.DefaultLoadPlanner, "planner"),
        )
    return _PLANNERS[impl.__name__]


def _tag(obj: Any, rank: int, log: list[Entry], lock: threading.Lock) -> Any:
    obj.rank, obj.log, obj.lock = rank, log, lock
    return obj


class Counter(Stateful):
    def __init__(self, n: int) -> None:
        self.n = n
        self.loaded: list[int] = []

    def state_dict(self) -> dict[str, Any]:
        return {"n": torch.tensor(self.n)}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.loaded.append(int(sd["n"]))


def state(rank: int) -> dict[str, Any]:
    return {
        "shared": torch.arange(6.0),
        f"own{rank}": torch.full((2,), float(rank)),
        "counter": Counter(10),
    }


def dest(rank: int) -> dict[str, Any]:
    return {"shared": torch.zeros(6), f"own{rank}": torch.zeros(2), "counter": Counter(0)}


_LOGS: dict[str, tuple[list[Entry], list[Entry], list[dict[str, Any]]]] = {}


def _save_and_load_fakeworld(
    impl: ModuleType,
) -> tuple[list[Entry], list[Entry], list[dict[str, Any]]]:
    """The call logs of one FakeWorld save and load through ``impl``, made once per module."""
    if impl.__name__ in _LOGS:
        return _LOGS[impl.__name__]
    save_planner, load_planner = _planners(impl)
    storage = MemoryStorage()
    save_log: list[Entry] = []
    load_log: list[Entry] = []
    lock = threading.Lock()
    dests = [dest(r) for r in range(WORLD)]

    def save_rank(comm: Any) -> Any:
        r = comm.rank
        w = _tag(RWriter(storage, "ck"), r, save_log, lock)
        p = _tag(save_planner(), r, save_log, lock)
        return impl.save(state(r), storage_writer=w, planner=p, comm=comm)

    def load_rank(comm: Any) -> None:
        r = comm.rank
        rd = _tag(RReader(storage, "ck"), r, load_log, lock)
        p = _tag(load_planner(), r, load_log, lock)
        impl.load(dests[r], storage_reader=rd, planner=p, comm=comm)

    FakeWorld(WORLD).run(save_rank)
    FakeWorld(WORLD).run(load_rank)
    _LOGS[impl.__name__] = (save_log, load_log, dests)
    return _LOGS[impl.__name__]


@pytest.fixture(scope="module")
def fakeworld_logs(impl: ModuleType) -> tuple[list[Entry], list[Entry], list[dict[str, Any]]]:
    """The logs of ``impl``: every test that takes them runs on both implementations."""
    return _save_and_load_fakeworld(impl)


def _calls(log: list[Entry], rank: int) -> list[str]:
    return [n for r, n, _ in log if r == rank]


def _one(log: list[Entry], rank: int, name: str) -> Any:
    hits = [s for r, n, s in log if r == rank and n == name]
    assert len(hits) == 1, f"rank {rank} called {name} {len(hits)} times"
    return hits[0]


def _before(seq: list[str], a: str, b: str) -> bool:
    return a in seq and b in seq and seq.index(a) < seq.index(b)


@pytest.mark.spec("SAVE-1")
def test_save_set_up_calls(fakeworld_logs: Any) -> None:
    log = fakeworld_logs[0]
    for r in range(WORLD):
        seq = _calls(log, r)
        assert _before(seq, "writer.storage_meta", "planner.set_up_planner")
        coord, _ = _one(log, r, "planner.set_up_planner")
        assert coord == (r == 0)
        w_coord, kwargs = _one(log, r, "writer.set_up_storage_writer")
        assert w_coord == (r == 0)
        # MemoryWriter accepts **kwargs, so it is told its rank and use_collectives
        assert kwargs == ["rank", "use_collectives"]


@pytest.mark.spec("SAVE-2", "SAVE-3")
def test_save_plans_flow_through_the_coordinator(fakeworld_logs: Any) -> None:
    log = fakeworld_logs[0]
    local = {r: _one(log, r, "writer.prepare_local_plan") for r in range(WORLD)}
    for r in range(WORLD):
        seq = _calls(log, r)
        assert _before(seq, "planner.create_local_plan", "writer.prepare_local_plan")
        assert f"own{r}" in local[r]
        if r != 0:
            assert "planner.create_global_plan" not in seq
            assert "writer.prepare_global_plan" not in seq
    gathered, _ = _one(log, 0, "planner.create_global_plan")
    assert gathered == [local[r] for r in range(WORLD)]  # gathered in rank order
    _, storage_plans = _one(log, 0, "writer.prepare_global_plan")
    assert _before(_calls(log, 0), "planner.create_global_plan", "writer.prepare_global_plan")
    # plan i reaches rank i: what each rank finishes is the coordinator's plan i
    for r in range(WORLD):
        assert _one(log, r, "planner.finish_plan") == storage_plans[r]
    # dedup: "shared" is in every local plan but written by exactly one rank
    assert sum("shared" in p for p in storage_plans) == 1


@pytest.mark.spec("SAVE-4", "SAVE-5")
def test_save_writes_only_the_received_plan(fakeworld_logs: Any) -> None:
    log = fakeworld_logs[0]
    for r in range(WORLD):
        seq = _calls(log, r)
        assert _before(seq, "planner.finish_plan", "writer.write_data")
        assert _one(log, r, "writer.write_data") == _one(log, r, "planner.finish_plan")
        if r == 0:
            assert _before(seq, "writer.write_data", "writer.finish")
            assert _one(log, 0, "writer.finish") == WORLD  # one result list per rank
        else:
            assert "writer.finish" not in seq


@pytest.mark.spec("LOAD-1")
def test_load_set_up_calls(fakeworld_logs: Any) -> None:
    log, dests = fakeworld_logs[1], fakeworld_logs[2]
    for r in range(WORLD):
        seq = _calls(log, r)
        assert _before(seq, "reader.read_metadata", "planner.set_up_planner")
        assert _before(seq, "reader.read_metadata", "reader.set_up_storage_reader")
        assert _one(log, r, "planner.set_up_planner")[0] == (r == 0)
        assert _one(log, r, "reader.set_up_storage_reader")[0] is False or r == 0
        assert dests[r]["counter"].loaded == [10]


@pytest.mark.spec("LOAD-2", "LOAD-3", "LOAD-4")
def test_load_plans_flow_through_the_coordinator(fakeworld_logs: Any) -> None:
    log, dests = fakeworld_logs[1], fakeworld_logs[2]
    local = {r: _one(log, r, "reader.prepare_local_plan") for r in range(WORLD)}
    for r in range(WORLD):
        seq = _calls(log, r)
        assert _before(seq, "planner.create_local_plan", "reader.prepare_local_plan")
        if r != 0:
            assert "planner.create_global_plan" not in seq
            assert "reader.prepare_global_plan" not in seq
        assert _before(seq, "planner.finish_plan", "reader.read_data")
        assert _one(log, r, "reader.read_data") == _one(log, r, "planner.finish_plan")
        assert torch.equal(dests[r]["shared"], torch.arange(6.0))
        assert torch.equal(dests[r][f"own{r}"], torch.full((2,), float(r)))
    gathered, _ = _one(log, 0, "planner.create_global_plan")
    assert gathered == [local[r] for r in range(WORLD)]
    _, plans = _one(log, 0, "reader.prepare_global_plan")
    for r in range(WORLD):
        assert _one(log, r, "planner.finish_plan") == plans[r]


@pytest.mark.spec("PROTO-2")
def test_simulator_and_communicator_driver_make_the_same_calls() -> None:
    """Both drivers execute the same actions: per rank, the same calls in the same order."""
    # single path: the simulator drives the default path's step bodies (SaveContext/LoadContext)
    storage = MemoryStorage()
    log: list[Entry] = []
    lock = threading.Lock()
    saves = [
        SaveContext(
            rank=r,
            world_size=WORLD,
            coordinator=r == 0,
            state_dict=state(r),
            writer=_tag(RWriter(storage, "ck"), r, log, lock),
            planner=_tag(RSavePlanner(), r, log, lock),
        )
        for r in range(WORLD)
    ]
    assert not simulate(SAVE, saves).errors()
    load_log: list[Entry] = []
    loads = [
        LoadContext(
            rank=r,
            world_size=WORLD,
            coordinator=r == 0,
            state_dict=dest(r),
            reader=_tag(RReader(storage, "ck"), r, load_log, lock),
            planner=_tag(RLoadPlanner(), r, load_log, lock),
        )
        for r in range(WORLD)
    ]
    assert not simulate(LOAD, loads).errors()
    fw_save, fw_load, _ = _save_and_load_fakeworld(refdcp)
    for r in range(WORLD):
        assert _calls(log, r) == _calls(fw_save, r)
        assert _calls(load_log, r) == _calls(fw_load, r)
        assert [e for e in log if e[0] == r] == [e for e in fw_save if e[0] == r]


class _Unpicklable(Exception):
    def __init__(self) -> None:
        super().__init__("cannot travel")
        self.handle = threading.Lock()


def _failure(rank: int, exc: BaseException) -> Failure:
    try:
        raise exc
    except BaseException as e:
        return Failure.capture(rank, "write_data", e)


@pytest.mark.spec("ERR-2")
def test_checkpoint_error_is_both_exception_kinds() -> None:
    err = CheckpointError("save", {1: _failure(1, ValueError("disk full"))})
    assert isinstance(err, Exception) and isinstance(err, CheckpointException)
    assert set(err.failures) == {1}
    exc, stack = err.failures[1]
    assert isinstance(exc, ValueError) and str(exc) == "disk full"
    assert isinstance(stack, traceback.StackSummary)
    with pytest.raises(CheckpointException):
        raise err


@pytest.mark.spec("ERR-3")
def test_checkpoint_error_keeps_original_exceptions_and_tracebacks() -> None:
    f0 = _failure(0, KeyError("missing"))
    f2 = _failure(2, _Unpicklable())
    err = CheckpointError("load", {2: f2, 0: f0}, committed=False)
    assert list(err.rank_failures) == [0, 2]
    assert isinstance(err.rank_failures[0].exception, KeyError)
    # the unpicklable exception became a RuntimeError carrying its type and message
    e2 = err.rank_failures[2].exception
    assert isinstance(e2, RuntimeError) and "_Unpicklable" in str(e2) and "cannot travel" in str(e2)
    assert "_failure" in err.tracebacks[0] and "KeyError" in err.tracebacks[0]
    back = pickle.loads(pickle.dumps(err))
    assert isinstance(back, CheckpointError)
    assert back.step == "load" and back.committed is False
    assert back.tracebacks == err.tracebacks
    assert type(back.rank_failures[0].exception) is KeyError
    assert str(back) == str(err)


@pytest.mark.spec("ERR-3")
def test_refdcp_errors_survive_pickling() -> None:
    """Errors travel between ranks pickled; each must come back with the same message."""
    from refdcp.planning.load_policy import LoadPolicyError
    from refdcp.planning.metadata.build import PlanValidationError
    from refdcp.storage.errors import CorruptionError

    errors: list[BaseException] = [
        LoadPolicyError(["missing keys: ['a']", "'b': dtype"]),
        PlanValidationError(["'w': chunks overlap"]),
        CorruptionError("checksum mismatch", fqn="w", file="__0_0.distcp", offset=64),
    ]
    for err in errors:
        back = pickle.loads(pickle.dumps(err))
        assert type(back) is type(err) and str(back) == str(err)
        assert getattr(back, "problems", None) == getattr(err, "problems", None)


@pytest.mark.spec("LOAD-1", "FLAT-3")
def test_load_accepts_top_level_keys_of_mixed_types(impl: ModuleType) -> None:
    storage = MemoryStorage()
    sd: dict[Any, Any] = {"a": torch.ones(2), 1: torch.full((2,), 2.0), None: 7}
    impl.save(sd, storage_writer=storage.writer("mixed"), no_dist=True)
    out: dict[Any, Any] = {"a": torch.zeros(2), 1: torch.zeros(2), None: 0}
    impl.load(out, storage_reader=storage.reader("mixed"), no_dist=True)
    assert list(out) == ["a", 1, None]
    assert torch.equal(out["a"], torch.ones(2)) and torch.equal(out[1], torch.full((2,), 2.0))
    assert out[None] == 7


@pytest.mark.spec("PROTO-7", "ERR-1")
@pytest.mark.timeout(60)
def test_a_fault_hook_that_keeps_raising_ends_in_an_error(impl: ModuleType) -> None:
    storage = MemoryStorage()

    def always(index: int, action: Any) -> None:
        if index >= 2:
            raise RuntimeError("injected, every time")

    def rank(comm: Any) -> Any:
        hook = always if comm.rank == 1 else None
        return impl.save(
            state(comm.rank), storage_writer=storage.writer("spin"), comm=comm, fault=hook
        )

    out = FakeWorld(3, timeout=20).run(rank, return_exceptions=True)
    assert all(isinstance(e, CheckpointError) for e in out)
    assert all(list(e.rank_failures) == [1] and not e.committed for e in out)
    assert not storage.exists("spin")
