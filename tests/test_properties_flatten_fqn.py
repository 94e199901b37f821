"""Flattening, differentially against torch's own flattener, and the tuple/structure rules
refdcp adds (FLAT-1, FLAT-4, FLAT-6)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.distributed.checkpoint._nested_dict import flatten_state_dict as torch_flatten

from refdcp.planning.flatten import (
    decode_structure,
    encode_structure,
    flatten_state_dict,
    set_by_rich_path,
    unflatten_state_dict,
)

T = torch.ones(2)
leaves = st.one_of(st.integers(0, 9), st.just(T), st.text("ab", max_size=2))
keys = st.text("xyz", min_size=1, max_size=2)
nested = st.recursive(
    leaves,
    lambda kids: st.one_of(st.lists(kids, max_size=3), st.dictionaries(keys, kids, max_size=3)),
    max_leaves=12,
)


@pytest.mark.spec("FLAT-1")
@given(st.dictionaries(keys, nested, max_size=4))
def test_fqns_and_paths_match_torchs_flattener(sd: dict[str, Any]) -> None:
    theirs, mapping = torch_flatten(sd)
    ours = flatten_state_dict(sd)
    assert sorted(ours.items) == sorted(theirs)
    assert ours.paths == {k: tuple(v) for k, v in mapping.items()}
    for k, v in ours.items.items():
        assert v is theirs[k] or v == theirs[k]


@pytest.mark.spec("FLAT-1")
def test_a_list_is_descended_when_a_nested_list_holds_a_tensor() -> None:
    sd = {"l": [[T], 1], "m": [[1], [2]], "n": [[[T]]]}
    for ours, theirs in [(flatten_state_dict(sd).paths, torch_flatten(sd)[1])]:
        assert ours == {k: tuple(v) for k, v in theirs.items()}
    assert sorted(flatten_state_dict(sd).items) == ["l.0.0", "l.1", "m", "n.0.0.0"]


@pytest.mark.spec("FLAT-4")
def test_a_list_holding_a_tuple_with_a_tensor_is_descended() -> None:
    flat = flatten_state_dict({"l": [(T, 1)], "k": [(1, 2)]})
    assert sorted(flat.items) == ["k", "l.0.0", "l.0.1"]
    rebuilt = unflatten_state_dict(flat.items, flat.rich, flat.empties)
    assert isinstance(rebuilt["l"], list) and isinstance(rebuilt["l"][0], tuple)
    assert rebuilt["l"][0][1] == 1 and rebuilt["k"] == [(1, 2)]


@pytest.mark.spec("FLAT-4", "FLAT-1")
def test_tuples_holding_tensors_at_any_depth_are_descended() -> None:
    sd = {"t": ({"w": T}, 1), "u": ([T], "x"), "v": (1, "a"), "w": ((T,),), "x": ({"a": {"b": T}},)}
    flat = flatten_state_dict(sd)
    assert sorted(flat.items) == ["t.0.w", "t.1", "u.0.0", "u.1", "v", "w.0.0", "x.0.a.b"]
    rebuilt = unflatten_state_dict(flat.items, flat.rich, flat.empties)
    assert isinstance(rebuilt["t"], tuple) and isinstance(rebuilt["w"][0], tuple)
    assert rebuilt["v"] == (1, "a") and rebuilt["u"][1] == "x"


@pytest.mark.spec("FLAT-6")
def test_plain_state_dicts_need_no_structure_record_and_torch_paths_decode() -> None:
    flat = flatten_state_dict({"a": {"b": T}, "l": [T, 3]})
    assert encode_structure(flat)["rich"] == {}
    rich, empties = decode_structure(flat.paths, None)  # a checkpoint without refdcp's record
    assert rich == {
        "a.b": (("d", "a"), ("d", "b")),
        "l.0": (("d", "l"), ("l", 0)),
        "l.1": (("d", "l"), ("l", 1)),
    }
    assert empties == []
    assert unflatten_state_dict(flat.items, rich)["l"][1] == 3


@pytest.mark.spec("FLAT-4", "FLAT-3")
def test_loading_an_object_into_a_missing_place_builds_the_containers() -> None:
    root: dict[Any, Any] = {}
    set_by_rich_path(root, (("d", "t"), ("t", 2)), 5)
    assert root == {"t": (None, None, 5)}
    set_by_rich_path(root, (("d", "l"), ("l", 1), ("d", 3)), "x")
    assert root["l"] == [None, {3: "x"}]
    old = root["t"]
    set_by_rich_path(root, (("d", "t"), ("t", 0)), 1)
    assert root["t"] == (1, None, 5) and old == (None, None, 5)  # tuples are rebuilt, not mutated
