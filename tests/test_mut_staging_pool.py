"""The staging buffer pool under stale leases, failed copies, waiters and trims
(STAGE-3, STAGE-5, STAGE-11, STAGE-13, ASYNC-31).

Random sequences of acquire / copy done / copy failed / release, including
releases of leases that were already released or whose copy failed, check
STAGE-3's invariant: a buffer set held by a live lease is never handed out
again, and a stale lease never frees a newer lease's set.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from refdcp.staging.buffer_pool import BufferPool, Lease, StagingTimeoutError, allocate
from refdcp.staging.cpu_stager import CpuStager
from refdcp.staging.machine import LEASED, State
from refdcp.staging.tree import layout_of

LAYOUTS = [
    layout_of({"a": torch.zeros(4), "b": torch.zeros(2, 3, dtype=torch.float64)}),
    layout_of({"a": torch.zeros(5, dtype=torch.int8)}),
]

OPS = st.lists(
    st.tuples(st.sampled_from(["acquire", "done", "failed", "release", "trim"]), st.integers(0, 9)),
    max_size=30,
)


@pytest.mark.spec("STAGE-3", "STAGE-5")
@settings(max_examples=60)  # cheap examples
@given(st.integers(1, 2), OPS)
def test_a_stale_lease_never_frees_a_set_leased_again(
    max_sets: int, ops: list[tuple[str, int]]
) -> None:
    pool = BufferPool(max_sets=max_sets, wait_timeout=0.0)
    history: list[Lease] = []  # every lease ever handed out
    live: list[Lease] = []  # leases whose set is still theirs
    staging: set[int] = set()  # ids of live leases whose copy is not done yet
    for op, i in ops:
        if op == "acquire":
            try:
                lease = pool.acquire(LAYOUTS[i % 2])
            except StagingTimeoutError:
                assert len(live) == max_sets  # refused only when every set is leased
                continue
            assert all(lease.bset is not other.bset for other in live)
            history.append(lease)
            live.append(lease)
            staging.add(id(lease))
        elif op == "done" and live:
            lease = live[i % len(live)]
            if id(lease) in staging:
                pool.copy_done(lease)
                staging.discard(id(lease))
        elif op == "failed" and live:
            lease = live[i % len(live)]
            if id(lease) in staging:
                pool.copy_failed(lease)
                staging.discard(id(lease))
                live.remove(lease)
        elif op == "release" and history:
            lease = history[i % len(history)]  # possibly stale: released or failed before
            if lease in live and id(lease) in staging:
                continue  # the stager releases only a complete snapshot
            lease.release()
            if lease in live:
                live.remove(lease)
        elif op == "trim":
            held = pool.trim()
            assert held == sum(le.bset.nbytes for le in live)
        for lease in live:
            assert lease.bset.state in LEASED
        assert len(pool.states()) <= max_sets
    for lease in live:
        if id(lease) in staging:
            pool.copy_done(lease)
        lease.release()
    pool.close()


@pytest.mark.spec("STAGE-3")
def test_a_failed_copy_returns_the_set_once_and_its_lease_stays_spent() -> None:
    pool = BufferPool(max_sets=1, wait_timeout=0.0)
    failed = pool.acquire(LAYOUTS[0])
    pool.copy_failed(failed)
    pool.copy_failed(failed)  # a second report changes nothing
    again = pool.acquire(LAYOUTS[0])
    assert again.bset is failed.bset and again.bset.state is State.STAGING
    pool.copy_done(again)
    failed.release()  # the failed lease is spent: the set stays leased to `again`
    assert again.bset.state is State.STAGED
    with pytest.raises(StagingTimeoutError):
        pool.acquire(LAYOUTS[0])
    again.release()
    again.release()
    assert pool.acquire(LAYOUTS[0]).bset is failed.bset


def _waiter(pool: BufferPool, out: list[object], timeout: float) -> threading.Thread:
    def run() -> None:
        try:
            out.append(pool.acquire(LAYOUTS[0], timeout=timeout))
        except Exception as e:  # reported to the test
            out.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


@pytest.mark.spec("STAGE-5")
@pytest.mark.parametrize("how", ["release", "copy_failed"])
def test_a_waiting_acquire_is_woken_when_a_set_comes_back(how: str) -> None:
    pool = BufferPool(max_sets=1)
    held = pool.acquire(LAYOUTS[0])
    out: list[object] = []
    waiter = _waiter(pool, out, timeout=300.0)  # far beyond the join below: woken, not timed out
    time.sleep(0.05)  # let it block (if it has not, it finds the set free: same outcome)
    if how == "release":
        pool.copy_done(held)
        held.release()
    else:
        pool.copy_failed(held)
    waiter.join(60)
    assert not waiter.is_alive(), "the waiter was not woken by the returned set"
    assert len(out) == 1 and isinstance(out[0], Lease) and out[0].bset is held.bset


@pytest.mark.spec("STAGE-5")
def test_a_timeout_below_one_second_still_waits_for_a_release() -> None:
    # A pool that does not wait raises at once, every time; one that waits gets the set
    # released 20 ms later. Three tries keep a starved timer thread from failing the test.
    got = []
    for _ in range(3):
        pool = BufferPool(max_sets=1)
        held = pool.acquire(LAYOUTS[0])
        pool.copy_done(held)
        timer = threading.Timer(0.02, held.release)
        timer.start()
        try:
            got.append(pool.acquire(LAYOUTS[0], timeout=0.99).bset is held.bset)
        except StagingTimeoutError:
            got.append(False)
        timer.join()
        if got[-1]:
            break
    assert got[-1], got


@pytest.mark.spec("ASYNC-31", "STAGE-5")
def test_trim_frees_the_free_sets_and_keeps_the_leased_ones() -> None:
    pool = BufferPool(max_sets=2)
    free = pool.acquire(LAYOUTS[0])
    pool.copy_done(free)
    free.release()
    busy = pool.acquire(LAYOUTS[1])
    pool.copy_done(busy)
    assert pool.trim() == busy.bset.nbytes
    assert free.bset.state is State.CLOSED and free.bset.buffers == []
    assert pool.states() == [State.STAGED] and busy.bset.buffers
    busy.release()
    assert pool.trim() == 0 and pool.states() == [] and busy.bset.buffers == []
    again = pool.acquire(LAYOUTS[0])  # allocates what it needs again
    assert again.bset is not free.bset and pool.allocations == 3


@pytest.mark.spec("STAGE-11", "STAGE-13")
@pytest.mark.parametrize("share", [False, True])
def test_shared_memory_buffers_exactly_when_asked(share: bool) -> None:
    w = torch.arange(6.0)
    sd = {"w": w, "again": w, "n": 1, "z": torch.ones(2, dtype=torch.int64)}
    bufs = allocate(layout_of(sd), share_memory=share)
    assert bufs[1] is None  # the repeated tensor has no buffer of its own
    assert bufs[0] is not None and bufs[2] is not None  # the slots after it have theirs
    assert bufs[0].shape == (6,) and bufs[2].shape == (2,) and bufs[2].dtype == torch.int64
    assert [b.is_shared() for b in bufs if b is not None] == [share, share]
    stager = CpuStager(cache_staged_state_dict=True, share_memory=share, pin_memory=False)
    snap = stager.stage(sd)
    assert snap["w"].is_shared() == share and torch.equal(snap["w"], sd["w"])
    ptr = snap["w"].data_ptr()
    stager.release(snap)
    snap2 = stager.stage(sd)
    assert snap2["w"].data_ptr() == ptr and snap2["w"].is_shared() == share
    stager.release(snap2)
    stager.close()
