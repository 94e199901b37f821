"""CPU stagers: snapshot isolation, views, aliasing, leaves, caching (STAGE-6..STAGE-12, STAGE-16).

A test taking ``impl`` runs on ``refdcp.CpuStager`` and on the reference's
``refdcp.reference.CpuStager`` (a fresh copy each time, REF-10); the tests
without it check what only the fast stager has: cached buffers and their leases,
background copies.
"""

from __future__ import annotations

import gc
from collections import namedtuple
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import given
from hypothesis import strategies as st
from torch.distributed.checkpoint.staging import AsyncStager

import refdcp
import refdcp.reference
from refdcp.comm import SingleRank
from refdcp.errors import ProtocolError
from refdcp.planning.loadable import UnloadableValueError
from refdcp.staging import CpuStager, State

Pair = namedtuple("Pair", ["left", "right"])


class Opaque:
    def __init__(self, v: list[int]) -> None:
        self.v = v


def _sd() -> dict[str, object]:
    base = torch.arange(12, dtype=torch.float32)
    return {
        "w": torch.randn(3, 4),
        "view": base[2:5],
        "t": base.view(3, 4).t(),
        "nested": {"lst": [torch.ones(2, dtype=torch.int64), 7, "s"], "tup": (1.5, None)},
        "pair": Pair(torch.zeros(1, dtype=torch.bfloat16), b"x"),
        "empty": torch.zeros(0, 3),
        "flag": torch.tensor(True),
    }


@pytest.mark.spec("STAGE-6", "STAGE-9", "REF-10")
@pytest.mark.parametrize("cached", [False, True])
def test_snapshot_equal_and_isolated(impl: ModuleType, cached: bool) -> None:
    sd = _sd()
    stager = impl.CpuStager(cache_staged_state_dict=cached)
    snap = stager.stage(sd)
    assert snap.keys() == sd.keys()
    assert isinstance(snap["pair"], Pair) and isinstance(snap["nested"]["tup"], tuple)
    assert snap["nested"]["lst"][1:] == [7, "s"] and snap["pair"].right == b"x"
    before = {k: v.clone() for k, v in [("w", sd["w"]), ("view", sd["view"])]}
    for k in ("w", "view"):
        assert torch.equal(snap[k], before[k])
    # mutate every source tensor in place
    sd["w"].add_(1)  # type: ignore[union-attr]
    sd["view"].mul_(0)  # type: ignore[union-attr]
    sd["nested"]["lst"][0].fill_(9)  # type: ignore[index]
    assert torch.equal(snap["w"], before["w"]) and torch.equal(snap["view"], before["view"])
    assert torch.equal(snap["nested"]["lst"][0], torch.ones(2, dtype=torch.int64))
    assert snap["t"].shape == (4, 3) and snap["t"].is_contiguous()
    assert snap["flag"].item() is True and snap["empty"].shape == (0, 3)


@pytest.mark.spec("STAGE-7", "REF-10")
def test_view_stages_only_its_elements(impl: ModuleType) -> None:
    big = torch.arange(1_000_000, dtype=torch.float32)
    snap = impl.CpuStager().stage({"v": big[10:12]})
    assert snap["v"].tolist() == [10.0, 11.0]
    assert snap["v"].untyped_storage().nbytes() == 8


@pytest.mark.spec("STAGE-8", "REF-10")
@pytest.mark.parametrize("cached", [False, True])
def test_aliasing(impl: ModuleType, cached: bool) -> None:
    tied = torch.randn(4)
    base = torch.arange(6.0)
    sd = {"enc": tied, "dec": tied, "a": base[0:4], "b": base[2:6]}
    snap = impl.CpuStager(cache_staged_state_dict=cached).stage(sd)
    assert snap["enc"] is snap["dec"]
    snap["a"][2] = 100.0  # overlapping views are independent copies
    assert snap["b"][0].item() == 2.0


