"""TorchDistComm over spawned Gloo groups, and the run_gloo harness (spec/comm.md).

Each spawned group costs start-up time, so one group runs many checks.
Functions run in child processes are top-level so that they pickle.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import pytest

from refdcp.testing.spawn import SpawnError, run_gloo
from tests.test_comm_fake import check_exercise, exercise

pytestmark = pytest.mark.dist

PAYLOADS = [{"rank": 0, "blob": b"x" * 300}, [1, (2, 3)], "two", None, 4.5]


def _semantics(rank: int, world_size: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from refdcp.comm import CollectiveMismatch, Communicator, TorchDistComm
    from refdcp.errors import CommError

    comm = TorchDistComm(timeout=30.0)
    assert isinstance(comm, Communicator)
    out: dict[str, Any] = {"exercise": exercise(comm, PAYLOADS[:world_size])}

    # COMM-32: received objects are copies, even the coordinator's own.
    mine = {"t": torch.zeros(2), "items": [rank]}
    got = comm.broadcast(mine if rank == 0 else None)
    got["items"].append(99)
    out["isolated"] = (got is not mine, mine["items"], got["items"], got["t"].tolist())

    # COMM-4: a bad scatter fails before communicating; the next collective lines up.
    if rank == 0:
        try:
            comm.scatter([1])
            out["bad_scatter"] = "accepted"
        except ValueError:
            out["bad_scatter"] = "ValueError"
    out["after_bad_scatter"] = comm.all_gather(rank)

    # COMM-7: rank 1 calls broadcast while the others call gather.
    try:
        if rank == 1:
            comm.broadcast("x")
        else:
            comm.gather(rank)
        out["mismatch"] = "none"
    except CollectiveMismatch as exc:
        out["mismatch"] = str(exc)
    out["after_mismatch"] = comm.all_gather(rank * 3)

    # COMM-50: a subgroup of global ranks [1, 2] has its own ranks and coordinator.
    if world_size == 3:
        sub = dist.new_group([1, 2])
        if rank in (1, 2):
            sc = TorchDistComm(sub, timeout=30.0)
            out["sub"] = (
                sc.rank,
                sc.world_size,
                sc.coordinator_rank,
                sc.broadcast(f"from global {rank}"),
                sc.gather(rank),
                sc.scatter(["s0", "s1"] if sc.rank == 0 else None),
            )
        comm.barrier()

    # COMM-5 and COMM-52: the last rank is late; the others time out, then the
    # communicator refuses further use.
    late = world_size - 1
    if rank == late:
        time.sleep(2.5)
    t0 = time.monotonic()
    try:
        comm.barrier(timeout=1.0)
        out["late"] = ("completed", time.monotonic() - t0)
    except CommError as exc:
        out["late"] = (type(exc).__name__, time.monotonic() - t0)
        try:
            comm.barrier(timeout=1.0)
            out["after_timeout"] = "communicated"
        except CommError as again:
            out["after_timeout"] = type(again).__name__
    out["threads"] = torch.get_num_threads()
    out["pids"] = (os.getpid(), os.getppid())
    store: Any = dist.distributed_c10d._get_default_store()
    while hasattr(store, "underlying_store"):  # unwrap PrefixStores
        store = store.underlying_store
    out["store"] = (type(store).__name__, store.host)
    if rank == late:
        # Let the others' pending timed-out work complete before tear-down.
        time.sleep(0.1)
    return out


@pytest.mark.spec(
    "COMM-1",
    "COMM-3",
    "COMM-4",
    "COMM-5",
    "COMM-7",
    "COMM-20",
    "COMM-21",
    "COMM-24",
    "COMM-32",
    "COMM-50",
    "COMM-52",
)
@pytest.mark.parametrize("world_size", [2, 3])
def test_torchdist_comm_under_gloo(world_size: int) -> None:
    results = run_gloo(world_size, _semantics, timeout=90.0)
    check_exercise([r["exercise"] for r in results], PAYLOADS[:world_size], 0)
    for rank, r in enumerate(results):
        assert r["isolated"] == (True, [rank], [0, 99], [0.0, 0.0])
        assert r["after_bad_scatter"] == list(range(world_size))
        assert "broadcast" in r["mismatch"] and "gather" in r["mismatch"]
        assert "rank 1" in r["mismatch"]
        assert r["after_mismatch"] == [3 * i for i in range(world_size)]
        assert r["threads"] == 1
        assert r["store"] == ("TCPStore", "127.0.0.1")
        _pid, ppid = r["pids"]
        assert ppid != os.getpid()  # started by the fork server, not forked from us
    assert results[0]["bad_scatter"] == "ValueError"
    late = world_size - 1
    for rank in range(late):
        outcome, waited = results[rank]["late"]
        assert outcome == "CommTimeout"
        assert waited >= 0.9  # the configured 1 s timeout, not the group's 90 s
        assert results[rank]["after_timeout"] == "CommError"
    if world_size == 3:
        assert "sub" not in results[0]
        assert results[1]["sub"] == (0, 2, 0, "from global 1", [1, 2], "s0")
        assert results[2]["sub"] == (1, 2, 0, "from global 1", None, "s1")


def _peer_raises(rank: int, world_size: int) -> str:
    from refdcp.comm import TorchDistComm
    from refdcp.errors import CommAborted, CommTimeout

    comm = TorchDistComm(timeout=20.0)
    comm.barrier()
    if rank == 1:
        raise RuntimeError("deliberate failure on rank 1")
    try:
        comm.all_gather(rank, timeout=20.0)
    except (CommAborted, CommTimeout) as exc:
        return type(exc).__name__
    return "completed"


@pytest.mark.spec("COMM-6", "COMM-22")
def test_peer_that_leaves_aborts_the_collective() -> None:
    t0 = time.monotonic()
    with pytest.raises(SpawnError) as info:
        run_gloo(2, _peer_raises, timeout=60.0)
    err = info.value
    assert list(err.failures) == [1]
    assert "deliberate failure on rank 1" in err.failures[1]
    assert "deliberate failure on rank 1" in str(err)
    assert err.results == {0: "CommAborted"}
    assert not err.timed_out
    assert time.monotonic() - t0 < 20.0  # detected through the closed connection


def _hangs(rank: int, world_size: int) -> None:
    time.sleep(3600)


def _dies(rank: int, world_size: int) -> None:
    if rank == 0:
        os._exit(3)
    time.sleep(3600)


def _returns(rank: int, world_size: int, tag: str) -> tuple[str, int, int]:
    import torch.distributed as dist

    return (tag, rank, dist.get_world_size())


def _context(rank: int, world_size: int) -> tuple[str | None, str, str | None, str | None]:
    return (
        os.environ.get("REFDCP_SPAWN_PROBE"),
        os.getcwd(),
        os.environ.get("RANK"),
        os.environ.get("OMP_NUM_THREADS"),
    )


@pytest.mark.spec("COMM-22", "COMM-23")
def test_spawn_timeout_and_silent_death_never_hang() -> None:
    t0 = time.monotonic()
    with pytest.raises(SpawnError) as info:
        run_gloo(2, _hangs, timeout=2.0)
    assert info.value.timed_out
    assert sorted(info.value.failures) == [0, 1]
    assert "timed out after 2 s" in str(info.value)
    assert time.monotonic() - t0 < 2.0 + 10.0

    with pytest.raises(SpawnError) as info:
        run_gloo(2, _dies, timeout=60.0)
    assert not info.value.timed_out
    assert "exited with code 3" in info.value.failures[0]


@pytest.mark.spec("COMM-20", "COMM-21")
def test_concurrent_spawns_return_results_in_rank_order() -> None:
    results: dict[str, Any] = {}

    def one(tag: str) -> None:
        try:
            results[tag] = run_gloo(3, _returns, tag, timeout=60.0)
        except BaseException as exc:  # reported by the assertion below, with its text
            results[tag] = f"{type(exc).__name__}: {exc}"

    threads = [threading.Thread(target=one, args=(tag,)) for tag in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90.0)
    assert results == {tag: [(tag, r, 3) for r in range(3)] for tag in ("a", "b")}


@pytest.mark.spec("COMM-20")
def test_children_see_the_callers_environment_and_directory(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("REFDCP_SPAWN_PROBE", "probe-value")
    monkeypatch.chdir(tmp_path)
    got = run_gloo(2, _context, timeout=60.0)
    assert got == [("probe-value", str(tmp_path), str(r), "1") for r in range(2)]


@pytest.mark.spec("COMM-24")
def test_spawn_start_method_is_checked() -> None:
    with pytest.raises(ValueError, match="start_method"):
        run_gloo(1, _returns, "x", start_method="fork")


@pytest.mark.slow
@pytest.mark.spec("COMM-20")
def test_plain_spawn_start_method_works() -> None:
    assert run_gloo(2, _returns, "s", start_method="spawn", timeout=120.0) == [
        ("s", 0, 2),
        ("s", 1, 2),
    ]


@pytest.mark.spec("COMM-53")
def test_torchdist_comm_needs_an_initialised_group() -> None:
    import torch.distributed as dist

    from refdcp.comm import TorchDistComm

    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="initialised"):
        TorchDistComm()


def _records_call(rank: int, world_size: int, directory: str) -> int:
    import pathlib

    path = pathlib.Path(directory) / f"rank{rank}.log"
    with path.open("a") as f:
        f.write("called\n")
    return rank


@pytest.mark.spec("COMM-25")
def test_a_failed_connect_before_the_gate_is_retried_and_fn_runs_once(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Rank 0 fails its first two connects with Gloo's transient error; the
    # third start succeeds and every rank ran fn exactly once.
    monkeypatch.setenv("REFDCP_SPAWN_INJECT_CONNECT_FAILURES", "2")
    assert run_gloo(3, _records_call, str(tmp_path), timeout=90.0) == [0, 1, 2]
    for rank in range(3):
        assert (tmp_path / f"rank{rank}.log").read_text() == "called\n"


@pytest.mark.spec("COMM-25")
def test_connect_failures_past_the_retry_budget_are_raised_and_fn_never_runs(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("REFDCP_SPAWN_INJECT_CONNECT_FAILURES", "3")
    with pytest.raises(SpawnError) as info:
        run_gloo(2, _records_call, str(tmp_path), timeout=60.0)
    assert "connectFullMesh failed" in info.value.failures[0]
    assert "(attempt 2)" in info.value.failures[0]
    assert info.value.before_fn_only
    assert sorted(p.name for p in tmp_path.iterdir()) == []


@pytest.mark.spec("COMM-25")
def test_a_failure_inside_fn_is_never_retried(tmp_path: Any) -> None:
    with pytest.raises(SpawnError) as info:
        run_gloo(2, _fails_after_recording, str(tmp_path), timeout=60.0)
    assert not info.value.before_fn_only
    assert "Connection closed by peer" in info.value.failures[1]
    # fn ran once on each rank: a connect-like error from fn is not retried.
    for rank in range(2):
        assert (tmp_path / f"rank{rank}.log").read_text() == "called\n"


def _fails_after_recording(rank: int, world_size: int, directory: str) -> int:
    _records_call(rank, world_size, directory)
    if rank == 1:
        raise RuntimeError("Connection closed by peer (raised by fn itself)")
    return rank
