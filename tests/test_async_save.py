"""async_save with the thread executor, on both implementations (ASYNC-1..ASYNC-5, ASYNC-8,
ASYNC-11, ASYNC-12, ASYNC-16, REF-6, REF-11, REF-12).

Every test taking ``impl`` runs once on ``refdcp`` and once on ``refdcp.reference``
(the ``impl`` fixture, REF-6); the tests without it check the fast path's cached
buffers, which the reference does not have (REF-10).
"""

from __future__ import annotations

import inspect
import threading
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.stateful import Stateful

import refdcp
import refdcp.reference
from refdcp.asyncsave.save import InFlightLimiter as FastLimiter
from refdcp.comm import FakeWorld, SingleRank
from refdcp.errors import CheckpointError
from refdcp.planning.errors import UnloadableValueError
from refdcp.staging import CpuStager, State


def _limiter(impl: ModuleType, max_in_flight: int = 1, wait_timeout: float = 60.0) -> Any:
    """The implementation's own in-flight limiter (ASYNC-5)."""
    cls = refdcp.reference.InFlightLimiter if impl is refdcp.reference else FastLimiter
    return cls(max_in_flight=max_in_flight, wait_timeout=wait_timeout)


def _other(impl: ModuleType) -> ModuleType:
    return refdcp.reference if impl is refdcp else refdcp


def _load(impl: ModuleType, path: Path | str, like: dict[str, Any]) -> dict[str, Any]:
    out = {k: torch.empty_like(v) if isinstance(v, torch.Tensor) else v for k, v in like.items()}
    impl.load(out, checkpoint_id=str(path), comm=SingleRank())
    return out


@pytest.mark.spec("ASYNC-1", "ASYNC-2", "REF-11")
def test_handle_futures_and_isolation(impl: ModuleType, tmp_path: Path) -> None:
    w = torch.randn(32)
    expected = w.clone()
    handle = impl.async_save({"w": w, "step": 3}, checkpoint_id=str(tmp_path), no_dist=True)
    assert handle.staged.done()  # blocking default stager: staged before return
    w.add_(1)
    md = handle.result(timeout=60)
    assert isinstance(md, Metadata) and handle.committed.result() is md
    assert handle.done() and handle.exception() is None
    assert "w" in md.state_dict_metadata
    out = _load(impl, tmp_path, {"w": w, "step": 0})
    assert torch.equal(out["w"], expected) and out["step"] == 3


@pytest.mark.spec("REF-11")
def test_the_reference_takes_refdcps_arguments() -> None:
    fast = inspect.signature(refdcp.async_save).parameters
    ref = inspect.signature(refdcp.reference.async_save).parameters
    assert list(ref) == list(fast)
    assert [(p.kind, p.default) for p in ref.values()] == [
        (p.kind, p.default) for p in fast.values()
    ]
    handle_api = {n for n in dir(refdcp.AsyncSaveHandle) if not n.startswith("_")}
    assert handle_api <= {n for n in dir(refdcp.reference.AsyncSaveHandle)}


@pytest.mark.spec("REF-11", "API-11")
def test_torchs_spellings_of_stager_and_executor(impl: ModuleType, tmp_path: Path) -> None:
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    stager = impl.CpuStager()
    w = torch.arange(5.0)
    handle = impl.async_save(
        {"w": w},
        checkpoint_id=str(tmp_path),
        async_stager=stager,
        async_checkpointer_type=AsyncCheckpointerType.THREAD,
        no_dist=True,
    )
    handle.result(timeout=60)
    assert torch.equal(_load(impl, tmp_path, {"w": w})["w"], w)
    with pytest.raises(ValueError, match="stager once"):
        impl.async_save(
            {"w": w}, checkpoint_id=str(tmp_path), stager=stager, async_stager=impl.CpuStager()
        )


class _Counter(Stateful):
    """A Stateful that cannot be deep-copied: only its state_dict() may be staged."""

    def __init__(self) -> None:
        self.n = torch.tensor([5])
        self.lock = threading.Lock()

    def state_dict(self) -> dict[str, Any]:
        return {"n": self.n}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.n.copy_(sd["n"])