@pytest.mark.spec("STAGE-9", "REF-10")
def test_non_tensor_leaves_are_deep_copied(impl: ModuleType) -> None:
    obj = Opaque([1, 2])
    snap = impl.CpuStager().stage({"o": obj, "l": [obj.v]})
    obj.v.append(3)
    assert snap["o"].v == [1, 2] and snap["l"] == [[1, 2]]


class _Sub(torch.Tensor):
    """A tensor subclass: not a plain tensor, so type_check refuses it."""


@pytest.mark.spec("STAGE-10", "REF-10")
def test_type_check(impl: ModuleType) -> None:
    stager = impl.CpuStager(cache_staged_state_dict=True, type_check=True)
    with pytest.raises(TypeError, match=r"opt\.o"):
        stager.stage({"w": torch.zeros(2), "opt": {"o": Opaque([1])}})
    if impl is refdcp:
        assert stager.pool is not None and stager.pool.allocations == 0  # nothing copied
    ok = stager.stage({"w": torch.zeros(2), "n": 3, "s": "x", "z": None, "l": [(1.5, b"b")]})
    assert ok["n"] == 3 and ok["l"] == [(1.5, b"b")]
    assert impl.CpuStager(type_check=False).stage({"o": Opaque([1])})["o"].v == [1]
    shards = refdcp.LocalShards((2, 2), [((0, 0), torch.ones(1, 2))])
    assert isinstance(stager.stage({"s": shards})["s"], refdcp.LocalShards)  # accepted
    with pytest.raises(TypeError, match=r"s\.\('chunk', 0\)"):
        stager.stage({"s": refdcp.LocalShards((2, 2), [((0, 0), _Sub(torch.ones(1, 2)))])})


@pytest.mark.spec("STAGE-11", "STAGE-12")
def test_cached_buffers_reused_after_release() -> None:
    stager = CpuStager(cache_staged_state_dict=True, pin_memory=False)
    src = {"w": torch.randn(64), "b": torch.randn(3)}
    s1 = stager.stage(src)
    ptr = s1["w"].data_ptr()
    s2 = stager.stage(src)  # s1 still leased: a second set
    assert s2["w"].data_ptr() != ptr
    assert stager.pool is not None and stager.pool.allocations == 2
    stager.release(s1)
    stager.release(s1)  # idempotent
    s3 = stager.stage(src)
    assert s3["w"].data_ptr() == ptr and stager.pool.allocations == 2
    assert torch.equal(s3["w"], src["w"])


@pytest.mark.spec("STAGE-12", "STAGE-4")
def test_lease_released_by_garbage_collection_only() -> None:
    stager = CpuStager(cache_staged_state_dict=True, pin_memory=False)
    snap = stager.stage({"w": torch.zeros(8)})
    assert stager.pool is not None and stager.pool.states() == [State.STAGED]
    with pytest.raises(ProtocolError):
        stager.close()
    del snap
    gc.collect()
    assert stager.pool.states() == [State.RELEASED]
    stager.close()


@pytest.mark.spec("STAGE-16", "REF-10")
def test_works_as_torch_async_stager(impl: ModuleType, tmp_path: Path) -> None:
    stager = impl.CpuStager(cache_staged_state_dict=True)
    assert isinstance(stager, AsyncStager)
    assert stager.should_synchronize_after_execute is False
    w = torch.randn(16)
    expected = w.clone()
    fut = dcp.async_save({"w": w}, checkpoint_id=str(tmp_path), async_stager=stager, no_dist=True)
    w.add_(1)  # after async_save returned: must not reach the checkpoint
    fut.result(timeout=60)  # type: ignore[union-attr]
    out = {"w": torch.empty(16)}
    dcp.load(out, checkpoint_id=str(tmp_path), no_dist=True)
    assert torch.equal(out["w"], expected)
    stager.synchronize_staging()
    if impl is refdcp:
        gc.collect()  # torch never calls release(): the snapshot's collection frees the lease
        assert stager.pool is not None
        assert State.STAGED not in stager.pool.states()
    stager.close()


