"""Flattening tuples that hold tensors deep inside, and putting a value back by its path
(FLAT-1, FLAT-4).

Through the module's public functions: which FQNs ``flatten_state_dict`` produces for
tuples whose tensors sit inside a mapping or a list, and what ``set_by_rich_path``
leaves in a destination list or tuple shorter than the path's index.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from refdcp.planning.flatten import flatten_state_dict, set_by_rich_path


@pytest.mark.spec("FLAT-4", "FLAT-1")
def test_a_tuple_is_descended_when_a_tensor_sits_in_a_mapping_or_list_inside_it() -> None:
    sd = {
        "x": (1, {"t": torch.ones(2), "n": 1}),  # a mapping with one tensor among other values
        "y": ({"l": [7, torch.ones(1)]},),  # a list inside a mapping inside the tuple
        "z": (1, {"n": 2}, [3]),  # no tensor anywhere: one value
    }
    flat = flatten_state_dict(sd)
    assert list(flat.items) == ["x.0", "x.1.t", "x.1.n", "y.0.l.0", "y.0.l.1", "z"]
    assert flat.items["z"] == (1, {"n": 2}, [3])


@pytest.mark.spec("FLAT-4")
@settings(max_examples=50)  # cheap examples
@given(
    st.sampled_from(["l", "t"]),
    st.lists(st.integers(0, 9), max_size=4),
    st.integers(0, 6),
    st.booleans(),
)
def test_a_value_put_past_the_end_lands_at_its_index_and_nothing_after(
    kind: str, start: list[int], index: int, nested: bool
) -> None:
    seq: Any = list(start) if kind == "l" else tuple(start)
    root: dict[str, Any] = {"c": {"s": seq}} if nested else {"s": seq}
    prefix = (("d", "c"),) if nested else ()
    set_by_rich_path(root, (*prefix, ("d", "s"), (kind, index)), "v")
    got = root["c"]["s"] if nested else root["s"]
    want = list(start) + [None] * max(0, index + 1 - len(start))
    want[index] = "v"
    assert type(got) is (list if kind == "l" else tuple)
    assert list(got) == want
