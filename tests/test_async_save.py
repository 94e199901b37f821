"""refdcp.asyncsave.save with the thread executor (spec/staging.md ASYNC-1..ASYNC-5, ASYNC-8, ASYNC-11, ASYNC-12)."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.stateful import Stateful

from refdcp.api import load, save
from refdcp.asyncsave.save import InFlightLimiter, async_save
from refdcp.staging import CpuStager, State


def _load(path: Path | str, like: dict[str, Any]) -> dict[str, Any]:
    out = {k: torch.empty_like(v) if isinstance(v, torch.Tensor) else v for k, v in like.items()}
    load(out, checkpoint_id=str(path), no_dist=True)
    return out


@pytest.mark.spec("ASYNC-1", "ASYNC-2")
def test_handle_futures_and_isolation(tmp_path: Path) -> None:
    w = torch.randn(32)
    expected = w.clone()
    handle = async_save({"w": w, "step": 3}, checkpoint_id=str(tmp_path), no_dist=True)
    assert handle.staged.done()  # blocking default stager: staged before return
    w.add_(1)
    md = handle.result(timeout=60)
    assert isinstance(md, Metadata) and handle.committed.result() is md
    assert "w" in md.state_dict_metadata
    out = _load(tmp_path, {"w": w, "step": 0})
    assert torch.equal(out["w"], expected) and out["step"] == 3


class _Counter(Stateful):
    def __init__(self) -> None:
        self.n = torch.tensor([5])

    def state_dict(self) -> dict[str, Any]:
        return {"n": self.n}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.n.copy_(sd["n"])


@pytest.mark.spec("ASYNC-12")
def test_stateful_values_are_unwrapped(tmp_path: Path) -> None:
    c = _Counter()
    async_save({"c": c}, checkpoint_id=str(tmp_path), no_dist=True).result(timeout=60)
    c.n.fill_(0)
    load({"c": c}, checkpoint_id=str(tmp_path), no_dist=True)
    assert c.n.item() == 5


@pytest.mark.spec("ASYNC-11")
def test_unknown_executor(tmp_path: Path) -> None:
    stager = CpuStager(cache_staged_state_dict=True)
    with pytest.raises(ValueError, match="executor"):
        async_save(
            {"w": torch.zeros(1)}, checkpoint_id=str(tmp_path), executor="gpu", stager=stager
        )
    assert stager.pool is not None and stager.pool.allocations == 0


@pytest.mark.spec("ASYNC-5")
def test_in_flight_bound_blocks_then_times_out(tmp_path: Path) -> None:
    gate = threading.Event()

    def gated_save(sd: dict[str, Any], **kw: Any) -> Metadata:
        assert gate.wait(30)
        return save(sd, **kw)

    limiter = InFlightLimiter(max_in_flight=1, wait_timeout=0.2)
    h1 = async_save(
        {"w": torch.zeros(2)},
        checkpoint_id=str(tmp_path / "a"),
        no_dist=True,
        limiter=limiter,
        save_fn=gated_save,
    )
    assert limiter.in_flight == 1
    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        async_save(
            {"w": torch.zeros(2)}, checkpoint_id=str(tmp_path / "b"), no_dist=True, limiter=limiter
        )
    assert time.monotonic() - t0 >= 0.2 and limiter.in_flight == 1
    assert not (tmp_path / "b").exists()  # nothing was started
    limiter.wait_timeout = 30.0
    started: list[float] = []

    def second() -> None:
        h = async_save(
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
    assert torch.equal(_load(tmp_path / "c", {"w": torch.zeros(2)})["w"], torch.ones(2))


@pytest.mark.spec("ASYNC-4", "ASYNC-3")
def test_buffers_released_before_commit_resolves(tmp_path: Path) -> None:
    stager = CpuStager(cache_staged_state_dict=True)
    seen: list[list[State]] = []
    assert stager.pool is not None
    pool = stager.pool

    def record(f: object) -> None:
        seen.append(pool.states())

    h = async_save(
        {"w": torch.randn(8)}, checkpoint_id=str(tmp_path / "ok"), no_dist=True, stager=stager
    )
    h.add_done_callback(record)
    h.result(timeout=60)

    def boom(sd: dict[str, Any], **kw: Any) -> Metadata:
        raise OSError("disk gone")

    bad = async_save(
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
    again = async_save(
        {"w": torch.randn(8)}, checkpoint_id=str(tmp_path / "again"), no_dist=True, stager=stager
    )
    again.result(timeout=60)
    stager.close()


@pytest.mark.spec("ASYNC-8", "STAGE-6", "ASYNC-2")
@given(
    schedule=st.lists(
        st.tuples(st.integers(-3, 3), st.floats(0, 0.02), st.integers(0, 2)), min_size=1, max_size=4
    ),
    in_flight=st.integers(1, 3),
)
def test_staging_isolation_property(
    tmp_path_factory: pytest.TempPathFactory,
    schedule: list[tuple[int, float, int]],
    in_flight: int,
) -> None:
    """Random source mutations after `staged` never reach a checkpoint; every checkpoint
    holds the values of its own staging time, with cached buffers and saves in flight."""
    root = tmp_path_factory.mktemp("iso")
    stager = CpuStager(cache_staged_state_dict=True, max_buffer_sets=in_flight)
    limiter = InFlightLimiter(max_in_flight=in_flight, wait_timeout=60)
    model = {"a": torch.zeros(6), "b": torch.zeros(2, 3, dtype=torch.float64)}

    def delayed(seconds: float) -> Any:
        def slow_save(sd: dict[str, Any], **kw: Any) -> Metadata:
            time.sleep(seconds)
            return save(sd, **kw)

        return slow_save

    handles, expected = [], []
    for i, (value, delay, mutations) in enumerate(schedule):
        model["a"].fill_(value)
        model["b"].fill_(value * 10)
        expected.append({k: v.clone() for k, v in model.items()})
        h = async_save(
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
        got = _load(root / f"c{i}", exp)
        for k in exp:
            assert torch.equal(got[k], exp[k]), (i, k)
    assert stager.pool is not None and stager.pool.allocations <= in_flight
    stager.close()


class FailingWriter(FileSystemWriter):
    """A filesystem writer whose write_data raises (injected storage error)."""

    def write_data(self, plan: Any, planner: Any) -> Any:
        raise OSError("injected storage failure")


@pytest.mark.spec("ASYNC-3", "ASYNC-5")
def test_background_failure_on_every_rank_then_next_save_succeeds(tmp_path: Path) -> None:
    from refdcp.comm import FakeWorld
    from refdcp.errors import CheckpointError

    def one_rank(comm: Any, path: str, fail_rank: int | None) -> BaseException | None:
        writer_cls = FailingWriter if comm.rank == fail_rank else FileSystemWriter
        sd = {f"r{comm.rank}": torch.full((4,), float(comm.rank)), "shared": torch.ones(3)}
        h = async_save(
            sd,
            storage_writer=writer_cls(path),
            comm=comm,
            stager=CpuStager(),  # default limiter: one save in flight per comm (ASYNC-5)
        )
        return h.exception(timeout=60)

    bad = str(tmp_path / "bad")
    errs = FakeWorld(2).run(one_rank, bad, 1, timeout=60)
    assert all(isinstance(e, CheckpointError) for e in errs)
    assert all(1 in e.rank_failures for e in errs if isinstance(e, CheckpointError))
    assert not (Path(bad) / ".metadata").exists()
    good = str(tmp_path / "good")
    assert FakeWorld(2).run(one_rank, good, None, timeout=60) == [None, None]
    assert (Path(good) / ".metadata").exists()
    out = {"r0": torch.empty(4), "r1": torch.empty(4), "shared": torch.empty(3)}
    load(out, checkpoint_id=good, no_dist=True)
    assert out["r1"].tolist() == [1.0] * 4


@pytest.mark.spec("ASYNC-16")
def test_fresh_snapshot_is_freed_without_the_garbage_collector(tmp_path: Path) -> None:
    import gc
    import time

    marker = 123_457  # an unusual numel to find the copies by
    src = {"a": torch.ones(marker), "nested": {"b": [torch.zeros(marker)]}}
    gc.collect()
    gc.disable()
    try:
        # a fresh copy per save (the default stager keeps its buffers: ASYNC-30)
        handle = async_save(src, checkpoint_id=str(tmp_path), no_dist=True, stager=CpuStager())
        handle.result(timeout=60)
        del handle
        deadline = time.monotonic() + 5
        while True:
            copies = [
                o
                for o in gc.get_objects()
                if isinstance(o, torch.Tensor)
                and o.numel() == marker
                and o is not src["a"]
                and o is not src["nested"]["b"][0]
            ]
            if not copies or time.monotonic() > deadline:
                break
            time.sleep(0.05)  # the background thread may still be unwinding
        assert copies == []
    finally:
        gc.enable()