@pytest.mark.spec("ASYNC-12")
def test_stateful_values_are_unwrapped(impl: ModuleType, tmp_path: Path) -> None:
    c = _Counter()
    impl.async_save({"c": c}, checkpoint_id=str(tmp_path), no_dist=True).result(timeout=60)
    c.n.fill_(0)
    impl.load({"c": c}, checkpoint_id=str(tmp_path), comm=SingleRank())
    assert c.n.item() == 5


class _Recording(AsyncStager):
    """A stager that counts its ``stage`` calls."""

    _synchronize_after_execute = False

    def __init__(self) -> None:
        self.calls = 0

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        self.calls += 1
        return {k: v.clone() for k, v in state_dict.items()}

    def synchronize_staging(self) -> None:
        pass


@pytest.mark.spec("ASYNC-11", "REF-12")
def test_unknown_executor_fails_before_staging(impl: ModuleType, tmp_path: Path) -> None:
    stager = _Recording()
    with pytest.raises(ValueError, match="executor"):
        impl.async_save(
            {"w": torch.zeros(1)}, checkpoint_id=str(tmp_path), executor="gpu", stager=stager
        )
    assert stager.calls == 0 and not any(tmp_path.iterdir())


@pytest.mark.spec("REF-12")
@pytest.mark.parametrize("spelling", ["executor", "async_checkpointer_type"])
def test_the_reference_refuses_the_process_executor(tmp_path: Path, spelling: str) -> None:
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    stager = _Recording()
    kind = "process" if spelling == "executor" else AsyncCheckpointerType.PROCESS
    with pytest.raises(ValueError, match="thread only"):
        refdcp.reference.async_save(
            {"w": torch.zeros(1)},
            checkpoint_id=str(tmp_path),
            stager=stager,
            no_dist=True,
            **{spelling: kind},
        )
    assert stager.calls == 0 and not any(tmp_path.iterdir())


@pytest.mark.spec("ASYNC-5")
def test_in_flight_bound_blocks_then_times_out(impl: ModuleType, tmp_path: Path) -> None:
    gate = threading.Event()

    def gated_save(sd: dict[str, Any], **kw: Any) -> Metadata:
        assert gate.wait(30)
        result: Metadata = impl.save(sd, **kw)
        return result

    limiter = _limiter(impl, max_in_flight=1, wait_timeout=0.2)
    h1 = impl.async_save(
        {"w": torch.zeros(2)},
        checkpoint_id=str(tmp_path / "a"),
        no_dist=True,
        limiter=limiter,
        save_fn=gated_save,
    )
    assert limiter.in_flight == 1
    stager = _Recording()
    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        impl.async_save(
            {"w": torch.zeros(2)},
            checkpoint_id=str(tmp_path / "b"),
            no_dist=True,
            limiter=limiter,
            stager=stager,
        )
    assert time.monotonic() - t0 >= 0.2 and limiter.in_flight == 1
    assert not (tmp_path / "b").exists() and stager.calls == 0  # nothing was started
    limiter.wait_timeout = 30.0
    started: list[float] = []

    def second() -> None:
        h = impl.async_save(
            {"w": torch.ones(2)}, checkpoint_id=str(tmp_path / "c"), no_dist=True, limiter=limiter
        )
        started.append(time.monotonic())
        h.result(timeout=60)

    t = threading.Thread(target=second)
    t.start()
    time.sleep(0.2)
    assert not started  # blocked behind the first save
    gate.set()
    h1.result(timeout=60)
    t.join(60)
    assert started and limiter.in_flight == 0
    assert torch.equal(_load(impl, tmp_path / "c", {"w": torch.zeros(2)})["w"], torch.ones(2))


