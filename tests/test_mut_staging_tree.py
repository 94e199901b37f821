"""Staging names the key path of a value it cannot copy, wherever it sits (ASYNC-17, STAGE-9).

A random tree of dicts, lists and tuples with tensors and plain leaves gets one
value whose deep copy fails at a random place; staging (cached and uncached)
must raise ``UnloadableValueError`` naming that value's exact key path, its
type and the cause, and keep working for the next state dict.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from refdcp.planning.loadable import UnloadableValueError
from refdcp.staging.cpu_stager import CpuStager


class Uncopyable:
    """A leaf whose deep copy fails (like a lock or a generator)."""

    def __deepcopy__(self, memo: object) -> object:
        raise RuntimeError("this leaf cannot be copied")


leaves = st.one_of(
    st.integers(0, 9),
    st.text(max_size=3),
    st.none(),
    st.builds(lambda n: torch.arange(float(n)), st.integers(0, 3)),
)
trees = st.recursive(
    leaves,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.lists(inner, max_size=3).map(tuple),
        st.dictionaries(st.text("abc", min_size=1, max_size=2), inner, max_size=3),
    ),
    max_leaves=12,
)


def _with_bad(tree: Any, bad: Any, choice: int) -> tuple[Any, tuple[Any, ...]]:
    """``tree`` with ``bad`` put into one of its containers; the path it ends up at."""
    spots: list[tuple[Any, ...]] = []

    def collect(v: Any, path: tuple[Any, ...]) -> None:
        if isinstance(v, dict):
            spots.append(path)
            for k, c in v.items():
                collect(c, (*path, k))
        elif isinstance(v, (list, tuple)):
            spots.append(path)
            for i, c in enumerate(v):
                collect(c, (*path, i))

    collect(tree, ())
    where = spots[choice % len(spots)]

    def rebuild(v: Any, path: tuple[Any, ...]) -> tuple[Any, tuple[Any, ...] | None]:
        found: tuple[Any, ...] | None = None
        if isinstance(v, dict):
            out: dict[Any, Any] = {}
            for k, c in v.items():
                out[k], f = rebuild(c, (*path, k))
                found = found or f
            if path == where:
                out["zz"] = bad
                found = found or (*path, "zz")
            return out, found
        if isinstance(v, (list, tuple)):
            items = []
            for i, c in enumerate(v):
                x, f = rebuild(c, (*path, i))
                items.append(x)
                found = found or f
            if path == where:
                found = found or (*path, len(items))
                items.append(bad)
            return type(v)(items), found
        return v, None

    out, found = rebuild(tree, ())
    assert found is not None
    return out, found


@pytest.mark.spec("ASYNC-17", "STAGE-9")
@settings(max_examples=60)  # cheap examples
@given(
    st.dictionaries(st.text("xy", min_size=1, max_size=2), trees, min_size=1, max_size=3),
    st.integers(0, 100),
    st.booleans(),
)
def test_a_value_that_cannot_be_copied_is_named_by_its_key_path(
    sd: dict[str, Any], choice: int, cached: bool
) -> None:
    bad = Uncopyable()
    damaged, path = _with_bad(sd, bad, choice)
    key = ".".join(map(str, path))
    stager = CpuStager(cache_staged_state_dict=cached)
    try:
        with pytest.raises(UnloadableValueError) as info:
            stager.stage(damaged)
        msg = str(info.value)
        assert f"key {key!r}, type " in msg and "Uncopyable" in msg, (key, msg)
        assert "this leaf cannot be copied" in msg
        assert isinstance(info.value.__cause__, RuntimeError)
        snap = stager.stage(sd)  # the stager still works
        assert snap.keys() == sd.keys()
        if cached:
            stager.release(snap)
    finally:
        stager.close()


@pytest.mark.spec("ASYNC-17", "STAGE-9")
def test_the_first_of_two_uncopyable_values_is_named_and_equal_objects_are_not_confused() -> None:
    first, second = Uncopyable(), Uncopyable()
    sd = {"a": [1, {"b": (2, first)}], "c": second}
    with pytest.raises(UnloadableValueError, match=r"key 'a\.1\.b\.1', type "):
        CpuStager().stage(sd)
    # the value sits at the root of a list: its index is its path under the key
    with pytest.raises(UnloadableValueError, match=r"key 'l\.0', type "):
        CpuStager().stage({"l": [second]})


@pytest.mark.spec("ASYNC-17", "STAGE-7")
@pytest.mark.parametrize("cached", [False, True])
def test_a_tensor_that_cannot_be_copied_is_named_by_its_key_path(cached: bool) -> None:
    sd = {"ok": torch.ones(2), "m": {"x": [torch.empty(2, device="meta")]}}
    stager = CpuStager(cache_staged_state_dict=cached, pin_memory=False)
    with pytest.raises(UnloadableValueError, match=r"key 'm\.x\.0', type torch\.Tensor: ") as info:
        stager.stage(sd)
    assert "meta tensor" in str(info.value) and info.value.__cause__ is not None
    stager.close()  # the failed copy returned its buffers
