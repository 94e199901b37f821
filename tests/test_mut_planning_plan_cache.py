"""Plan caching: a changed structure is never served from the cache (PLAN-9, PLAN-11).

A model of PLAN-9's "structure" (FQNs in order, and for each value its kind,
shape, dtype, requires_grad and chunks; values excluded) decides when a rank
must send a marker. Over random sequences of saves that change one thing at a
time (a key added or renamed, a shape, a dtype, requires_grad, the chunks of a
``LocalShards``), cached saves write the same metadata as uncached ones, load
back the values of each save, and send a marker exactly when the model says
the structure is unchanged.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import refdcp
from refdcp.comm import FakeWorld
from refdcp.planning import DefaultSavePlanner, LocalShards

SINGLE_PATH = "mutation-kill tests pinning one module of the default path (tests/MUTATION.md); the behaviour runs on both in the shared suites"

warnings.filterwarnings("ignore", message="torch.distributed is disabled")


class RecordingPlanner(DefaultSavePlanner):
    """Records, per save, whether this rank sent a cached-plan marker."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.markers: list[bool] = []

    def create_local_plan(self) -> Any:
        plan = super().create_local_plan()
        self.markers.append(not plan.usable)
        return plan


# One variant of the state dict: everything PLAN-9 counts as structure.
VARIANT = st.fixed_dictionaries(
    {
        "shape": st.sampled_from([(4,), (2, 2), (1, 4)]),
        "dtype": st.sampled_from([torch.float32, torch.float64]),
        "grad": st.booleans(),
        "param": st.booleans(),  # Parameter or plain tensor: the same kind of value
        "objects": st.sampled_from([("step",), ("step", "epoch"), ("epoch",), ()]),
        "ls_dtype": st.sampled_from([torch.float32, torch.bfloat16]),
        "ls_grad": st.booleans(),
        "ls_rows": st.sampled_from([1, 2]),
    }
)


def _state(rank: int, world: int, step: int, v: dict[str, Any]) -> dict[str, Any]:
    w = torch.arange(float(step), float(step) + 4, dtype=v["dtype"]).reshape(v["shape"])
    w = w + rank * 10
    w = (
        torch.nn.Parameter(w, requires_grad=v["grad"])
        if v["param"]
        else w.requires_grad_(v["grad"])
    )
    rows = v["ls_rows"]
    chunk = torch.full((rows, 2), float(rank + step), dtype=v["ls_dtype"])
    sd: dict[str, Any] = {
        f"w{rank}": w,
        "sharded": LocalShards(
            (world * rows, 2), [((rank * rows, 0), chunk.requires_grad_(v["ls_grad"]))]
        ),
    }
    for name in v["objects"]:
        sd[name] = step * 100 + len(name)
    return sd


def _model(v: dict[str, Any]) -> tuple[Any, ...]:
    """PLAN-9's structure of ``_state``'s state dict, written out."""
    shape = tuple(v["shape"])
    return (
        shape,
        v["dtype"],
        v["grad"],
        v["objects"],
        v["ls_dtype"],
        v["ls_rows"],  # not ls_grad: a LocalShards records no requires_grad (PLAN-3)
    )


def _saves(world: int, variants: list[dict[str, Any]], caching: bool) -> Any:
    storage = refdcp.MemoryStorage()

    def rank(comm: Any) -> tuple[list[Any], list[bool]]:
        planner = RecordingPlanner(enable_plan_caching=caching)
        mds = []
        for step, v in enumerate(variants):
            sd = _state(comm.rank, world, step, v)
            md = refdcp.save(
                sd, storage_writer=storage.writer(f"c{step}"), planner=planner, comm=comm
            )
            mds.append(md.state_dict_metadata)
        return mds, planner.markers

    return storage, FakeWorld(world).run(rank)