@pytest.mark.spec("ASYNC-5")
def test_one_save_in_flight_per_communicator_by_default(impl: ModuleType, tmp_path: Path) -> None:
    """Without a limiter a second save over the same comm waits for the first; another comm does not."""
    gate = threading.Event()

    def gated_save(sd: dict[str, Any], **kw: Any) -> Metadata:
        assert gate.wait(30)
        result: Metadata = impl.save(sd, **kw)
        return result

    comm, other = SingleRank(), SingleRank()
    first = impl.async_save(
        {"w": torch.zeros(2)}, checkpoint_id=str(tmp_path / "a"), comm=comm, save_fn=gated_save
    )
    elsewhere = impl.async_save({"w": torch.ones(2)}, checkpoint_id=str(tmp_path / "o"), comm=other)
    elsewhere.result(timeout=60)  # its own limiter: not held up by the first save
    stager = _Recording()
    started = threading.Event()

    def second() -> None:
        impl.async_save(
            {"w": torch.ones(2)}, checkpoint_id=str(tmp_path / "b"), comm=comm, stager=stager
        ).result(timeout=60)
        started.set()

    t = threading.Thread(target=second)
    t.start()
    time.sleep(0.2)
    assert stager.calls == 0 and not first.done()  # waiting before staging
    gate.set()
    first.result(timeout=60)
    t.join(60)
    assert started.is_set() and stager.calls == 1
    # no comm: one save in flight in the whole process
    gate.clear()
    first = impl.async_save(
        {"w": torch.zeros(2)}, checkpoint_id=str(tmp_path / "p"), no_dist=True, save_fn=gated_save
    )
    later = _Recording()

    def third() -> None:
        impl.async_save(
            {"w": torch.ones(2)}, checkpoint_id=str(tmp_path / "q"), no_dist=True, stager=later
        ).result(timeout=60)

    t = threading.Thread(target=third)
    t.start()
    time.sleep(0.2)
    assert later.calls == 0 and not first.done()  # the process's one slot is taken
    gate.set()
    first.result(timeout=60)
    t.join(60)
    assert later.calls == 1


@pytest.mark.spec("ASYNC-5")
def test_a_limiter_needs_a_slot(impl: ModuleType) -> None:
    with pytest.raises(ValueError, match="at least 1"):
        _limiter(impl, max_in_flight=0)
    assert _limiter(impl, max_in_flight=1).in_flight == 0


@pytest.mark.spec("ASYNC-13")
def test_saves_over_one_comm_run_in_call_order(impl: ModuleType, tmp_path: Path) -> None:
    """Two saves in flight over one communicator: the second writes only after the first ended."""
    gate = threading.Event()
    events: list[str] = []

    def recorded(name: str, wait: bool) -> Any:
        def save_fn(sd: dict[str, Any], **kw: Any) -> Metadata:
            events.append(f"{name} starts")
            if wait:
                assert gate.wait(30)
            result: Metadata = impl.save(sd, **kw)
            events.append(f"{name} ends")
            return result

        return save_fn

    comm = SingleRank()
    limiter = _limiter(impl, max_in_flight=2)
    first = impl.async_save(
        {"w": torch.zeros(2)},
        checkpoint_id=str(tmp_path / "a"),
        comm=comm,
        limiter=limiter,
        save_fn=recorded("first", True),
    )
    second = impl.async_save(
        {"w": torch.ones(2)},
        checkpoint_id=str(tmp_path / "b"),
        comm=comm,
        limiter=limiter,
        save_fn=recorded("second", False),
    )
    assert second.staged.done()  # staged while the first still writes
    time.sleep(0.2)
    assert events == ["first starts"]
    gate.set()
    first.result(timeout=60)
    second.result(timeout=60)
    assert events == ["first starts", "first ends", "second starts", "second ends"]