@pytest.mark.spec("STAGE-6", "STAGE-7", "REF-10")
@given(
    shape=st.lists(st.integers(0, 5), min_size=1, max_size=3),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.int8, torch.bool]),
    step=st.integers(1, 2),
    cached=st.booleans(),
)
def test_random_tensors_roundtrip(
    impl: ModuleType, shape: list[int], dtype: torch.dtype, step: int, cached: bool
) -> None:
    src = torch.randn(*[s * step for s in shape]).to(dtype)
    view = src[tuple(slice(None, None, step) for _ in shape)]
    snap = impl.CpuStager(cache_staged_state_dict=cached).stage({"v": view})
    assert snap["v"].dtype == dtype and snap["v"].shape == view.shape
    assert torch.equal(snap["v"], view)
    assert snap["v"].untyped_storage().nbytes() == view.numel() * view.element_size()


@pytest.mark.spec("STAGE-17", "REF-10")
@pytest.mark.parametrize("cached", [False, True])
def test_local_shards_stage_their_chunks(impl: ModuleType, tmp_path: Path, cached: bool) -> None:
    a, b = torch.arange(6.0).reshape(2, 3), torch.arange(6.0, 9.0).reshape(1, 3)
    shards = refdcp.LocalShards((4, 3), [((0, 0), a), ((3, 0), b)])
    stager = impl.CpuStager(cache_staged_state_dict=cached)
    snap = stager.stage({"w": shards})
    w = snap["w"]
    assert isinstance(w, refdcp.LocalShards) and tuple(w.shape) == (4, 3)
    assert [tuple(off) for off, _ in w.chunks] == [(0, 0), (3, 0)]
    assert all(t.data_ptr() != s.data_ptr() for (_, t), (_, s) in zip(w.chunks, shards.chunks))
    # a chunk that is a view stages only its own elements (STAGE-7)
    big = torch.arange(100.0)
    viewed = stager.stage({"v": refdcp.LocalShards((2,), [((0,), big[3:5])])})["v"]
    assert viewed.chunks[0][1].untyped_storage().nbytes() == 8
    if impl is refdcp:
        stager.release(viewed)
    a.add_(100)
    assert torch.equal(w.chunks[0][1], torch.arange(6.0).reshape(2, 3))
    if impl is refdcp:
        stager.release(snap)
    # and through async_save end to end
    full = refdcp.LocalShards((2, 3), [((0, 0), torch.ones(2, 3))])
    handle = impl.async_save({"w": full}, checkpoint_id=str(tmp_path), no_dist=True, stager=stager)
    handle.staged.result(timeout=60)
    full.chunks[0][1].zero_()
    handle.result(timeout=60)
    out = {"w": torch.zeros(2, 3)}
    impl.load(out, checkpoint_id=str(tmp_path), comm=SingleRank())
    assert torch.equal(out["w"], torch.ones(2, 3))
    stager.close()


@pytest.mark.spec("STAGE-18", "STAGE-6")
@pytest.mark.parametrize("cached", [False, True])
def test_background_copy_returns_a_future_and_isolates_after_it(
    tmp_path: Path, cached: bool
) -> None:
    from concurrent.futures import Future

    import refdcp
    from refdcp.asyncsave.save import InFlightLimiter, async_save

    stager = CpuStager(cache_staged_state_dict=cached, background_copy=True)
    src = {"w": torch.arange(1 << 16, dtype=torch.float32), "step": 3}
    fut = stager.stage(src)
    assert isinstance(fut, Future)
    stager.synchronize_staging()
    assert fut.done()
    snap = fut.result()
    src["w"].add_(1)
    assert torch.equal(snap["w"], torch.arange(1 << 16, dtype=torch.float32)) and snap["step"] == 3
    stager.release(snap)
    limiter = InFlightLimiter(2)
    for i in range(3):
        handle = async_save(
            {"w": src["w"], "step": i},
            checkpoint_id=str(tmp_path / f"c{i}"),
            no_dist=True,
            stager=stager,
            limiter=limiter,
        )
        handle.staged.result(timeout=60)
        expected = src["w"].clone()
        src["w"].mul_(-1)  # after staged: never reaches checkpoint i
        handle.result(timeout=60)
        out = {"w": torch.zeros(1 << 16), "step": -1}
        refdcp.load(out, checkpoint_id=str(tmp_path / f"c{i}"), no_dist=True)
        assert torch.equal(out["w"], expected) and out["step"] == i
    stager.close()