def _zeroed(sd: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in sd.items():
        if isinstance(v, LocalShards):
            out[k] = LocalShards(v.shape, [(o, torch.zeros_like(t)) for o, t in v.chunks])
        elif isinstance(v, torch.Tensor):
            out[k] = torch.zeros_like(v.detach())
        else:
            out[k] = -1
    return out


def _loads_back(storage: Any, world: int, variants: list[dict[str, Any]]) -> None:
    for step, v in enumerate(variants):

        def rank(comm: Any, step: int = step, v: dict[str, Any] = v) -> None:
            want = _state(comm.rank, world, step, v)
            dest = _zeroed(want)
            refdcp.load(dest, storage_reader=storage.reader(f"c{step}"), comm=comm)
            for k, w in want.items():
                if isinstance(w, LocalShards):
                    for (_, a), (_, b) in zip(w.chunks, dest[k].chunks):
                        assert torch.equal(a.detach(), b), (step, k)
                elif isinstance(w, torch.Tensor):
                    assert torch.equal(dest[k], w.detach()), (step, k)
                else:
                    assert dest[k] == w, (step, k)

        FakeWorld(world).run(rank)


@pytest.mark.spec("PLAN-9", "PLAN-11")
@settings(max_examples=15, deadline=None)
@given(st.integers(1, 2), st.lists(VARIANT, min_size=2, max_size=4), st.data())
def test_a_changed_structure_is_never_served_from_the_cache(
    world: int, drawn: list[dict[str, Any]], data: st.DataObject
) -> None:
    # repeat some saves unchanged, so that the cache is hit as well as missed
    variants: list[dict[str, Any]] = []
    for v in drawn:
        variants.append(v)
        if data.draw(st.booleans()):
            variants.append(dict(v))
    storage, cached = _saves(world, variants, caching=True)
    _, plain = _saves(world, variants, caching=False)
    for r in range(world):
        for step in range(len(variants)):
            assert cached[r][0][step] == plain[r][0][step], (r, step)
    _loads_back(storage, world, variants)
    models = [_model(v) for v in variants]
    want = [False] + [models[i] == models[i - 1] for i in range(1, len(models))]
    for r in range(world):
        assert cached[r][1] == want, r


def _one_change(change: dict[str, Any]) -> tuple[list[bool], list[bool]]:
    """Markers of three cached saves on one rank: base, changed, changed again (repeat)."""
    base = {
        "shape": (4,),
        "dtype": torch.float32,
        "grad": False,
        "param": False,
        "objects": ("step",),
        "ls_dtype": torch.float32,
        "ls_grad": False,
        "ls_rows": 1,
    }
    variants = [base, {**base, **change}, {**base, **change}]
    storage, cached = _saves(1, variants, caching=True)
    _, plain = _saves(1, variants, caching=False)
    assert cached[0][0] == plain[0][0]
    _loads_back(storage, 1, variants)
    return cached[0][1], [False, False, True]


@pytest.mark.spec("PLAN-9", "PLAN-11")
@pytest.mark.parametrize(
    "change",
    [
        {"objects": ("step", "epoch")},  # an object key added
        {"objects": ("epoch",)},  # an object key renamed
        {"shape": (2, 2)},
        {"dtype": torch.float64},
        {"grad": True},
        {"ls_dtype": torch.bfloat16},
        {"ls_rows": 2},
    ],
    ids=repr,
)
def test_each_kind_of_change_invalidates_the_cache(change: dict[str, Any]) -> None:
    got, want = _one_change(change)
    assert got == want


@pytest.mark.spec("PLAN-9")
@pytest.mark.parametrize(
    "change",
    [{"param": True}, {"ls_grad": True}],  # same kind; a LocalShards records no requires_grad
    ids=repr,
)
def test_what_the_metadata_does_not_record_hits_the_cache(change: dict[str, Any]) -> None:
    got, _ = _one_change(change)
    assert got == [False, True, True]


class Checkpointable:
    """A value saved through torch's checkpointable protocol, with chosen tensor properties."""

    def __init__(self, rows: int, dtype: torch.dtype, props: dict[str, Any]) -> None:
        self.rows, self.dtype, self.props = rows, dtype, props

    def size(self) -> torch.Size:
        return torch.Size([4, 2])

    def __create_write_items__(self, fqn: str, obj: object) -> list[Any]:
        from torch.distributed.checkpoint.metadata import (
            ChunkStorageMetadata,
            MetadataIndex,
            TensorProperties,
        )
        from torch.distributed.checkpoint.planner import (
            TensorWriteData,
            WriteItem,
            WriteItemType,
        )

        off = torch.Size([0, 0])
        return [
            WriteItem(
                index=MetadataIndex(fqn, off),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(off, torch.Size([self.rows, 2])),
                    properties=TensorProperties(dtype=self.dtype, **self.props),
                    size=self.size(),
                ),
            )
        ]


class Sub(torch.Tensor):
    """A tensor subclass: planned through its write items, like any tensor-like value."""


STRUCTURE = st.fixed_dictionaries(
    {
        "keys": st.sampled_from([("a", "b"), ("b", "a"), ("a", "c")]),
        "shape": st.sampled_from([(4,), (2, 2)]),
        "dtype": st.sampled_from([torch.float32, torch.int64]),
        "grad": st.booleans(),
        "param": st.booleans(),
        "object": st.sampled_from([None, "step", "epoch"]),
        "cp_rows": st.sampled_from([2, 4]),
        "cp_dtype": st.sampled_from([torch.float32, torch.float16]),
        "cp_props": st.sampled_from(
            [{}, {"requires_grad": True}, {"memory_format": torch.channels_last}]
        ),
        "empty": st.sampled_from([None, "e", "f"]),
        "sub_shape": st.sampled_from([(3,), (1, 3)]),
    }
)


