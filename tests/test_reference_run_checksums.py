"""The reference's replica checksum of a non-tensor value, checked against DEDUP-6's definition
(the CRC-32C of the protocol-4 pickle of the value's canonical form), and through a reference
save whose ranks hold replicas that differ only in such a value.

This runs the reference alone (the reference-run suite of HARN-26); the comparison with the
fast path's checksums is in test_reference_differential.py.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import crc32c
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import refdcp
import refdcp.reference
from refdcp.comm import FakeWorld
from refdcp.reference.save_planner import value_checksum

SINGLE_PATH = "runs the reference alone against DEDUP-6's definition (HARN-26); the comparison with the fast path is in test_reference_differential"


def canonical(value: Any) -> Any:
    """DEDUP-6's canonical form, written from the spec's words."""
    if isinstance(value, (set, frozenset, dict)):
        pairs = value.items() if isinstance(value, dict) else value
        elements = [
            (canonical(p[0]), canonical(p[1])) if isinstance(value, dict) else canonical(p)
            for p in pairs
        ]
        return (type(value).__name__, sorted(elements, key=repr))
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, [canonical(x) for x in value])
    return value


def spec_checksum(value: Any) -> int:
    return int(crc32c.crc32c(pickle.dumps(canonical(value), protocol=4)))


_leaves = st.one_of(st.integers(-5, 300), st.text(max_size=3), st.none(), st.booleans())
_values = st.recursive(
    _leaves,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.tuples(inner, inner),
        st.frozensets(_leaves, max_size=4),
        st.sets(_leaves, max_size=4),
        st.dictionaries(st.one_of(st.text(max_size=2), st.integers(0, 9)), inner, max_size=3),
    ),
    max_leaves=8,
)


@pytest.mark.spec("DEDUP-6", "REF-1")
@settings(max_examples=150)
@given(_values)
def test_an_object_s_checksum_is_the_crc_of_its_canonical_protocol_4_pickle(value: Any) -> None:
    assert value_checksum(value) == spec_checksum(value)


@pytest.mark.spec("DEDUP-6", "REF-1")
@pytest.mark.parametrize(
    "value", [None, 7, "s", [1, "a"], (2, {3}), {"k": frozenset({1, 2})}, {4, 5}], ids=repr
)
def test_worked_examples_of_the_checksum_definition(value: Any) -> None:
    """Worked examples of every kind of value the definition names, each against it."""
    assert value_checksum(value) == spec_checksum(value)


@pytest.mark.spec("DEDUP-6", "REF-1")
def test_checksums_ignore_insertion_order_but_not_content() -> None:
    """Equal sets and dicts built in other orders agree; any element of another value parts
    them, at any depth."""
    assert value_checksum({"a": 1, "b": {3, 1, 2}}) == value_checksum({"b": {2, 3, 1}, "a": 1})
    assert value_checksum(frozenset(range(40))) == value_checksum(frozenset(range(39, -1, -1)))
    different = [
        ({1, 2}, {1, 3}),
        (frozenset({1}), frozenset({2})),
        ({"a": 1}, {"a": 2}),
        ({"a": 1}, {"b": 1}),
        (({"a": 1},), ({"a": 2},)),
        ([{1}], [{2}]),
        ({1, 2}, frozenset({1, 2})),
        ({"a": 1}, [("a", 1)]),
    ]
    for a, b in different:
        assert value_checksum(a) != value_checksum(b), (a, b)


@pytest.mark.spec("DEDUP-6", "DEDUP-13", "REF-1")
@pytest.mark.parametrize(
    "value", [{1, 2}, frozenset({"x"}), ({"lr": 0.1},), ({"a": {1, 2}}, [3])], ids=repr
)
def test_a_reference_save_names_each_side_s_canonical_checksum(value: Any, tmp_path: Path) -> None:
    """Rank 1 holds the value, ranks 0 and 2 a value of the same kind with other content: the
    save fails naming the key and the checksum each side holds, as DEDUP-6 defines it."""
    other = {"set": {7}, "frozenset": frozenset({"y"}), "tuple": ({"lr": 0.2},)}
    changed = other[type(value).__name__]
    sds = [{"k": changed}, {"k": value}, {"k": changed}]
    with pytest.raises(refdcp.CheckpointError) as info:
        FakeWorld(3).run(
            lambda c: refdcp.reference.save(sds[c.rank], checkpoint_id=tmp_path, comm=c)
        )
    failures = info.value.rank_failures.values()
    (problem,) = {p for f in failures for p in getattr(f.exception, "problems", ())}
    assert problem == (
        f"replicas of 'k' differ in value between ranks: ranks [0, 2] hold checksum "
        f"{spec_checksum(changed):#010x}; ranks [1] hold checksum {spec_checksum(value):#010x}"
    )
