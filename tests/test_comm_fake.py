"""FakeWorld and SingleRank communicators (spec/comm.md)."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from refdcp.comm import (
    CollectiveMismatch,
    Communicator,
    FakeWorld,
    RankFailures,
    SingleRank,
    is_coordinator,
)
from refdcp.errors import CheckpointError, CommAborted, CommTimeout, Failure

# Bound for every run that must not hang: a hang shows up as CommTimeout, not a stuck test.
RUN_LIMIT = 20.0

_leaf = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False)
    | st.text(max_size=8)
    | st.binary(max_size=16)
)
objects = st.recursive(
    _leaf,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.tuples(inner, inner)
        | st.dictionaries(st.text(max_size=4), inner, max_size=4)
    ),
    max_leaves=12,
)


def exercise(comm: Communicator, payloads: list[Any]) -> dict[str, Any]:
    """Run every collective once with rank-specific payloads; return what this rank got.

    Shared with the Gloo tests (tests/test_comm_gloo.py).
    """
    rank, n = comm.rank, comm.world_size
    coord = is_coordinator(comm)
    got: dict[str, Any] = {}
    got["gather"] = comm.gather(payloads[rank])
    got["scatter"] = comm.scatter(list(payloads) if coord else None)
    got["broadcast"] = comm.broadcast(payloads[comm.coordinator_rank] if coord else "ignored")
    got["all_gather"] = comm.all_gather(payloads[rank])
    got["barrier"] = comm.barrier()
    got["meta"] = (rank, n, comm.coordinator_rank, coord)
    return got


def check_exercise(results: list[dict[str, Any]], payloads: list[Any], coordinator: int) -> None:
    """The expected outcome of :func:`exercise` on every rank (COMM-3)."""
    n = len(payloads)
    assert len(results) == n
    for rank, got in enumerate(results):
        assert got["meta"] == (rank, n, coordinator, rank == coordinator)
        assert got["gather"] == (list(payloads) if rank == coordinator else None)
        assert got["scatter"] == payloads[rank]
        assert got["broadcast"] == payloads[coordinator]
        assert got["all_gather"] == list(payloads)
        assert got["barrier"] is None


@pytest.mark.spec("COMM-1", "COMM-2", "COMM-3", "COMM-30", "COMM-33")
@given(data=st.data(), n=st.integers(1, 8))
def test_collective_semantics_property(data: st.DataObject, n: int) -> None:
    coordinator = data.draw(st.integers(0, n - 1), label="coordinator")
    payloads = data.draw(st.lists(objects, min_size=n, max_size=n), label="payloads")
    world = FakeWorld(n, coordinator_rank=coordinator, timeout=10.0)
    calls: list[int] = []

    def fn(comm: Communicator, p: list[Any]) -> dict[str, Any]:
        assert isinstance(comm, Communicator)
        calls.append(comm.rank)
        return exercise(comm, p)

    results = world.run(fn, payloads, timeout=RUN_LIMIT)
    assert sorted(calls) == list(range(n))
    check_exercise(results, payloads, coordinator)


@pytest.mark.spec("COMM-1", "COMM-3", "COMM-10", "COMM-11")
def test_single_rank_is_a_world_of_one_passing_references() -> None:
    comm = SingleRank()
    assert isinstance(comm, Communicator)
    assert (comm.rank, comm.world_size, comm.coordinator_rank) == (0, 1, 0)
    assert is_coordinator(comm)
    obj = {"plan": [1, 2], "lock": threading.Lock()}  # unpicklable on purpose
    check_exercise([exercise(comm, [obj])], [obj], 0)
    assert comm.gather(obj) == [obj]
    assert comm.gather(obj)[0] is obj  # type: ignore[index]
    assert comm.scatter([obj]) is obj
    assert comm.broadcast(obj) is obj
    assert comm.all_gather(obj)[0] is obj


@pytest.mark.spec("COMM-4")
def test_scatter_needs_one_object_per_rank_on_the_coordinator() -> None:
    with pytest.raises(ValueError, match="1 object"):
        SingleRank().scatter([1, 2])
    with pytest.raises(ValueError):
        SingleRank().scatter(None)

    def fn(comm: Communicator) -> str:
        if is_coordinator(comm):
            for bad in (None, [1], [1, 2, 3, 4]):
                with pytest.raises(ValueError, match="3 objects"):
                    comm.scatter(bad)
        # Nothing was sent: the next collective still lines up on every rank.
        return str(comm.scatter(["a", "b", "c"] if is_coordinator(comm) else None))

    assert FakeWorld(3).run(fn, timeout=RUN_LIMIT) == ["a", "b", "c"]


@pytest.mark.spec("COMM-8")
def test_non_positive_timeouts_are_rejected() -> None:
    for bad in (0, -1.0):
        with pytest.raises(ValueError):
            SingleRank(timeout=bad)
        with pytest.raises(ValueError):
            FakeWorld(2, timeout=bad)

    def fn(comm: Communicator) -> None:
        with pytest.raises(ValueError):
            comm.barrier(timeout=0)

    FakeWorld(2).run(fn, timeout=RUN_LIMIT)


@pytest.mark.spec("COMM-33")
def test_world_arguments_are_checked() -> None:
    with pytest.raises(ValueError):
        FakeWorld(0)
    with pytest.raises(ValueError):
        FakeWorld(3, coordinator_rank=3)
    with pytest.raises(ValueError):
        FakeWorld(3, coordinator_rank=-1)


@pytest.mark.spec("COMM-31")
@pytest.mark.parametrize("kind", ["gather", "scatter", "broadcast", "all_gather", "barrier"])
def test_collectives_are_rendezvous(kind: str) -> None:
    n = 4
    entered: list[int] = []
    lock = threading.Lock()

    def fn(comm: Communicator) -> int:
        time.sleep(0.02 * comm.rank)  # ranks arrive at different times
        with lock:
            entered.append(comm.rank)
        if kind == "scatter":
            comm.scatter(list(range(n)) if is_coordinator(comm) else None)
        elif kind == "barrier":
            comm.barrier()
        else:
            getattr(comm, kind)(comm.rank)
        with lock:
            return len(entered)

    assert FakeWorld(n).run(fn, timeout=RUN_LIMIT) == [n] * n


@pytest.mark.spec("COMM-32")
def test_received_objects_are_isolated_copies() -> None:
    n = 3

    def fn(comm: Communicator) -> tuple[list[int], list[float], list[int]]:
        mine = {"items": [comm.rank], "t": torch.zeros(2)}
        got = comm.broadcast(mine if is_coordinator(comm) else None)
        assert got is not mine
        got["items"].append(100 + comm.rank)
        got["t"][0] = float(comm.rank)
        everyone = comm.all_gather(mine)
        assert everyone[comm.rank] is not mine and everyone[comm.rank] == {
            "items": mine["items"],
            "t": everyone[comm.rank]["t"],
        }
        everyone[(comm.rank + 1) % n]["items"].append(-1)
        comm.barrier()  # all mutations done before anyone looks
        return got["items"], got["t"].tolist(), mine["items"]

    results = FakeWorld(n).run(fn, timeout=RUN_LIMIT)
    for rank, (items, t, own) in enumerate(results):
        assert items == [0, 100 + rank]  # only this rank's own mutation
        assert t == [float(rank), 0.0]
        assert own == [rank]  # the sender's object was never touched


@pytest.mark.spec("COMM-32", "COMM-6")
def test_unpicklable_object_fails_in_the_sender() -> None:
    def fn(comm: Communicator) -> Any:
        return comm.all_gather(threading.Lock() if comm.rank == 1 else comm.rank)

    out = FakeWorld(3).run(fn, return_exceptions=True, timeout=RUN_LIMIT)
    assert isinstance(out[1], TypeError)
    assert isinstance(out[0], CommAborted) and "rank 1" in str(out[0])
    assert isinstance(out[2], CommAborted)


@pytest.mark.spec("COMM-7")
def test_mismatched_collectives_raise_on_every_rank() -> None:
    def fn(comm: Communicator) -> Any:
        comm.barrier()
        if comm.rank == 1:
            return comm.broadcast("x")
        return comm.gather(comm.rank)

    out = FakeWorld(3, timeout=60.0).run(fn, return_exceptions=True, timeout=RUN_LIMIT)
    for exc in out:
        assert isinstance(exc, CollectiveMismatch)
        assert "broadcast" in str(exc) and "gather" in str(exc)
        assert "rank 1" in str(exc)
        assert "collective #1" in str(exc)


@pytest.mark.spec("COMM-6")
def test_rank_that_raises_aborts_peers_in_collectives() -> None:
    def fn(comm: Communicator) -> Any:
        if comm.rank == 2:
            raise KeyError("injected")
        comm.barrier()
        return "unreachable"

    with pytest.raises(RankFailures) as info:
        FakeWorld(4, timeout=60.0).run(fn, timeout=RUN_LIMIT)
    exc = info.value
    assert sorted(exc.exceptions) == [0, 1, 2, 3]
    assert isinstance(exc.exceptions[2], KeyError)
    for rank in (0, 1, 3):
        peer = exc.exceptions[rank]
        assert isinstance(peer, CommAborted)
        assert "rank 2 raised KeyError" in str(peer)
    assert "injected" in str(exc)


@pytest.mark.spec("COMM-6")
def test_rank_that_returned_early_aborts_an_extra_collective() -> None:
    def fn(comm: Communicator) -> Any:
        comm.barrier()
        if comm.rank == 0:
            return comm.all_gather("extra")  # nobody else calls this one
        return "done"

    out = FakeWorld(2, timeout=60.0).run(fn, return_exceptions=True, timeout=RUN_LIMIT)
    assert out[1] == "done"
    assert isinstance(out[0], CommAborted) and "rank 1 returned" in str(out[0])


@pytest.mark.spec("COMM-5")
def test_late_peer_gives_timeout() -> None:
    def fn(comm: Communicator) -> Any:
        if comm.rank == 1:
            time.sleep(0.5)
            try:
                comm.barrier()
            except CommTimeout as exc:
                return exc
            return "joined"
        t0 = time.monotonic()
        try:
            comm.barrier(timeout=0.2)
        except CommTimeout as exc:
            return (exc, time.monotonic() - t0)
        return "no timeout"

    (exc0, waited), exc1 = FakeWorld(2, timeout=60.0).run(fn, timeout=RUN_LIMIT)
    assert isinstance(exc0, CommTimeout) and "rank(s) [1] did not join" in str(exc0)
    assert waited >= 0.2
    assert isinstance(exc1, CommTimeout)  # the late rank learns the collective failed


@pytest.mark.spec("COMM-5")
def test_default_timeout_comes_from_the_world() -> None:
    def fn(comm: Communicator) -> Any:
        assert comm.timeout == 0.2
        if comm.rank == 0:
            return comm.gather(0)
        time.sleep(0.6)
        return None

    out = FakeWorld(2, timeout=0.2).run(fn, return_exceptions=True, timeout=RUN_LIMIT)
    assert isinstance(out[0], CommTimeout)
    assert out[1] is None


def _checkpoint_error(step: str, failing_rank: int) -> CheckpointError:
    try:
        raise OSError("disk full")
    except OSError as exc:
        return CheckpointError(step, {failing_rank: Failure.capture(failing_rank, step, exc)})


@pytest.mark.spec("COMM-34")
def test_equal_checkpoint_errors_are_re_raised_as_one() -> None:
    def fn(comm: Communicator) -> None:
        raise _checkpoint_error("write", 1)

    with pytest.raises(CheckpointError) as info:
        FakeWorld(3, coordinator_rank=1).run(fn, timeout=RUN_LIMIT)
    assert sorted(info.value.rank_failures) == [1] and info.value.step == "write"

    def differing(comm: Communicator) -> None:
        raise _checkpoint_error("write" if comm.rank else "plan", 1)

    with pytest.raises(RankFailures):
        FakeWorld(2).run(differing, timeout=RUN_LIMIT)


@pytest.mark.spec("COMM-34")
def test_partial_failure_reports_results_and_exceptions() -> None:
    def fn(comm: Communicator) -> int:
        if comm.rank == 1:
            raise _checkpoint_error("write", 1)
        return comm.rank * 10

    with pytest.raises(RankFailures) as info:
        FakeWorld(3).run(fn, timeout=RUN_LIMIT)
    assert list(info.value.exceptions) == [1]
    assert info.value.results == {0: 0, 2: 20}
    out = FakeWorld(3).run(fn, return_exceptions=True, timeout=RUN_LIMIT)
    assert out[0] == 0 and out[2] == 20 and isinstance(out[1], CheckpointError)


@pytest.mark.spec("COMM-35")
def test_run_timeout_names_running_ranks_and_aborts_them() -> None:
    seen: list[BaseException] = []
    done = threading.Event()

    def fn(comm: Communicator) -> None:
        if comm.rank == 1:
            time.sleep(1.0)
            return
        try:
            comm.barrier(timeout=60.0)
        except BaseException as exc:
            seen.append(exc)
            done.set()
            raise

    with pytest.raises(CommTimeout, match=r"rank\(s\) \[0, 1\] still running"):
        FakeWorld(2).run(fn, timeout=0.3)
    assert done.wait(10.0)
    assert isinstance(seen[0], CommAborted)
    assert "abandoned" in str(seen[0])


@pytest.mark.spec("COMM-36")
def test_collectives_from_a_rank_background_thread() -> None:
    def fn(comm: Communicator) -> list[Any]:
        box: list[Any] = []
        t = threading.Thread(target=lambda: box.append(comm.all_gather(comm.rank * 2)))
        t.start()
        t.join(10.0)
        box.append(comm.broadcast("after" if is_coordinator(comm) else None))
        return box

    assert FakeWorld(3).run(fn, timeout=RUN_LIMIT) == [[[0, 2, 4], "after"]] * 3


@pytest.mark.spec("COMM-3", "COMM-30")
def test_many_collectives_in_sequence() -> None:
    def fn(comm: Communicator) -> int:
        total = 0
        for i in range(300):
            total += sum(comm.all_gather(i + comm.rank))
        return total

    n = 4
    expected = sum(n * i + sum(range(n)) for i in range(300))
    assert FakeWorld(n).run(fn, timeout=RUN_LIMIT) == [expected] * n