@pytest.mark.spec("REF-11", "REF-12")
@pytest.mark.parametrize("use_collectives", [True, False])
def test_what_save_fn_is_called_with(
    impl: ModuleType, tmp_path: Path, use_collectives: bool
) -> None:
    seen: list[dict[str, Any]] = []

    def record(sd: dict[str, Any], **kw: Any) -> Metadata:
        seen.append(kw)
        result: Metadata = impl.save(sd, checkpoint_id=kw["checkpoint_id"], comm=SingleRank())
        return result

    writer = None
    planner = (
        refdcp.DefaultSavePlanner() if impl is refdcp else refdcp.reference.ReferenceSavePlanner()
    )
    impl.async_save(
        {"w": torch.ones(2)},
        checkpoint_id=str(tmp_path),
        no_dist=True,
        planner=planner,
        use_collectives=use_collectives,
        executor="thread",
        save_fn=record,
    ).result(timeout=60)
    (kw,) = seen
    assert kw["checkpoint_id"] == str(tmp_path) and kw["storage_writer"] is writer
    assert kw["planner"] is planner
    assert ("use_collectives" in kw) is not use_collectives
    if "use_collectives" in kw:
        assert kw["use_collectives"] is False
    if impl is refdcp:
        assert kw["no_dist"] is True and "comm" not in kw
    else:  # REF-12: a one-rank communicator instead of no_dist=True
        assert isinstance(kw["comm"], SingleRank) and "no_dist" not in kw


@pytest.mark.spec("REF-11", "ASYNC-1")
def test_a_stager_that_asks_to_be_synchronized(impl: ModuleType, tmp_path: Path) -> None:
    class Synchronized(_Recording):
        _synchronize_after_execute = True

        def __init__(self) -> None:
            super().__init__()
            self.synchronized = 0

        def synchronize_staging(self) -> None:
            self.synchronized += 1

    stager = Synchronized()
    impl.async_save(
        {"w": torch.ones(2)}, checkpoint_id=str(tmp_path), no_dist=True, stager=stager
    ).result(timeout=60)
    assert stager.calls == 1 and stager.synchronized == 1
    again = impl.async_save(  # the same stager under both names is one stager
        {"w": torch.ones(2)},
        checkpoint_id=str(tmp_path),
        no_dist=True,
        stager=stager,
        async_stager=stager,
    )
    again.result(timeout=60)
    assert stager.calls == 2


@pytest.mark.spec("ASYNC-4", "ASYNC-3")
def test_the_slot_is_free_before_committed_resolves(impl: ModuleType, tmp_path: Path) -> None:
    limiter = _limiter(impl)
    seen: list[int] = []
    ok = impl.async_save(
        {"w": torch.randn(8)}, checkpoint_id=str(tmp_path / "ok"), no_dist=True, limiter=limiter
    )
    ok.add_done_callback(lambda f: seen.append(limiter.in_flight))
    ok.result(timeout=60)

    def boom(sd: dict[str, Any], **kw: Any) -> Metadata:
        raise OSError("disk gone")

    bad = impl.async_save(
        {"w": torch.randn(8)},
        checkpoint_id=str(tmp_path / "bad"),
        no_dist=True,
        limiter=limiter,
        save_fn=boom,
    )
    bad.add_done_callback(lambda f: seen.append(limiter.in_flight))
    assert isinstance(bad.exception(timeout=60), OSError)
    with pytest.raises(OSError, match="disk gone"):
        bad.result()
    time.sleep(0.05)
    assert seen == [0, 0]
    again = impl.async_save(
        {"w": torch.randn(8)}, checkpoint_id=str(tmp_path / "again"), no_dist=True, limiter=limiter
    )
    again.result(timeout=60)


@pytest.mark.spec("ASYNC-4")
def test_cached_buffers_released_before_commit_resolves(tmp_path: Path) -> None:
    """refdcp's cached stager: the lease ends before ``committed`` resolves, and is reused."""
    stager = CpuStager(cache_staged_state_dict=True)
    seen: list[list[State]] = []
    assert stager.pool is not None
    pool = stager.pool

    def record(f: object) -> None:
        seen.append(pool.states())

    h = refdcp.async_save(
        {"w": torch.randn(8)}, checkpoint_id=str(tmp_path / "ok"), no_dist=True, stager=stager
    )
    h.add_done_callback(record)
    h.result(timeout=60)

    def boom(sd: dict[str, Any], **kw: Any) -> Metadata:
        raise OSError("disk gone")

    bad = refdcp.async_save(
        {"w": torch.randn(8)},
        checkpoint_id=str(tmp_path / "bad"),
        no_dist=True,
        stager=stager,
        save_fn=boom,
    )
    bad.add_done_callback(record)
    assert isinstance(bad.exception(timeout=60), OSError)
    time.sleep(0.05)
    assert seen == [[State.RELEASED], [State.RELEASED]]
    assert pool.allocations == 1  # the second save reused the first one's buffers
    stager.close()


