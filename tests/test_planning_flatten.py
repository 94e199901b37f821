"""Flattening nested state dicts and restoring them (FLAT-*)."""

from __future__ import annotations

import tempfile
import warnings
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import given
from hypothesis import strategies as st
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

from refdcp.planning import DefaultLoadPlanner, DefaultSavePlanner
from refdcp.planning.flatten import (
    RESERVED_KEY,
    decode_structure,
    flatten_state_dict,
    unflatten_state_dict,
)
from refdcp.planning.simulate import simulate_load, simulate_save
from tests.strategies import tensors

warnings.filterwarnings("ignore", message="torch.distributed is disabled")

keys = st.one_of(
    st.text(alphabet="abcxyz_", min_size=1, max_size=3),
    st.integers(0, 5),
    st.booleans(),
    st.none(),
)
leaves = st.one_of(
    st.integers(-3, 3),
    st.text(max_size=3),
    st.builds(lambda n: torch.arange(n, dtype=torch.float32), st.integers(0, 4)),
    tensors(),  # views whose memory is not their values (SAVE-10)
    st.none(),
)


def _dedup_fqns(d: dict[Any, Any]) -> bool:
    try:
        flatten_state_dict(d)
    except ValueError:
        return False
    return True


nested = st.recursive(
    leaves,
    lambda children: st.one_of(
        st.dictionaries(keys, children, max_size=3),
        st.lists(children, max_size=3),
        st.lists(children, max_size=3).map(tuple),
    ),
    max_leaves=12,
)
state_dicts = st.dictionaries(keys, nested, max_size=4).filter(_dedup_fqns)


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b) and a.dtype == b.dtype
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return bool(a == b)


@pytest.mark.spec("FLAT-1", "FLAT-2", "FLAT-3", "FLAT-4")
@given(state_dicts)
def test_flatten_then_unflatten_is_identity(sd: dict[Any, Any]) -> None:
    flat = flatten_state_dict(sd)
    assert all(isinstance(k, str) for k in flat.items)
    rebuilt = unflatten_state_dict(flat.items, flat.rich, flat.empties)
    assert same(rebuilt, sd)


@pytest.mark.spec("FLAT-1", "FLAT-2", "FLAT-3", "FLAT-4", "FLAT-6")
@given(state_dicts)
def test_structure_survives_the_checkpoint_metadata(sd: dict[Any, Any]) -> None:
    """Rebuild from what planner_data holds: torch paths + refdcp's reserved entry."""
    ckpt = simulate_save([sd], DefaultSavePlanner)
    pdata = ckpt.metadata.planner_data
    assert isinstance(pdata, dict)
    paths = {k: v for k, v in pdata.items() if k != RESERVED_KEY}
    rich, empties = decode_structure(paths, pdata[RESERVED_KEY])
    flat = flatten_state_dict(sd)
    assert set(paths) == set(flat.items) == set(ckpt.metadata.state_dict_metadata)
    assert same(unflatten_state_dict(flat.items, rich, empties), sd)


@pytest.mark.spec("FLAT-1")
def test_torch_fqn_scheme() -> None:
    sd = {"a": {"b": torch.ones(1), 3: "x"}, "l": [torch.ones(1), 2], "s": [1, 2], "e": []}
    flat = flatten_state_dict(sd)
    assert flat.paths == {
        "a.b": ("a", "b"),
        "a.3": ("a", "3"),
        "l.0": ("l", 0),
        "l.1": ("l", 1),
        "s": ("s",),
        "e": ("e",),
    }


@pytest.mark.spec("FLAT-5")
def test_duplicate_fqn_names_both_paths() -> None:
    with pytest.raises(ValueError, match=r"\['a\.b'\].*\['a'\]\['b'\].*'a\.b'"):
        flatten_state_dict({"a.b": 1, "a": {"b": 2}})
    with pytest.raises(ValueError, match="both flatten"):
        flatten_state_dict({1: 1, "1": 2})


@pytest.mark.spec("FLAT-6")
def test_reserved_key_is_refused() -> None:
    with pytest.raises(ValueError, match="reserved"):
        flatten_state_dict({RESERVED_KEY: 1})


@pytest.mark.spec("FLAT-2", "FLAT-3", "FLAT-4")
def test_load_in_place_keeps_key_types_empty_dicts_and_tuples() -> None:
    t = torch.arange(3.0)
    sd = {"n": {3: "three", None: 1.5, "e": {}}, "tup": (t, "meta"), "lst": [t * 2, 7]}
    ckpt = simulate_save([sd], DefaultSavePlanner)
    dest_t = torch.zeros(3)
    dest = {
        "n": {3: None, None: None, "e": {}},
        "tup": (dest_t, None),
        "lst": [torch.zeros(3), None],
    }
    simulate_load([dest], ckpt, DefaultLoadPlanner)
    assert dest["n"] == {3: "three", None: 1.5, "e": {}}
    assert isinstance(dest["tup"], tuple) and dest["tup"][1] == "meta"
    assert dest["tup"][0] is dest_t and torch.equal(dest_t, t)  # loaded in place
    assert torch.equal(dest["lst"][0], t * 2) and dest["lst"][1] == 7


@pytest.mark.spec("FLAT-6")
def test_torch_rebuilds_refdcp_checkpoint_from_planner_data() -> None:
    sd = {"m": {"w": torch.ones(2, 2), "k": {3: torch.zeros(1)}}, "e": {}, "step": 5}
    with tempfile.TemporaryDirectory() as d:
        dcp.save(sd, checkpoint_id=d, planner=DefaultSavePlanner(), no_dist=True)
        out = _load_state_dict_from_keys(checkpoint_id=d)
    assert torch.equal(out["m"]["w"], torch.ones(2, 2))
    assert torch.equal(out["m"]["k"]["3"], torch.zeros(1))  # torch's own path scheme
    assert out["step"] == 5 and RESERVED_KEY not in out
