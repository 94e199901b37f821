"""Flattening's descent and clashes (FLAT-4, FLAT-5), placing loaded values along typed
paths (FLAT-3, FLAT-4), and the structure record both save paths write (FLAT-6)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch

import refdcp
from refdcp.planning.flatten import RESERVED_KEY, flatten_state_dict, set_by_rich_path
from refdcp.reference import api as reference_api

SINGLE_PATH = "mutation-kill tests pinning one module of the default path (tests/MUTATION.md); the behaviour runs on both in the shared suites"


def _plain_id(value: object) -> str:
    """A test id of letters, digits and underscores only (the mutation runner selects by id)."""
    return re.sub(r"\W+", "_", str(value)).strip("_") or "empty"


@pytest.mark.spec("FLAT-4")
@pytest.mark.parametrize(
    ("inner", "descended"),
    [
        ({"x": "T", "y": 1}, True),  # a tensor beside a plain value, two mappings down
        ({"x": 1, "y": {"z": "T"}}, True),
        ({"x": 1}, False),
        ({}, False),  # an empty mapping holds no tensor
    ],
    ids=_plain_id,
)
def test_a_tuple_holding_a_tensor_in_nested_mappings_is_descended(
    inner: dict[str, Any], descended: bool
) -> None:
    t = torch.ones(2)

    def fill(v: Any) -> Any:
        return t if v == "T" else ({k: fill(x) for k, x in v.items()} if isinstance(v, dict) else v)

    sd = {"k": ({"a": fill(inner)}, 3)}
    flat = flatten_state_dict(sd)
    if descended:
        assert "k.1" in flat.items and "k" not in flat.items
        assert any(f.startswith("k.0.a.") for f in flat.items)
    else:
        assert list(flat.items) == ["k"] and flat.items["k"] is sd["k"]


@pytest.mark.spec("FLAT-5")
@pytest.mark.parametrize("value", [torch.ones(1), 3], ids=["tensor", "object"])
def test_a_top_level_key_spelling_an_earlier_nested_path_is_refused(value: Any) -> None:
    with pytest.raises(ValueError, match=r"\['a'\]\['b'\] and \['a.b'\]"):
        flatten_state_dict({"a": {"b": torch.zeros(1)}, "a.b": value})


@pytest.mark.spec("FLAT-3", "FLAT-4")
def test_a_value_is_placed_into_a_list_shorter_than_its_index() -> None:
    root: dict[Any, Any] = {"a": []}
    set_by_rich_path(root, (("d", "a"), ("l", 0), ("d", "x")), 5)
    assert root == {"a": [{"x": 5}]}
    set_by_rich_path(root, (("d", "a"), ("l", 2)), 7)
    assert root == {"a": [{"x": 5}, None, 7]}


@pytest.mark.spec("FLAT-3", "FLAT-4")
@pytest.mark.parametrize(
    ("start", "step", "expect"),
    [
        ((1, 2), ("l", 1), (1, 9)),  # the caller holds a tuple: it is rebuilt, not mutated
        ([1, 2], ("t", 0), (9, 2)),  # the saved path says tuple: a tuple comes back
        ((1, 2), ("t", 3), (1, 2, None, 9)),
        ([1, 2], ("l", 0), [9, 2]),
    ],
    ids=_plain_id,
)
def test_a_tuple_step_or_a_tuple_container_gives_a_tuple(
    start: Any, step: tuple[str, int], expect: Any
) -> None:
    root: dict[Any, Any] = {"a": start}
    set_by_rich_path(root, (("d", "a"), step), 9)
    assert root["a"] == expect and type(root["a"]) is type(expect)


@pytest.mark.spec("FLAT-6")
def test_both_save_paths_write_one_structure_record(tmp_path: Path) -> None:
    sd = {"m": {1: torch.ones(2), "e": {}}, "t": (torch.zeros(1), 2)}
    fast = refdcp.save(sd, checkpoint_id=tmp_path / "fast", no_dist=True)
    ref = reference_api.save(sd, checkpoint_id=tmp_path / "ref")
    assert isinstance(fast.planner_data, dict) and isinstance(ref.planner_data, dict)
    record = fast.planner_data[RESERVED_KEY]
    assert record == ref.planner_data[RESERVED_KEY]
    assert record["version"] == 1 and record["empties"] and record["rich"]