def _isolation_stager(impl: ModuleType, in_flight: int) -> Any:
    if impl is refdcp:  # cached buffers, one set per save in flight
        return CpuStager(cache_staged_state_dict=True, max_buffer_sets=in_flight)
    return refdcp.reference.ReferenceStager()


@pytest.mark.spec("ASYNC-8", "STAGE-6", "ASYNC-2", "REF-6")
@given(
    schedule=st.lists(
        st.tuples(st.integers(-3, 3), st.floats(0, 0.02), st.integers(0, 2)), min_size=1, max_size=4
    ),
    in_flight=st.integers(1, 3),
)
def test_staging_isolation_property(
    impl: ModuleType,
    tmp_path_factory: pytest.TempPathFactory,
    schedule: list[tuple[int, float, int]],
    in_flight: int,
) -> None:
    """Random source mutations after `staged` never reach a checkpoint; every checkpoint
    holds the values of its own staging time, with saves in flight."""
    root = tmp_path_factory.mktemp("iso")
    stager = _isolation_stager(impl, in_flight)
    limiter = _limiter(impl, max_in_flight=in_flight)
    model = {"a": torch.zeros(6), "b": torch.zeros(2, 3, dtype=torch.float64)}

    def delayed(seconds: float) -> Any:
        def slow_save(sd: dict[str, Any], **kw: Any) -> Metadata:
            time.sleep(seconds)
            result: Metadata = impl.save(sd, **kw)
            return result

        return slow_save

    handles, expected = [], []
    for i, (value, delay, mutations) in enumerate(schedule):
        model["a"].fill_(value)
        model["b"].fill_(value * 10)
        expected.append({k: v.clone() for k, v in model.items()})
        h = impl.async_save(
            model,
            checkpoint_id=str(root / f"c{i}"),
            no_dist=True,
            stager=stager,
            limiter=limiter,
            save_fn=delayed(delay),
        )
        h.staged.result(timeout=30)
        for m in range(mutations):  # the training loop mutates in place right away
            model["a"].add_(100 + m)
            model["b"].mul_(-1)
        handles.append(h)
    for h in handles:
        h.result(timeout=60)
    for i, exp in enumerate(expected):
        got = _load(impl, root / f"c{i}", exp)
        for k in exp:
            assert torch.equal(got[k], exp[k]), (i, k)
    if impl is refdcp:
        assert stager.pool is not None and stager.pool.allocations <= in_flight
    stager.close()


class FailingWriter(FileSystemWriter):
    """A filesystem writer whose write_data raises (injected storage error)."""

    def write_data(self, plan: Any, planner: Any) -> Any:
        raise OSError("injected storage failure")


@pytest.mark.spec("ASYNC-3", "ASYNC-5")
def test_background_failure_on_every_rank_then_next_save_succeeds(
    impl: ModuleType, tmp_path: Path
) -> None:
    def one_rank(comm: Any, path: str, fail_rank: int | None) -> BaseException | None:
        writer_cls = FailingWriter if comm.rank == fail_rank else FileSystemWriter
        sd = {f"r{comm.rank}": torch.full((4,), float(comm.rank)), "shared": torch.ones(3)}
        h = impl.async_save(
            sd,
            storage_writer=writer_cls(path),
            comm=comm,
            stager=impl.CpuStager(),  # default limiter: one save in flight per comm (ASYNC-5)
        )
        exc: BaseException | None = h.exception(timeout=60)
        return exc

    bad = str(tmp_path / "bad")
    errs = FakeWorld(2).run(one_rank, bad, 1, timeout=60)
    assert all(isinstance(e, CheckpointError) for e in errs)
    assert all(1 in e.rank_failures for e in errs if isinstance(e, CheckpointError))
    assert not (Path(bad) / ".metadata").exists()
    good = str(tmp_path / "good")
    assert FakeWorld(2).run(one_rank, good, None, timeout=60) == [None, None]
    assert (Path(good) / ".metadata").exists()
    out = {"r0": torch.empty(4), "r1": torch.empty(4), "shared": torch.empty(3)}
    impl.load(out, checkpoint_id=good, comm=SingleRank())
    assert out["r1"].tolist() == [1.0] * 4