STRUCTURE_FIELDS = (
    "keys",
    "shape",
    "dtype",
    "grad",
    "param",
    "object",
    "cp_rows",
    "cp_dtype",
    "cp_props",
    "empty",
    "sub_shape",
)


def _structured(v: dict[str, Any], value: float) -> dict[str, Any]:
    dtype = v["dtype"]
    t = torch.full(v["shape"], value).to(dtype)
    if v["param"] or v["grad"]:
        t = torch.nn.Parameter(t.float() if v["grad"] else t, requires_grad=v["grad"])
    sd: dict[str, Any] = {
        v["keys"][0]: t,
        v["keys"][1]: Checkpointable(v["cp_rows"], v["cp_dtype"], v["cp_props"]),
    }
    if v["object"] is not None:
        sd[v["object"]] = value
    if v["empty"] is not None:
        sd[v["empty"]] = {}
    sd["sub"] = torch.full(v["sub_shape"], value).as_subclass(Sub)  # a tensor subclass
    return sd


def _structure_model(v: dict[str, Any]) -> tuple[Any, ...]:
    dtype = torch.float32 if v["grad"] else v["dtype"]  # a grad tensor is made float
    return (
        v["keys"],
        v["shape"],
        dtype,
        v["grad"],
        v["object"],
        v["cp_rows"],
        v["cp_dtype"],
        tuple(sorted(v["cp_props"].items(), key=str)),
        v["empty"],
        v["sub_shape"],
    )


_BASE = {
    "keys": ("a", "b"),
    "shape": (4,),
    "dtype": torch.float32,
    "grad": False,
    "param": False,
    "object": "step",
    "cp_rows": 2,
    "cp_dtype": torch.float32,
    "cp_props": {},
    "empty": None,
    "sub_shape": (3,),
}


@pytest.mark.spec("PLAN-9")
@settings(max_examples=60)  # cheap examples
@given(
    STRUCTURE,
    STRUCTURE,
    st.sets(st.sampled_from(sorted(STRUCTURE_FIELDS)), max_size=2),
    st.floats(-1, 1),
    st.floats(-1, 1),
)
@example(_BASE, {**_BASE, "cp_props": {"requires_grad": True}}, {"cp_props"}, 0.0, 1.0)
@example(_BASE, {**_BASE, "cp_props": {"memory_format": torch.channels_last}}, {"cp_props"}, 0, 0)
@example(_BASE, {**_BASE, "param": True}, {"param"}, 0.0, 0.5)
@example(_BASE, {**_BASE, "object": "epoch"}, {"object"}, 0.0, 0.0)
@example(_BASE, {**_BASE, "cp_dtype": torch.float16}, {"cp_dtype"}, 0.0, 0.0)
@example(_BASE, {**_BASE, "sub_shape": (1, 3)}, {"sub_shape"}, 0.0, 0.0)
def test_the_fingerprint_changes_exactly_when_the_structure_does(
    v1: dict[str, Any], other: dict[str, Any], changed: set[str], x1: float, x2: float
) -> None:
    v2 = {**v1, **{k: other[k] for k in changed}}  # a few fields changed, values always
    from refdcp.planning.flatten import flatten_state_dict
    from refdcp.planning.plan_cache import structure_fingerprint

    f1 = structure_fingerprint(flatten_state_dict(_structured(v1, x1)))
    f2 = structure_fingerprint(flatten_state_dict(_structured(v2, x2)))
    assert (f1 == f2) == (_structure_model(v1) == _structure_model(v2))


@pytest.mark.spec("PLAN-10", "DEDUP-13")
@pytest.mark.parametrize("odd", [1, 2])
def test_a_replica_that_diverges_from_its_own_class_is_caught_on_the_cached_path(
    odd: int,
) -> None:
    """Ranks 1 and 2 hold the same items (one class); the coordinator agrees with the other
    one, so only comparing the two peers with each other can find the disagreement."""
    from refdcp.errors import CheckpointError

    storage = refdcp.MemoryStorage()

    def rank(comm: Any) -> tuple[list[bool], str]:
        planner = RecordingPlanner(enable_plan_caching=True)
        for step in range(2):
            sd = {"w": torch.full((4,), float(step))}
            refdcp.save(sd, storage_writer=storage.writer(f"c{step}"), planner=planner, comm=comm)
        bad = {"w": torch.full((4,), 5.0 if comm.rank == odd else 1.0)}
        try:
            refdcp.save(bad, storage_writer=storage.writer("bad"), planner=planner, comm=comm)
        except CheckpointError as e:
            return planner.markers, str(e)
        return planner.markers, ""

    for markers, msg in FakeWorld(3).run(rank):
        assert markers == [False, True, True]
        assert "differ in value" in msg and "'w'" in msg and str(odd) in msg