@pytest.mark.spec("STAGE-18")
def test_background_copy_failure_reaches_the_future() -> None:
    stager = CpuStager(cache_staged_state_dict=True, background_copy=True)

    class Exploding:
        def __deepcopy__(self, memo: object) -> object:
            raise RuntimeError("cannot copy this leaf")

    fut = stager.stage({"w": torch.ones(4), "bad": Exploding()})
    # the failure names the key (ASYNC-17)
    with pytest.raises(UnloadableValueError, match="cannot copy") as info:
        fut.result(timeout=60)
    assert "'bad'" in str(info.value) and isinstance(info.value.__cause__, RuntimeError)
    stager.synchronize_staging()  # does not raise: the Future reports the error
    stager.close()  # the failed copy's buffers were returned: closing is allowed


def _dtensor_rank(rank: int, world: int, root: str) -> list[Any]:
    """Both stagers and both async_saves on one 2-rank gloo world (one spawn for the two paths)."""
    from torch.distributed._shard.sharded_tensor import Shard as TShard
    from torch.distributed._shard.sharded_tensor import ShardedTensor, ShardMetadata
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    import refdcp
    import refdcp.reference
    from refdcp.asyncsave.save import InFlightLimiter

    mesh = init_device_mesh("cpu", (world,))
    full = torch.arange(24.0).reshape(6, 4)
    checks: list[Any] = []
    for impl in (refdcp, refdcp.reference):
        src = {
            "w": distribute_tensor(full.clone(), mesh, [Shard(0)]),
            "b": distribute_tensor(torch.ones(3), mesh, [Replicate()]),
        }
        stager = impl.CpuStager(cache_staged_state_dict=True, type_check=True)
        snap = stager.stage(src)
        w = snap["w"]
        checks += [
            isinstance(w, DTensor),
            w.placements == src["w"].placements and tuple(w.shape) == (6, 4),
            torch.equal(w.to_local(), src["w"].to_local()),
            w.to_local().data_ptr() != src["w"].to_local().data_ptr(),
        ]
        # a ShardedTensor is deep-copied: torch's own deepcopy copies its local shards
        local = torch.full((3, 4), float(rank))
        metas = [ShardMetadata([r * 3, 0], [3, 4], f"rank:{r}/cpu") for r in range(world)]
        sharded = ShardedTensor._init_from_local_shards([TShard(local, metas[rank])], (6, 4))
        staged = impl.CpuStager().stage({"st": sharded})["st"]
        local.add_(10)  # after staging
        got = staged.local_shards()[0].tensor
        checks.append(
            isinstance(staged, ShardedTensor) and torch.equal(got, torch.full((3, 4), float(rank)))
        )
        if impl is refdcp:
            ptr = w.to_local().data_ptr()
            stager.release(snap)
            again = stager.stage(src)
            checks.append(again["w"].to_local().data_ptr() == ptr)  # the pooled buffer is reused
            stager.release(again)
            limiter: Any = InFlightLimiter(1)
        else:
            limiter = refdcp.reference.InFlightLimiter(1)
        path = f"{root}/{impl.__name__}"
        handle = impl.async_save(src, checkpoint_id=path, stager=stager, limiter=limiter)
        handle.staged.result(timeout=60)
        src["w"].to_local().zero_()  # after staging: must not reach the checkpoint
        handle.result(timeout=120)
        for reader in (refdcp, refdcp.reference):  # each loads the other's async save
            out = {"w": torch.zeros(6, 4), "b": torch.zeros(3)}
            reader.load(out, checkpoint_id=path, comm=SingleRank())
            checks.append(torch.equal(out["w"], full) and torch.equal(out["b"], torch.ones(3)))
        stager.close()
    return checks