def _writer_failing_at_commit(impl: ModuleType, path: Path) -> Any:
    """The implementation's own writer, failing after its data files are written."""
    base = refdcp.reference.ReferenceWriter if impl is refdcp.reference else refdcp.FileSystemWriter

    class FailsAtCommit(base):  # type: ignore[misc, valid-type]
        def finish(self, metadata: Any, results: Any) -> None:
            raise OSError("injected failure at commit")

    return FailsAtCommit(path)


@pytest.mark.spec("ASYNC-3", "ASYNC-17", "REF-11")
def test_failures_surface_and_the_previous_checkpoint_stays_loadable(
    impl: ModuleType, tmp_path: Path
) -> None:
    """A failed staging and a failed background write leave the last commit in place."""
    w = torch.arange(6.0)
    impl.async_save({"w": w, "step": 1}, checkpoint_id=str(tmp_path), no_dist=True).result(60)
    # staging fails on the caller, names the key, starts nothing (ASYNC-17)
    with pytest.raises(UnloadableValueError, match=r"'opt\.lock'"):
        impl.async_save(
            {"w": w * 2, "opt": {"lock": threading.Lock()}},
            checkpoint_id=str(tmp_path),
            no_dist=True,
        )
    # the write fails in the background: committed carries it (ASYNC-3)
    failed = impl.async_save(
        {"w": w * 3, "step": 3},
        storage_writer=_writer_failing_at_commit(impl, tmp_path),
        no_dist=True,
    )
    assert failed.staged.result(timeout=60) is None
    error = failed.exception(timeout=60)
    assert isinstance(error, CheckpointError) and "injected failure at commit" in str(error)
    for reader in (impl, _other(impl)):
        out = _load(reader, tmp_path, {"w": w, "step": 0})
        assert torch.equal(out["w"], w) and out["step"] == 1  # the previous commit
    # and the next save goes through (the slot was released both times)
    impl.async_save({"w": w * 4, "step": 4}, checkpoint_id=str(tmp_path), no_dist=True).result(60)
    assert _load(impl, tmp_path, {"w": w, "step": 0})["step"] == 4


@pytest.mark.spec("STAGE-18", "ASYNC-2", "REF-11")
def test_a_stager_that_copies_in_the_background(impl: ModuleType, tmp_path: Path) -> None:
    """A stager returning a Future: ``staged`` follows it, a failed copy fails ``committed``."""
    stager = CpuStager(background_copy=True)
    src = {"w": torch.arange(1 << 14, dtype=torch.float32), "step": 5}
    expected = src["w"].clone()
    handle = impl.async_save(src, checkpoint_id=str(tmp_path / "ok"), no_dist=True, stager=stager)
    assert handle.staged.result(timeout=60) is None
    src["w"].mul_(-1)  # after staged: never reaches the checkpoint
    handle.result(timeout=60)
    out = _load(impl, tmp_path / "ok", {"w": expected, "step": 0})
    assert torch.equal(out["w"], expected) and out["step"] == 5
    bad = impl.async_save(
        {"w": src["w"], "lock": threading.Lock()},
        checkpoint_id=str(tmp_path / "bad"),
        no_dist=True,
        stager=stager,
    )
    assert isinstance(bad.staged.exception(timeout=60), UnloadableValueError)
    assert isinstance(bad.exception(timeout=60), UnloadableValueError)
    assert not (tmp_path / "bad" / ".metadata").exists()
    stager.close()


