"""Tensor replica digests computed while the ranks write, compared before the commit (DEDUP-17)."""

from __future__ import annotations

import os
import sys
import tempfile
import threading
import time
import warnings
from types import ModuleType
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import refdcp
from refdcp.comm import FakeWorld
from refdcp.errors import CheckpointError
from refdcp.planning import DefaultSavePlanner, ReplicaMismatchError
from refdcp.planning.dedup import deferred as replica_late
from refdcp.planning.dedup.deferred import replica_value_problems
from refdcp.planning.flatten import RESERVED_KEY
from refdcp.testing.spawn import run_gloo
from tests._replica_spies import EarlyDigests, count_digested

warnings.filterwarnings("ignore", message="torch.distributed is disabled")


class PlanRecorder(DefaultSavePlanner):
    """Keeps the replica checksums its local plans carried."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.plan_sums: list[Any] = []

    def create_local_plan(self) -> Any:
        plan = super().create_local_plan()
        self.plan_sums.append(plan.planner_data[RESERVED_KEY]["checksums"])
        return plan


def _disagreeing(comm: Any) -> dict[str, Any]:
    return {"w": torch.full((64,), float(comm.rank == 2)), "b": torch.ones(3), "step": 1}


@pytest.mark.spec("DEDUP-17", "SAVE-7", "DEDUP-21")
def test_disagreeing_replicas_fail_every_rank_before_the_commit(
    tmp_path: Any, impl: ModuleType
) -> None:
    def rank(comm: Any) -> tuple[str, list[str], bool | None]:
        with pytest.raises(CheckpointError) as err:
            impl.save(_disagreeing(comm), checkpoint_id=tmp_path, comm=comm)
        causes = [type(f.exception).__name__ for f in err.value.rank_failures.values()]
        return str(err.value), causes, err.value.committed

    for msg, causes, committed in FakeWorld(3).run(rank):
        assert "differ in value" in msg and "'w'" in msg
        assert "ranks [0, 1] hold checksum" in msg and "ranks [2] hold checksum" in msg
        assert "'b'" not in msg  # equal replicas are not named
        assert causes == ["ReplicaMismatchError"] and committed is False
    assert not (tmp_path / ".metadata").exists()
    assert not list(tmp_path.glob("*.distcp"))  # the save's files were removed (STORE-31)


@pytest.mark.spec("DEDUP-17")
def test_refdcp_driver_keeps_tensor_digests_out_of_the_local_plans(tmp_path: Any) -> None:
    # single path: the fast path's deferred digest worker
    def rank(comm: Any) -> Any:
        planner = PlanRecorder()
        refdcp.save(
            {"w": torch.ones(8), "step": 3}, checkpoint_id=tmp_path, comm=comm, planner=planner
        )
        return planner.plan_sums

    coordinator, other = FakeWorld(2).run(rank)
    assert coordinator == [None]  # the coordinator digests in the global plan (DEDUP-13)
    assert list(other[0]) == [("step", None)]  # objects only: the tensor's digest comes later


def _torch_driven(rank: int, world: int, path: str) -> tuple[list[Any], str]:
    import torch.distributed.checkpoint as dcp

    planner = PlanRecorder()
    sd = {"w": torch.full((8,), float(rank)), "step": 3}
    try:
        dcp.save(sd, checkpoint_id=path, planner=planner)
        msg = ""
    except BaseException as exc:  # torch's CheckpointException is not an Exception
        msg = str(exc)
    import os

    files = sorted(os.listdir(path)) if os.path.isdir(path) else []
    return [sorted(map(str, s)) if s else s for s in planner.plan_sums] + [files], msg


@pytest.mark.spec("DEDUP-17", "DEDUP-13")
def test_torch_driven_saves_compare_tensor_digests_before_writing() -> None:
    with tempfile.TemporaryDirectory() as d:
        (r0, m0), (r1, m1) = run_gloo(2, _torch_driven, f"{d}/ckpt", timeout=150)
    assert r1[0] == sorted(map(str, [("step", None), ("w", torch.Size([0]))]))
    assert all("differ in value" in m and "'w'" in m for m in (m0, m1))
    assert not [f for f in r0[-1] if f.endswith(".distcp")]  # nothing written


def _writer(path: Any, before: Any = None, fail: bool = False) -> Any:
    """A FileSystemWriter whose ``write_data`` first calls ``before()``, then writes, or
    with ``fail`` raises ``OSError("disk gone")`` instead."""
    writer = refdcp.FileSystemWriter(path)
    real_write = writer.write_data

    def write_data(plan: Any, planner: Any) -> Any:
        if before is not None:
            before()
        if fail:
            raise OSError("disk gone")
        return real_write(plan, planner)

    writer.write_data = write_data  # type: ignore[method-assign]
    return writer


@pytest.mark.spec("DEDUP-17", "DEDUP-18")
def test_digests_run_on_a_worker_while_the_rank_writes(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # single path: the fast path's deferred digest worker
    started = threading.Semaphore(0)
    threads: list[str] = []
    real = replica_late.replica_tensors

    def spy(*args: Any, **kw: Any) -> Any:
        threads.append(threading.current_thread().name)
        started.release()
        return real(*args, **kw)

    monkeypatch.setattr(replica_late, "replica_tensors", spy)
    seen_during_write: list[bool] = []

    def rank(comm: Any) -> None:
        # the worker started before the write: this rank's digests overlap its write
        writer = _writer(tmp_path, lambda: seen_during_write.append(started.acquire(timeout=10)))
        # dedup gives "a" to rank 0 and "b" to rank 1: each digests the one it does not write
        sd = {"a": torch.ones(1000), "b": torch.ones(1000), f"own{comm.rank}": torch.ones(10)}
        refdcp.save(sd, storage_writer=writer, comm=comm)

    FakeWorld(2).run(rank)
    assert seen_during_write == [True, True]
    assert threads == ["refdcp-replica-digests"] * 2


@pytest.mark.spec("DEDUP-17", "DEDUP-21")
def test_a_failing_digest_worker_fails_the_save(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # single path: the fast path's deferred digest worker
    def broken(*args: Any, **kw: Any) -> Any:
        raise OSError("the digest kernel failed")

    monkeypatch.setattr(replica_late, "replica_tensors", broken)

    def rank(comm: Any) -> str:
        with pytest.raises(CheckpointError) as err:
            refdcp.save({"w": torch.ones(8)}, checkpoint_id=tmp_path, comm=comm)
        return str(err.value)

    for msg in FakeWorld(2).run(rank):
        assert "computing replica digests failed" in msg and "digest kernel failed" in msg
    assert not (tmp_path / ".metadata").exists()


def _slow_units(monkeypatch: pytest.MonkeyPatch, log: list[tuple[str, float, int]]) -> None:
    """Each unit of digest work sleeps, then records its thread, end time and CPU priority."""
    real = replica_late.digest_units

    def slow(tensors: Any, seeds: Any) -> Any:
        units, result, shared = real(tensors, seeds)

        def wrap(unit: Any) -> Any:
            def run() -> None:
                time.sleep(0.05)
                unit()
                nice = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
                log.append((threading.current_thread().name, time.monotonic(), nice))

            return run

        return [wrap(u) for u in units], result, shared

    monkeypatch.setattr(replica_late, "digest_units", slow)


@pytest.mark.spec("DEDUP-17", "DEDUP-21")
@pytest.mark.parametrize("where", ["first", "last"])  # the worker's end, or its owner's
def test_an_error_in_a_unit_of_digest_work_fails_the_save(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    # single path: the fast path's deferred digest worker
    real = replica_late.digest_units

    def failing(tensors: Any, seeds: Any) -> Any:
        units, result, shared = real(tensors, seeds)

        def boom() -> None:
            raise MemoryError("no memory for the copy")

        at = 0 if where == "first" else len(units) - 1
        return [boom if k == at else u for k, u in enumerate(units)], result, shared

    monkeypatch.setattr(replica_late, "digest_units", failing)

    def rank(comm: Any) -> str:
        sd = {f"big{i}": torch.ones(300_000) for i in range(6)}
        with pytest.raises(CheckpointError) as err:
            refdcp.save(sd, checkpoint_id=tmp_path, comm=comm)
        return str(err.value)

    for msg in FakeWorld(2).run(rank):
        assert "computing replica digests failed" in msg and "no memory for the copy" in msg
    assert not (tmp_path / ".metadata").exists()


@pytest.mark.spec("DEDUP-17", "DEDUP-21")
def test_a_failed_write_waits_for_the_digest_worker(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # single path: the fast path's deferred digest worker
    log: list[tuple[str, float, int]] = []
    _slow_units(monkeypatch, log)

    def rank(comm: Any) -> float:
        writer = _writer(tmp_path, lambda: time.sleep(0.02), fail=True)  # inside a unit
        sd = {f"t{i}": torch.ones(8) for i in range(40)}  # batches of small tensors
        sd.update({f"big{i}": torch.ones(300_000) for i in range(6)})  # one unit each
        with pytest.raises(CheckpointError, match="disk gone"):
            refdcp.save(sd, storage_writer=writer, comm=comm)
        return time.monotonic()

    failed_at = FakeWorld(2).run(rank)
    assert log  # a unit was running when the write failed
    assert max(end for _, end, _ in log) <= min(failed_at)
    assert len(log) < 8  # the rest was never computed: the failed save stopped the worker


@pytest.mark.spec("DEDUP-17", "DEDUP-21")
def test_a_write_failing_before_the_worker_is_ready_still_stops_it(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # single path: the fast path's deferred digest worker
    log: list[tuple[str, float, int]] = []
    _slow_units(monkeypatch, log)
    real = replica_late.replica_tensors

    def slow_prepare(*args: Any, **kw: Any) -> Any:
        time.sleep(0.2)  # the write fails before the worker has its units
        return real(*args, **kw)

    monkeypatch.setattr(replica_late, "replica_tensors", slow_prepare)

    def rank(comm: Any) -> float:
        writer = _writer(tmp_path, fail=True)
        sd = {f"big{i}": torch.ones(300_000) for i in range(6)}
        with pytest.raises(CheckpointError, match="disk gone"):
            refdcp.save(sd, storage_writer=writer, comm=comm)
        return time.monotonic()

    failed_at = FakeWorld(2).run(rank)
    time.sleep(0.4)  # a worker left running would compute its units now
    assert [end for _, end, _ in log if end > min(failed_at)] == []


@pytest.mark.skipif(sys.platform != "linux", reason="thread priorities are Linux-only")
@pytest.mark.spec("DEDUP-17", "DEDUP-18")
def test_the_worker_runs_at_the_lowest_priority_and_its_owner_does_not(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # single path: the fast path's deferred digest worker
    log: list[tuple[str, float, int]] = []
    _slow_units(monkeypatch, log)
    base = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    def rank(comm: Any) -> None:
        writer = _writer(tmp_path, lambda: time.sleep(0.2))  # the worker takes a few units
        sd = {f"big{i}": torch.ones(300_000) for i in range(12)}
        refdcp.save(sd, storage_writer=writer, comm=comm)

    FakeWorld(2).run(rank)
    by_worker = [nice for name, _, nice in log if name == "refdcp-replica-digests"]
    by_owner = [nice for name, _, nice in log if name != "refdcp-replica-digests"]
    assert by_worker and set(by_worker) == {19}
    assert set(by_owner) <= {base}  # the rank's own thread keeps its priority


@pytest.mark.spec("DEDUP-17", "DEDUP-21")
def test_async_save_reports_disagreeing_replicas(tmp_path: Any, impl: ModuleType) -> None:
    def rank(comm: Any) -> str:
        handle = impl.async_save(_disagreeing(comm), checkpoint_id=tmp_path, comm=comm)
        with pytest.raises(CheckpointError) as err:
            handle.result()
        return str(err.value)

    for msg in FakeWorld(3).run(rank):
        assert "differ in value" in msg and "'w'" in msg
    assert not (tmp_path / ".metadata").exists()


@pytest.mark.spec("DEDUP-17")
def test_opting_out_digests_nothing_after_the_write(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # single path: the fast path's deferred digest worker
    calls: list[int] = []
    monkeypatch.setattr(replica_late, "replica_tensors", lambda *a, **k: calls.append(1) or {})

    def rank(comm: Any) -> None:
        planner = DefaultSavePlanner(check_replicas=False)
        refdcp.save(_disagreeing(comm), checkpoint_id=tmp_path, comm=comm, planner=planner)

    FakeWorld(3).run(rank)
    assert calls == [] and (tmp_path / ".metadata").exists()


@pytest.mark.spec("DEDUP-17", "DEDUP-6", "DEDUP-21")
def test_problems_name_each_key_once_in_key_order() -> None:
    a, b0, b4 = ("a", None), ("b", torch.Size([0])), ("b", torch.Size([4]))
    sums: list[Any] = [{b4: 1, a: 2, b0: 5}, None, {a: 2, b4: 3, b0: 5}, {b4: 3}, {}]
    problems = replica_value_problems(sums)
    assert problems == [
        "replicas of 'b' chunk at offsets (4,) differ in value between ranks: "
        "ranks [0] hold checksum 0x00000001; ranks [2, 3] hold checksum 0x00000003"
    ]
    assert replica_value_problems([{a: 1}, {a: 1}, None]) == []
    two = replica_value_problems([{b4: 1, a: 1}, {a: 2, b4: 2}])
    assert [p.split(" differ")[0] for p in two] == [
        "replicas of 'a'",
        "replicas of 'b' chunk at offsets (4,)",
    ]
    err = ReplicaMismatchError(problems)
    assert isinstance(err, refdcp.planning.PlanValidationError) and "replicas differ" in str(err)


def _value_digest(t: torch.Tensor) -> int:
    from refdcp.planning.local_plan import object_write_items, replica_checksums

    (item,) = object_write_items("x", t)
    (value,) = replica_checksums({"x": t}, [item], framed=True).values()
    return value


SIZES = {  # the writer's paths: small parts, inline frame, by the writer in pieces (>= 8 MiB)
    "4 KiB": (1024,),
    "2 MiB": (512 * 1024,),
    "9 MiB": (9 * 256 * 1024 + 3,),
}


@pytest.mark.spec("DEDUP-17", "STORE-52", "DEDUP-19")
@pytest.mark.parametrize("size", list(SIZES), ids=list(SIZES))
@pytest.mark.parametrize("storage", ["filesystem", "memory"])
def test_writers_record_the_value_digest_the_planner_computes(
    tmp_path: Any, size: str, storage: str
) -> None:
    from torch.distributed.checkpoint.planner import SavePlan

    from refdcp.storage.format.records import VALUE_CRC_ATTR, value_crc_of

    values = {
        "plain": torch.randn(SIZES[size]),
        "strided": torch.randn(SIZES[size][0], 2)[:, 0],
        "empty": torch.zeros(0, 3),
    }
    planner = DefaultSavePlanner()
    planner.set_up_planner(values, is_coordinator=True)
    plan = planner.create_local_plan()
    if storage == "filesystem":
        writer: Any = refdcp.FileSystemWriter(tmp_path)
    else:
        writer = refdcp.MemoryStorage().writer("m")
    writer.set_up_storage_writer(True)
    (final,) = writer.prepare_global_plan([writer.prepare_local_plan(SavePlan(plan.items))])
    results = writer.write_data(final, planner).value()
    got = {r.index.fqn: value_crc_of(r) for r in results}
    assert got == {k: _value_digest(v) for k, v in values.items()}
    assert not any(hasattr(r.storage_data, VALUE_CRC_ATTR) for r in results)  # not stored
    # the digest is the CRC-32C of the values continued from the frame's head CRC
    plain = values["plain"]
    seed = refdcp.storage.format.items.value_digest_seed(plain)
    from refdcp.crc.kernel import crc32c

    assert got["plain"] == crc32c(plain.numpy().tobytes(), seed)


@pytest.mark.spec("DEDUP-17", "DEDUP-19")
@pytest.mark.parametrize("writer_kind", ["refdcp", "torch"])
@pytest.mark.parametrize("odd_rank", [0, 1])
def test_the_writers_own_value_is_compared_too(
    tmp_path: Any, writer_kind: str, odd_rank: int
) -> None:
    # single path: the fast path's deferred digest worker
    import torch.distributed.checkpoint as dcp

    def rank(comm: Any) -> str:
        big = torch.full((3 * 1024 * 1024,), 1.0)  # 12 MiB: written in pieces by refdcp
        if comm.rank == odd_rank:
            big[-1] = 2.0
        sd = {"big": big, "small": torch.ones(4)}
        writer = (
            refdcp.FileSystemWriter(tmp_path)
            if writer_kind == "refdcp"
            else dcp.FileSystemWriter(tmp_path)
        )
        with pytest.raises(CheckpointError) as err:
            refdcp.save(sd, storage_writer=writer, comm=comm)
        return str(err.value)

    for msg in FakeWorld(2).run(rank):
        assert "replicas differ in value" in msg and "'big'" in msg and "'small'" not in msg
        assert f"ranks [{odd_rank}] hold checksum" in msg
    assert not (tmp_path / ".metadata").exists()


@pytest.mark.spec("DEDUP-17", "DEDUP-19")
def test_a_writer_recording_no_digest_gets_them_computed_after_its_write(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # single path: the fast path's deferred digest worker
    import torch.distributed.checkpoint as dcp

    seen = count_digested(monkeypatch)

    def rank(comm: Any) -> None:
        sd = {"a": torch.ones(100), "b": torch.ones(100), f"own{comm.rank}": torch.ones(3)}
        refdcp.save(sd, storage_writer=dcp.FileSystemWriter(tmp_path), comm=comm)

    FakeWorld(2).run(rank)
    # each rank: the replica it does not write (worker), then what it wrote (after the
    # write); the coordinator only among the items others hold (DEDUP-13)
    assert sorted(seen) == [3, 100, 100, 100, 100]
    seen.clear()
    refdcp_path = tmp_path / "refdcp"

    def rank2(comm: Any) -> None:
        sd = {"a": torch.ones(100), "b": torch.ones(100), f"own{comm.rank}": torch.ones(3)}
        refdcp.save(sd, checkpoint_id=refdcp_path, comm=comm)

    FakeWorld(2).run(rank2)
    assert sorted(seen) == [100, 100]  # refdcp's writer records the rest on the way


class _Doubling(DefaultSavePlanner):
    """Writes each tensor doubled: what it writes is not the value the ranks hold."""

    def resolve_data(self, write_item: Any) -> Any:
        data = super().resolve_data(write_item)
        return data * 2 if isinstance(data, torch.Tensor) else data


@pytest.mark.spec("DEDUP-17", "DEDUP-19")
def test_a_planner_writing_other_data_digests_its_values_itself(tmp_path: Any) -> None:
    # single path: the fast path's deferred digest worker
    def rank(comm: Any) -> None:
        sd = {"a": torch.ones(300_000), "b": torch.ones(300_000)}  # 1.2 MB: recorded by writers
        refdcp.save(sd, checkpoint_id=tmp_path, comm=comm, planner=_Doubling())

    FakeWorld(2).run(rank)  # equal replicas: no false disagreement
    out = {"a": torch.zeros(300_000), "b": torch.zeros(300_000)}
    refdcp.load(out, checkpoint_id=tmp_path, no_dist=True)
    assert out["a"].eq(2).all() and out["b"].eq(2).all()


def _named_keys(message: str) -> set[str]:
    import re

    return set(re.findall(r"replicas of '([^']+)'", message))


@pytest.mark.spec("DEDUP-17", "DEDUP-13", "DEDUP-21")
@given(data=st.data())
def test_late_and_early_checks_name_the_same_keys(data: st.DataObject) -> None:
    # single path: the fast path's deferred digest worker
    world = data.draw(st.integers(2, 4), label="world")
    keys = data.draw(st.integers(1, 5), label="keys")
    layout = []
    for k in range(keys):
        holders = data.draw(st.sets(st.integers(0, world - 1), min_size=1), label=f"holders{k}")
        numel = data.draw(st.sampled_from([0, 3, 5000, 300_000]), label=f"numel{k}")
        dtype = data.draw(st.sampled_from([torch.float32, torch.int64]), label=f"dtype{k}")
        variant = {r: data.draw(st.integers(0, 1), label=f"v{k}.{r}") for r in sorted(holders)}
        layout.append((f"k{k}", numel, dtype, variant))
    steps = {r: data.draw(st.integers(0, 1), label=f"step{r}") for r in range(world)}
    expected = {name for name, numel, _, v in layout if numel and len(set(v.values())) > 1}
    if len(set(steps.values())) > 1:
        expected.add("step")

    def state(rank: int) -> dict[str, Any]:
        sd: dict[str, Any] = {"step": steps[rank]}
        for name, numel, dtype, variant in layout:
            if rank in variant:
                sd[name] = torch.full((numel,), variant[rank] + 1, dtype=dtype)
        return sd

    storage = refdcp.MemoryStorage()
    named: dict[str, set[str] | None] = {}
    for mode, make in (("late", DefaultSavePlanner), ("early", EarlyDigests)):

        def rank(comm: Any, make: Any = make, mode: str = mode) -> str:
            try:
                refdcp.save(
                    state(comm.rank), storage_writer=storage.writer(mode), planner=make(), comm=comm
                )
            except CheckpointError as err:
                return str(err)
            return ""

        msgs = FakeWorld(world).run(rank)
        assert len(set(msgs)) == 1  # every rank raises the same error, or none does
        named[mode] = _named_keys(msgs[0]) if msgs[0] else None
    # a plan that fails (the "step" objects disagree) fails before the tensors are compared
    late = {"step"} if "step" in expected else expected
    assert named == {"late": late or None, "early": expected or None}


class _Capturing(DefaultSavePlanner):
    """Keeps what it sends the coordinator after writing."""

    sent: list[Any]

    def replica_digests_after_write(self, results: Any) -> Any:
        out = super().replica_digests_after_write(results)
        self.sent = [out]
        return out


@pytest.mark.spec("DEDUP-17", "DEDUP-20")
def test_ranks_with_equal_plans_and_values_send_one_group(tmp_path: Any) -> None:
    # single path: the fast path's deferred digest worker
    def rank(comm: Any) -> Any:
        planner = _Capturing()
        sd = {"a": torch.ones(50), "b": torch.full((70,), float(comm.rank == 3)), "step": 1}
        with pytest.raises(CheckpointError) as err:
            refdcp.save(sd, checkpoint_id=tmp_path, comm=comm, planner=planner)
        return planner.sent[0], str(err.value)

    out = FakeWorld(4).run(rank)
    (d0, msg), (d1, _), (d2, _), (d3, _) = out
    assert d0.group is None  # the coordinator's keys are those others hold: not a plan's
    assert d1.group == d2.group is not None and d3.group not in (None, d1.group)
    assert len(d1.group) == 16  # a 16-byte blake2b digest
    assert list(d1.sums) == [("a", torch.Size([0])), ("b", torch.Size([0]))]  # items' order
    assert "ranks [0, 1, 2] hold checksum" in msg and "ranks [3] hold checksum" in msg


@pytest.mark.spec("DEDUP-17", "DEDUP-20")
def test_a_repeated_group_is_screened_once_and_still_named() -> None:
    from refdcp.planning.dedup.deferred import RankDigests, replica_problems

    a, b = ("a", None), ("b", None)
    same = {a: 1, b: 2}
    digests: list[Any] = [
        RankDigests({a: 1, b: 3}),  # the coordinator: no group
        RankDigests(dict(same), b"g"),
        RankDigests(dict(same), b"g"),  # equal to rank 1's: not screened again
        None,
    ]
    assert replica_problems(digests) == [
        "replicas of 'b' differ in value between ranks: "
        "ranks [0] hold checksum 0x00000003; ranks [1, 2] hold checksum 0x00000002"
    ]
    screened: list[Any] = []
    from refdcp.planning.dedup import deferred as replica_late

    real = replica_late.replica_value_problems

    def spy(sums: Any, screen: Any = None) -> Any:
        screened.append(list(screen))
        return real(sums, screen)

    replica_late.replica_value_problems = spy  # type: ignore[assignment]
    try:
        replica_problems(digests)
    finally:
        replica_late.replica_value_problems = real  # type: ignore[assignment]
    assert screened == [[True, True, False, True]]


class _CachingCapture(_Capturing):
    def __init__(self) -> None:
        super().__init__(enable_plan_caching=True)


@pytest.mark.spec("DEDUP-17", "PLAN-12", "DEDUP-20")
def test_a_cached_plan_is_named_by_its_own_digest_after_a_failed_save() -> None:
    # single path: the fast path's deferred digest worker
    # a group names the digested keys; after a save whose plan failed, a rank reusing its
    # cached plan must name it by that plan's digest, not by the failed plan's
    storage = refdcp.MemoryStorage()

    def rank(comm: Any) -> list[Any]:
        planner = _CachingCapture()
        good = {"w": torch.ones(4), f"own{comm.rank}": torch.ones(3)}
        groups = []
        refdcp.save(good, storage_writer=storage.writer("a"), planner=planner, comm=comm)
        groups.append(planner.sent[0].group)
        bad = {"w": torch.ones(4 + comm.rank)}  # replicas disagree in shape: the plan fails
        with pytest.raises(CheckpointError):
            refdcp.save(bad, storage_writer=storage.writer("b"), planner=planner, comm=comm)
        refdcp.save(good, storage_writer=storage.writer("c"), planner=planner, comm=comm)
        groups.append(planner.sent[0].group)
        return groups

    coordinator, other = FakeWorld(2).run(rank)
    assert coordinator == [None, None]
    assert other[0] is not None and other[1] == other[0]  # same items, same values