@pytest.mark.spec("STAGE-19", "REF-10", "REF-11")
@pytest.mark.dist
def test_dtensor_stages_its_local_shard_into_the_pool(tmp_path: Path) -> None:
    from refdcp.testing.spawn import run_gloo

    results = run_gloo(2, _dtensor_rank, str(tmp_path / "ck"), timeout=150.0)
    assert results == [[True] * 15, [True] * 15]


@pytest.mark.spec("REF-10")
def test_the_reference_stager_keeps_nothing() -> None:
    stager = refdcp.reference.CpuStager(cache_staged_state_dict=True)
    assert stager.should_synchronize_after_execute is False
    src = {"w": torch.arange(4.0)}
    first, second = stager.stage(src), stager.stage(src)  # a fresh copy each time
    assert type(first) is dict and first["w"].data_ptr() != second["w"].data_ptr()
    stager.synchronize_staging()
    stager.close()
    assert torch.equal(stager.stage(src)["w"], src["w"])  # close freed nothing it needs
    assert refdcp.reference.release_staging_buffers() == 0
    options = ("pin_memory", "share_memory", "max_buffer_sets", "max_bytes", "wait_timeout")
    for option in (*options, "background_copy"):
        CpuStager(**{option: 1})  # the fast stager's own options
        with pytest.raises(TypeError):
            refdcp.reference.CpuStager(**{option: 1})


class _Uncopyable:
    def __deepcopy__(self, memo: object) -> object:
        raise RuntimeError("this leaf cannot be copied")


@pytest.mark.spec("ASYNC-17", "REF-10")
@pytest.mark.parametrize(
    ("value", "cause"),
    [(_Uncopyable(), RuntimeError), (torch.empty(2, device="meta"), NotImplementedError)],
    ids=["leaf", "meta"],
)
def test_a_value_that_cannot_be_staged_is_named(
    impl: ModuleType, value: Any, cause: type[BaseException]
) -> None:
    with pytest.raises(UnloadableValueError) as info:
        impl.CpuStager().stage({"ok": torch.ones(2), "opt": [{"x": 1}, (2, {"bad": value})]})
    assert "'opt.1.1.bad'" in str(info.value) and type(value).__name__ in str(info.value)
    assert isinstance(info.value.__cause__, cause)


leaves = st.one_of(
    st.integers(-3, 3),
    st.text("ab", max_size=2),
    st.none(),
    st.builds(lambda n, s: torch.arange(float(n * 2))[::s], st.integers(0, 3), st.integers(1, 2)),
)
trees = st.recursive(
    leaves,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.lists(inner, max_size=3).map(tuple),
        st.lists(inner, min_size=2, max_size=2).map(lambda v: Pair(*v)),
        st.dictionaries(st.text("xyz", min_size=1, max_size=2), inner, max_size=3),
    ),
    max_leaves=10,
)


def _same(a: Any, b: Any) -> bool:
    """Equal trees: same container types and keys, equal tensors (shape, dtype, values, contiguous)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.is_contiguous() and b.is_contiguous() and torch.equal(a, b)
    return bool(a == b)


@pytest.mark.spec("REF-10", "STAGE-8", "STAGE-9")
@given(tree=trees, tie=st.booleans())
def test_the_reference_stager_stages_as_the_fast_one(tree: Any, tie: bool) -> None:
    """Differential: the same snapshot from both stagers, and the same aliasing (REF-10)."""
    shared = torch.arange(3.0)
    sd = {"tree": tree, "a": shared, "b": shared if tie else shared.clone()}
    fast = CpuStager().stage(sd)
    ref = refdcp.reference.CpuStager().stage(sd)
    assert _same(dict(fast), ref)
    assert (ref["a"] is ref["b"]) is tie and (fast["a"] is fast["b"]) is tie
