"""The reference's own leaves equal the fast path's (REF-14, REF-15, REF-16).

Flattening and its structure record (planning/flatten.py), the load policy
(planning/load_policy.py), the allow-list of non-tensor values
(storage/metadata/safe_globals.py) and ``LocalShards`` (planning/local_shards.py)
each have a readable twin in refdcp/reference/; these differential tests hold
each pair equal on generated inputs, refusals included.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import datetime
import decimal
import enum
import io
import operator
import os
import pathlib
import pickle
import re
import uuid
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import example, given
from hypothesis import strategies as st
from torch.distributed.checkpoint import default_planner as tp
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

import refdcp
import refdcp.reference
from refdcp.comm import FakeWorld, SingleRank
from refdcp.planning import LoadPolicy, LoadPolicyError
from refdcp.planning import flatten as fast_flatten
from refdcp.planning.load_policy import check_load as fast_check_load
from refdcp.planning.local_shards import LocalShards as FastShards
from refdcp.reference import flatten as ref_flatten
from refdcp.reference import policy
from refdcp.reference.local_shards import LocalShards as RefShards
from refdcp.storage import UnsafeObjectError
from refdcp.storage.metadata import safe_globals as fast_globals
from refdcp.tools.learner_path import learner_path

warnings.filterwarnings("ignore", message="torch.distributed is disabled")

SINGLE_PATH = (
    "differential: each test runs the reference's leaf modules and the fast ones and compares"
)


# --- flattening (REF-14) ---------------------------------------------------------------

keys = st.one_of(
    st.sampled_from(["a", "b", "a.b", "0", "", ref_flatten.RESERVED_KEY]),
    st.integers(0, 2),
    st.booleans(),
    st.none(),
    st.sampled_from([1.5, b"k", frozenset({1}), (1, "x")]),  # odd keys: kept or stringified
)
leaves = st.one_of(
    st.integers(-2, 2),
    st.text(max_size=2),
    st.none(),
    st.builds(lambda n: torch.arange(float(n)), st.integers(0, 3)),
    st.just(RefShards((2,), [((0,), torch.ones(2))])),
)
nested = st.recursive(
    leaves,
    lambda children: st.one_of(
        st.dictionaries(keys, children, max_size=3),
        st.lists(children, max_size=3),
        st.lists(children, max_size=3).map(tuple),
    ),
    max_leaves=10,
)
state_dicts = st.dictionaries(keys, nested, max_size=4)

#: every rule of FLAT-1..4 at least once, whatever the profile draws
RULES = {
    "tuple": (1, ({"a": torch.ones(1), "b": 2}, "x"), [2, (torch.ones(2), 3)]),
    "plain_tuple": (1, (2, {"b": 3}), [4]),
    "list": [1, [2, (3, torch.zeros(1))], {"c": 5}],
    "plain_list": [1, [2, (3,)], "s"],
    "empty": {"d": {}, "e": [], "f": ()},
    1: {None: [{}, {}], 2.5: torch.ones(1)},
    b"k": {frozenset({1}): "odd", True: torch.ones(1)},
}


def _fast(sd: Any) -> Any:
    flat = fast_flatten.flatten_state_dict(sd)
    return flat, fast_flatten.encode_structure(flat)


def _ref(sd: Any) -> Any:
    flat = ref_flatten.flatten(sd)
    return flat, ref_flatten.structure(flat)


def _outcome(fn: Any, sd: Any) -> Any:
    try:
        return fn(sd)
    except (ValueError, TypeError) as exc:
        return exc


@pytest.mark.spec("REF-14", "FLAT-1", "FLAT-5", "FLAT-6")
@example(RULES)
@example({"a.b": 1, "a": {"b": 2}})
@given(st.one_of(state_dicts, nested))
def test_reference_flattening_equals_the_fast_one(sd: Any) -> None:
    fast, ref = _outcome(_fast, sd), _outcome(_ref, sd)
    if isinstance(fast, Exception):  # the same refusal: type and message (it names the keys)
        assert type(ref) is type(fast) and str(ref) == str(fast)
        return
    assert not isinstance(ref, Exception), ref
    (fflat, fstruct), (rflat, rstruct) = fast, ref
    assert list(rflat.items) == list(fflat.items)
    assert all(rflat.items[k] is fflat.items[k] for k in fflat.items)
    assert rflat.paths == fflat.paths and rflat.rich == fflat.rich
    assert rflat.empties == fflat.empties
    assert rstruct == fstruct  # planner_data[RESERVED_KEY]'s structure part (REF-3)
    assert {**rflat.paths, "r": rstruct} == {**fflat.paths, "r": fstruct}


@pytest.mark.spec("REF-14", "FLAT-6")
def test_refusals_name_both_paths_and_the_reserved_key() -> None:
    for sd in ({"a.b": 1, "a": {"b": 2}}, {ref_flatten.RESERVED_KEY: torch.ones(1)}, [1]):
        fast, ref = _outcome(_fast, sd), _outcome(_ref, sd)
        assert isinstance(fast, Exception) and type(ref) is type(fast)
        assert str(ref) == str(fast)
    assert "['a.b'] and ['a']['b']" in str(_outcome(_ref, {"a.b": 1, "a": {"b": 2}}))


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return a is b
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(map(_same, a, b))
    return bool(a == b)


@pytest.mark.spec("REF-14", "FLAT-1", "FLAT-4")
@example(RULES, True)
@example(RULES, False)
@given(state_dicts, st.booleans())
def test_set_by_rich_path_equals_the_fast_one(sd: dict[Any, Any], from_empty: bool) -> None:
    try:
        flat = fast_flatten.flatten_state_dict(sd)
    except ValueError:
        return
    fast_root: dict[Any, Any] = {} if from_empty else copy.copy(sd)
    ref_root: dict[Any, Any] = {} if from_empty else copy.copy(sd)
    for n, (fqn, path) in enumerate(flat.rich.items()):
        fast_flatten.set_by_rich_path(fast_root, path, ("new", n))
        ref_flatten.set_by_rich_path(ref_root, path, ("new", n))
        assert _same(ref_root, fast_root), fqn
    for path in flat.empties:  # a value where an empty mapping was
        fast_flatten.set_by_rich_path(fast_root, path, "x")
        ref_flatten.set_by_rich_path(ref_root, path, "x")
    assert _same(ref_root, fast_root)


# --- load policy (REF-15) --------------------------------------------------------------

DTYPES = [torch.float32, torch.float16, torch.int64]
shapes = st.lists(st.integers(0, 3), min_size=0, max_size=2).map(tuple)
dest_values = st.one_of(
    st.builds(lambda s, d: torch.zeros(s, dtype=d), shapes, st.sampled_from(DTYPES)),
    st.builds(
        lambda s, d: RefShards(s, [], dtype=d),
        st.just((2, 3)),
        st.sampled_from(DTYPES),
    ),
    st.sampled_from([None, 3, "x", [1]]),
)
saved_values = st.one_of(
    st.builds(
        lambda s, d: TensorStorageMetadata(TensorProperties(dtype=d), torch.Size(s), []),
        shapes,
        st.sampled_from(DTYPES),
    ),
    st.just(BytesStorageMetadata()),
)
fqns = st.sampled_from(["a", "b", "c.d", "e"])


def _tsm(dtype: torch.dtype, size: tuple[int, ...]) -> TensorStorageMetadata:
    return TensorStorageMetadata(TensorProperties(dtype=dtype), torch.Size(size), [])


#: a destination and metadata with every kind of problem (POLICY-2..5) and a fitting key
_EVERY_PROBLEM = (
    {
        "a": torch.zeros(2, dtype=torch.float16),  # dtype differs
        "b": 3,  # an object where a tensor was saved
        "c.d": torch.zeros(1),  # a tensor where an object was saved
        "e": RefShards((2, 3), [], dtype=torch.float32),  # shape differs
        "f": torch.zeros(1),  # missing from the checkpoint
        "g": torch.zeros(2, 2),  # fits
        "h": "obj",  # fits
    },
    {
        "a": _tsm(torch.float32, (2,)),
        "b": _tsm(torch.float32, (1,)),
        "c.d": BytesStorageMetadata(),
        "e": _tsm(torch.float32, (3, 2)),
        "g": _tsm(torch.float32, (2, 2)),
        "h": BytesStorageMetadata(),
        "u": BytesStorageMetadata(),  # unexpected
    },
)


@pytest.mark.spec("REF-15", "POLICY-1", "POLICY-2", "POLICY-3", "POLICY-4", "POLICY-5")
@example(*_EVERY_PROBLEM, True, True, False)
@example(*_EVERY_PROBLEM, False, False, True)
@given(
    st.dictionaries(fqns, dest_values, max_size=4),
    st.dictionaries(fqns, saved_values, max_size=4),
    st.booleans(),
    st.booleans(),
    st.booleans(),
)
def test_reference_load_policy_equals_the_fast_one(
    dest: dict[str, Any], saved: dict[str, Any], strict: bool, unexpected: bool, cast: bool
) -> None:
    fast = fast_check_load(dest, saved, LoadPolicy(strict, unexpected, cast))
    ref = policy.check_load(
        dest, saved, strict=strict, reject_unexpected=unexpected, allow_cast=cast
    )
    assert ref == fast


@pytest.mark.spec("REF-15", "POLICY-1")
def test_reference_load_raises_the_fast_paths_policy_error(tmp_path: Path) -> None:
    refdcp.save({"w": torch.ones(2, 3), "s": 1}, checkpoint_id=tmp_path, no_dist=True)
    messages = []
    for impl in (refdcp, refdcp.reference):
        with pytest.raises(refdcp.CheckpointError) as err:
            impl.load(
                {"w": torch.ones(3, 3), "m": torch.ones(1)},
                checkpoint_id=tmp_path,
                comm=SingleRank(),
            )
        (exc,) = [f.exception for f in err.value.rank_failures.values()]
        assert type(exc) is LoadPolicyError
        messages.append(exc.problems)
    assert messages[0] == messages[1] and len(messages[0]) == 2


# --- the allow-list of non-tensor values (REF-15) --------------------------------------


def _entries(allowed: list[Any]) -> tuple[set[Any], list[Any]]:
    """(the entries, the ``bytes()`` stand-ins): each path has its own stand-in function."""
    plain = {g for g in allowed if not (isinstance(g, tuple) and g[1] == "builtins.bytes")}
    return plain, [g[0] for g in allowed if g not in plain]


@pytest.mark.spec("REF-15", "LOAD-7")
def test_reference_allow_list_equals_the_fast_one() -> None:
    fast, fast_bytes = _entries(fast_globals.default_safe_globals())
    ref, ref_bytes = _entries(policy.allow_list())
    assert ref == fast and np.ndarray in ref and argparse.Namespace in ref
    assert len(ref_bytes) == len(fast_bytes) == 1
    for stand_in in (*ref_bytes, *fast_bytes):
        assert stand_in() == b""
        with pytest.raises(pickle.UnpicklingError, match="only bytes"):
            stand_in(3)


class Color(enum.Enum):
    RED = 1


@dataclasses.dataclass
class Config:
    lr: float = 0.1


class _Reduces:
    """A value whose pickle calls ``fn(*args)``: what a hostile checkpoint holds."""

    def __init__(self, fn: Any, args: tuple[Any, ...]) -> None:
        self.fn, self.args = fn, args

    def __reduce__(self) -> tuple[Any, ...]:
        return (self.fn, self.args)


VALUES = [
    1,
    "s",
    {"k": [1, 2.5, None]},
    (1, "a"),
    {3, 4},
    bytearray(b"xy"),
    io.BytesIO(b"abc"),
    io.BytesIO(),
    np.arange(4.0),
    np.zeros(2, dtype=[("x", "f4")]),
    np.int32(5),
    np.random.RandomState(1).get_state(),
    argparse.Namespace(a=1),
    datetime.datetime(2024, 1, 2, tzinfo=datetime.timezone.utc),
    decimal.Decimal("1.5"),
    uuid.UUID(int=3),
    frozenset({1}),
    slice(1, 2),
    range(3),
    pathlib.PurePosixPath("/x"),
    Config(),
    Color.RED,
    _Reduces(os.getcwd, ()),
    _Reduces(eval, ("1 + 1",)),
    _Reduces(bytes, (3,)),
    _Reduces(operator.attrgetter, ("real",)),
    _Reduces(getattr, (1, "real")),
    _Reduces(bytes, ()),
]
values = st.recursive(
    st.sampled_from(VALUES),
    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=2), c, max_size=2),
    max_leaves=4,
)


def _fast_unpickle(data: bytes, extra: list[Any]) -> Any:
    """What refdcp's load planner does with a BYTE_IO value's bytes (LOAD-7..9)."""
    try:
        return fast_globals.load_weights_only(io.BytesIO(data), extra)
    except pickle.UnpicklingError as exc:
        text = str(exc)
        return UnsafeObjectError(
            "k", fast_globals.refused_global(text), fast_globals.unpickler_detail(text)
        )


def _ref_unpickle(data: bytes, extra: list[Any]) -> Any:
    try:
        return policy.unpickle_value("k", io.BytesIO(data), extra)
    except UnsafeObjectError as exc:
        return exc


def _comparable(value: Any) -> Any:
    """A value both loads must give equally: exceptions by their facts, the rest by pickle."""
    if isinstance(value, UnsafeObjectError):
        return ("refused", value.fqn, value.refused, value.detail, str(value))
    if isinstance(value, io.BytesIO):
        return ("BytesIO", value.getvalue(), value.tell())
    return pickle.dumps(value, protocol=4)


@pytest.mark.spec("REF-15", "LOAD-7", "LOAD-8", "LOAD-9")
@given(values, st.sampled_from([[], [Config], [Color, Config]]))
def test_reference_unpickling_accepts_and_refuses_as_the_fast_path(
    value: Any, extra: list[Any]
) -> None:
    _unpickle_alike(value, extra)


@pytest.mark.spec("REF-15", "LOAD-7", "LOAD-9")
@pytest.mark.parametrize("value", VALUES, ids=lambda v: type(v).__name__)
def test_every_sample_value_unpickles_alike(value: Any) -> None:
    _unpickle_alike(value, [])


def _unpickle_alike(value: Any, extra: list[Any]) -> None:
    buf = io.BytesIO()
    torch.save(value, buf)
    fast, ref = _fast_unpickle(buf.getvalue(), extra), _ref_unpickle(buf.getvalue(), extra)
    assert type(ref) is type(fast)
    assert _comparable(ref) == _comparable(fast)


@pytest.mark.spec("REF-15", "LOAD-9")
@pytest.mark.parametrize(
    ("value", "refused"),
    [
        (_Reduces(os.getcwd, ()), "posix.getcwd"),
        (_Reduces(eval, ("1",)), "eval"),  # torch names builtins without their module
        (Config(), f"{__name__}.Config"),
        (_Reduces(bytes, (3,)), None),
    ],
)
def test_hostile_values_are_refused_unrun_by_both(value: Any, refused: str | None) -> None:
    buf = io.BytesIO()
    torch.save(value, buf)
    for outcome in (_ref_unpickle(buf.getvalue(), []), _fast_unpickle(buf.getvalue(), [])):
        assert isinstance(outcome, UnsafeObjectError) and outcome.refused == refused
    if isinstance(value, Config):  # the option the message names makes it load (LOAD-8)
        assert policy.unpickle_value("k", io.BytesIO(buf.getvalue()), [Config]) == Config()


# --- LocalShards (REF-16) --------------------------------------------------------------

boxes = st.lists(
    st.tuples(
        st.lists(st.integers(-1, 4), min_size=2, max_size=2), st.tuples(*[st.integers(0, 3)] * 2)
    ),
    max_size=4,
)


def _chunks(spec: list[Any]) -> list[Any]:
    return [
        (off, torch.full(size, float(i), dtype=torch.float16 if i == 3 else torch.float32))
        for i, (off, size) in enumerate(spec)
    ]


def _construct(cls: Any, shape: tuple[int, ...], chunks: list[Any], dtype: Any) -> Any:
    try:
        return cls(shape, chunks, dtype=dtype)
    except ValueError as exc:
        return exc


OVERLAP = re.compile(r"chunks at \((.*)\) and \((.*)\) overlap")


def _overlapping(message: str, spec: list[Any]) -> bool:
    """The overlap message names two non-empty chunks that share an element."""
    m = OVERLAP.fullmatch(message)
    assert m is not None, message
    a, b = ([int(x) for x in g.split(",") if x.strip()] for g in m.groups())
    found = [(list(off), size) for off, size in spec if list(off) in (a, b) and 0 not in size]
    return any(
        all(p < q + m_ and q < p + n for p, n, q, m_ in zip(x[0], x[1], y[0], y[1]))
        for i, x in enumerate(found)
        for y in found[i + 1 :]
    )


@pytest.mark.spec("REF-16", "PLAN-3", "PLAN-4")
@example((4, 4), [([0, 0], (2, 2)), ([1, 1], (2, 2))], None)  # overlap
@example((4, 4), [([0, 0], (0, 2)), ([0, 0], (2, 2)), ([2, 0], (2, 4))], None)  # empty + full
@example((4, 4), [([3, 0], (2, 2))], None)  # out of bounds
@example((4, 4), [([-1, 0], (1, 1))], torch.float32)  # negative offset
@example((4, 4), [([0, 0], (1, 1))] * 4, None)  # mixed dtypes (the 4th is float16)
@example((4, 4), [([0, 0], (1, 1))], torch.float16)  # dtype= differs
@example((4, 4), [], None)  # no chunks, no dtype
@example((0, 4), [], torch.float16)  # no elements (PLAN-13)
@given(
    st.tuples(st.integers(0, 4), st.integers(0, 4)),
    boxes,
    st.sampled_from([None, torch.float32, torch.float16]),
)
def test_reference_local_shards_equal_the_fast_ones(
    shape: tuple[int, int], spec: list[Any], dtype: Any
) -> None:
    chunks = _chunks(spec)  # one set of tensors: both hold the very same chunks
    fast, ref = (
        _construct(FastShards, shape, chunks, dtype),
        _construct(RefShards, shape, chunks, dtype),
    )
    if isinstance(fast, ValueError):
        assert isinstance(ref, ValueError)
        if "overlap" in str(fast):
            assert _overlapping(str(ref), spec) and _overlapping(str(fast), spec)
        else:
            assert str(ref) == str(fast)
        return
    assert not isinstance(ref, Exception), ref
    assert isinstance(ref, torch.Tensor) and type(ref) is RefShards
    assert (ref.shape, ref.dtype, ref.device) == (fast.shape, fast.dtype, fast.device)
    assert repr(ref) == repr(fast)
    assert [(o, id(t)) for o, t in ref.chunks] == [(o, id(t)) for o, t in fast.chunks]
    assert ref.__create_write_items__("k", ref) == fast.__create_write_items__("k", fast)
    assert ref.__create_chunk_list__() == fast.__create_chunk_list__()
    for i, (off, t) in enumerate(fast.chunks):
        index = MetadataIndex("k", off, i if t.numel() else None)  # a read's hint (RESHARD-1)
        assert ref.__get_tensor_shard__(index) is fast.__get_tensor_shard__(index)
    for index in (MetadataIndex("k", (9, 9)), MetadataIndex("k", (0, 0))):
        f, r = _outcome(fast.__get_tensor_shard__, index), _outcome(ref.__get_tensor_shard__, index)
        assert type(r) is type(f)
        if isinstance(f, torch.Tensor):
            assert torch.equal(r, f) and r.shape == f.shape
        else:
            assert str(r) == str(f)
    back = pickle.loads(pickle.dumps(ref))
    assert type(back) is RefShards and repr(back) == repr(ref) and back.dtype == ref.dtype
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(back.chunks, ref.chunks, strict=True))
    empty = ref.new_empty(shape)
    assert type(empty) is RefShards and empty.chunks == [] and empty.dtype == ref.dtype
    with pytest.raises(TypeError, match="checkpointing container"):
        ref.clone()


@pytest.mark.spec("REF-16", "PLAN-4")
def test_chunks_on_two_devices_are_refused_alike() -> None:
    chunks = [((0,), torch.ones(1)), ((1,), torch.empty(1, device="meta"))]
    fast, ref = (
        _construct(FastShards, (2,), chunks, None),
        _construct(RefShards, (2,), chunks, None),
    )
    assert isinstance(fast, ValueError) and "devices" in str(fast)
    assert type(ref) is type(fast) and str(ref) == str(fast)
    on_meta = [((0,), torch.empty(1, device="meta"))]
    fast, ref = (
        _construct(FastShards, (2,), on_meta, None),
        _construct(RefShards, (2,), on_meta, None),
    )
    assert (
        (ref.device, ref.dtype)
        == (fast.device, fast.dtype)
        == (torch.device("meta"), torch.float32)
    )


def _table(cls: Any, rank: int, world: int, zeros: bool) -> Any:
    rows = -(-6 // world)
    start, stop = min(rank * rows, 6), min(rank * rows + rows, 6)
    full = torch.arange(24.0).reshape(6, 4)
    part = torch.zeros_like(full[start:stop]) if zeros else full[start:stop].clone()
    return cls((6, 4), [((start, 0), part)] if stop > start else [], dtype=torch.float32)


@pytest.mark.spec("REF-16", "PLAN-3")
@pytest.mark.parametrize("planners", ["torch", "reference", "refdcp"])
def test_reference_local_shards_save_and_load_resharded(tmp_path: Path, planners: str) -> None:
    """Saved at 2 ranks and loaded at 3 through torch's default planners, the reference's
    and refdcp's: the reference class means what refdcp's means to each."""
    api: Any = refdcp.reference if planners == "reference" else refdcp

    def save(comm: Any) -> None:
        sd = {"t": _table(RefShards, comm.rank, 2, False), "step": 4}
        kw = {"planner": tp.DefaultSavePlanner()} if planners == "torch" else {}
        api.save(sd, checkpoint_id=tmp_path, comm=comm, **kw)

    FakeWorld(2).run(save)

    def load(comm: Any) -> bool:
        dest = {"t": _table(RefShards, comm.rank, 3, True), "step": 0}
        kw = {"planner": tp.DefaultLoadPlanner()} if planners == "torch" else {}
        api.load(dest, checkpoint_id=tmp_path, comm=comm, **kw)
        want = _table(FastShards, comm.rank, 3, False)
        return dest["step"] == 4 and all(
            torch.equal(a, b) for (_, a), (_, b) in zip(dest["t"].chunks, want.chunks, strict=True)
        )

    assert FakeWorld(3).run(load) == [True] * 3


@pytest.mark.spec("REF-16", "PLAN-14")
@pytest.mark.parametrize("stager", ["refdcp", "torch"])
def test_stagers_copy_the_reference_local_shards(tmp_path: Path, stager: str) -> None:
    rows = torch.arange(12.0).reshape(3, 4)
    src = {"w": RefShards((3, 4), [((0, 0), rows)]), "step": 3}
    if stager == "torch":
        torch_stager = DefaultStager(StagingOptions(False, False, False, False))
        dcp.async_save(
            src, checkpoint_id=tmp_path, async_stager=torch_stager, no_dist=True
        ).result()
        torch_stager.close()
    else:
        refdcp.async_save(src, checkpoint_id=tmp_path, no_dist=True).result()
    rows.fill_(-1.0)  # the snapshot was a copy
    got = torch.zeros(3, 4)
    dest = {"w": RefShards((3, 4), [((0, 0), got)]), "step": 0}
    refdcp.reference.load(dest, checkpoint_id=tmp_path, comm=SingleRank())
    assert torch.equal(got, torch.arange(12.0).reshape(3, 4)) and dest["step"] == 3


# --- the learner's path (REF-14..22) ---------------------------------------------------


@pytest.mark.spec("REF-14", "REF-15", "REF-16")
def test_a_reference_save_and_load_run_none_of_the_fast_leaves() -> None:
    ran = {str(p) for p in learner_path("reference")}
    assert {"reference/flatten.py", "reference/policy.py", "reference/local_shards.py"} <= ran
    fast_leaves = {
        "planning/flatten.py",
        "planning/load_policy.py",
        "planning/local_shards.py",
        "planning/metadata/build.py",
        "storage/metadata/safe_globals.py",
    }
    assert not ran & fast_leaves