@pytest.mark.spec("ASYNC-16")
def test_fresh_snapshot_is_freed_without_the_garbage_collector(
    impl: ModuleType, tmp_path: Path
) -> None:
    import gc

    marker = 123_457  # an unusual numel to find the copies by
    src = {"a": torch.ones(marker), "nested": {"b": [torch.zeros(marker)]}}

    def copies() -> list[torch.Tensor]:
        return [
            o
            for o in gc.get_objects()
            if isinstance(o, torch.Tensor)
            and o.numel() == marker
            and o is not src["a"]
            and o is not src["nested"]["b"][0]
        ]

    at_commit: list[int] = []
    gc.collect()
    gc.disable()
    try:
        # a fresh copy per save (the fast default stager keeps its buffers: ASYNC-30)
        handle = impl.async_save(
            src, checkpoint_id=str(tmp_path), no_dist=True, stager=impl.CpuStager()
        )
        handle.add_done_callback(lambda f: at_commit.append(len(copies())))
        handle.result(timeout=60)
        del handle
        deadline = time.monotonic() + 5
        while copies() and time.monotonic() < deadline:
            time.sleep(0.05)  # the callback may have run on this thread, before the end
        assert copies() == []
        assert at_commit == [0]  # already gone when committed resolved
    finally:
        gc.enable()


def _cross_rank(comm: Any, impl_name: str, path: str, world: int) -> None:
    """One rank's save: a replicated layer, row-sharded LocalShards, a step, nested state."""
    impl = refdcp if impl_name == "refdcp" else refdcp.reference
    rows = 8 // world
    table = torch.arange(8 * 3, dtype=torch.float32).reshape(8, 3)
    shard = table[comm.rank * rows : (comm.rank + 1) * rows].clone()
    sd = {
        "layer": {"weight": torch.ones(2, 2) * 7, "bias": torch.tensor([1.0, -1.0])},
        "emb": refdcp.LocalShards((8, 3), [((comm.rank * rows, 0), shard)]),
        "step": 11,
        "optim": {"state": {"layer.weight": {"exp_avg": torch.full((2, 2), 0.5)}}, "lr": [0.1]},
    }
    handle = impl.async_save(sd, checkpoint_id=path, comm=comm, stager=impl.CpuStager())
    handle.staged.result(timeout=60)
    shard.zero_()  # the training step after staging: never reaches the checkpoint
    sd["layer"]["weight"].add_(1)
    handle.result(timeout=60)


@pytest.mark.spec("REF-11", "REF-2")
@pytest.mark.parametrize("world", [1, 2])
def test_an_async_save_through_either_loads_in_the_other(
    impl: ModuleType, tmp_path: Path, world: int
) -> None:
    name = "refdcp" if impl is refdcp else "reference"
    path = str(tmp_path / "ck")
    FakeWorld(world).run(_cross_rank, name, path, world, timeout=60)
    reader = _other(impl)

    def load_rank(comm: Any) -> dict[str, Any]:
        lo = comm.rank * 4  # loaded on 2 ranks, resharded by rows
        out = {
            "layer": {"weight": torch.zeros(2, 2), "bias": torch.zeros(2)},
            "emb": refdcp.LocalShards((8, 3), [((lo, 0), torch.zeros(4, 3))]),
            "step": 0,
            "optim": {"state": {"layer.weight": {"exp_avg": torch.zeros(2, 2)}}, "lr": [0.0]},
        }
        reader.load(out, checkpoint_id=path, comm=comm)
        return out

    table = torch.arange(8 * 3, dtype=torch.float32).reshape(8, 3)
    for rank, out in enumerate(FakeWorld(2).run(load_rank, timeout=60)):
        assert torch.equal(out["layer"]["weight"], torch.ones(2, 2) * 7)
        assert torch.equal(out["layer"]["bias"], torch.tensor([1.0, -1.0]))
        assert torch.equal(out["emb"].chunks[0][1], table[rank * 4 : rank * 4 + 4])
        assert out["step"] == 11 and out["optim"]["lr"] == [0.1]
        assert torch.equal(
            out["optim"]["state"]["layer.weight"]["exp_avg"], torch.full((2, 2), 0.5)
        )
