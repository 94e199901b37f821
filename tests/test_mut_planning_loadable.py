"""Save-time loadability check: what it accepts, what it refuses and how it names it (SAVE-12, SAVE-13).

Properties through the module's public functions (``loadability_problem``,
``check_loadable``, ``refuse_unloadable``): plain data passes without a pickle
round trip, one unloadable leaf anywhere in a container is found, and the
error names the key, its path when the key does not spell it, the value's
type and torch's reason.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from refdcp.planning.loadable import (
    UnloadableValueError,
    check_loadable,
    loadability_problem,
    refuse_unloadable,
)


class Opaque:
    """Picklable, but not on the weights_only allow-list: saves, never loads by default."""


_OPAQUE = f"{Opaque.__module__}.{Opaque.__qualname__}"

primitives = st.one_of(
    st.integers(-(2**40), 2**40),
    st.floats(allow_nan=False),
    st.booleans(),
    st.text(max_size=4),
    st.binary(max_size=4),
    st.complex_numbers(allow_nan=False, allow_infinity=False, max_magnitude=1e6),
    st.none(),
)
plain = st.recursive(
    primitives | st.builds(lambda n: torch.arange(n, dtype=torch.float32), st.integers(0, 4)),
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.lists(inner, max_size=4).map(tuple),
        st.dictionaries(st.one_of(st.text(max_size=3), st.integers(0, 9)), inner, max_size=4),
    ),
    max_leaves=30,
)


def _insert(value: Any, bad: Any, where: int) -> tuple[Any, bool]:
    """``value`` with ``bad`` put into its ``where``-th container (as a value, or as a dict
    key's value); returns whether it was put in."""
    containers: list[Any] = []

    def walk(v: Any) -> None:
        if isinstance(v, (list, tuple, dict)):
            containers.append(v)
            for c in v.values() if isinstance(v, dict) else v:
                walk(c)

    walk(value)
    if not containers:
        return value, False
    target = containers[where % len(containers)]

    def rebuild(v: Any) -> Any:
        if isinstance(v, dict):
            out = {k: rebuild(c) for k, c in v.items()}
            if v is target:
                out["__bad__"] = bad
            return out
        if isinstance(v, (list, tuple)):
            items = [rebuild(c) for c in v]
            if v is target:
                items.insert(where % (len(items) + 1), bad)
            return type(v)(items)
        return v

    return rebuild(value), True


@pytest.mark.spec("SAVE-13")
@given(plain)
@example([torch.arange(3.0)])
@example({"a": (torch.ones(2), [1, "x", None]), 2: {b"k": 1j}})
@example((True, 1.5, torch.zeros(0, 2, dtype=torch.int8)))
def test_plain_data_passes_without_a_pickle_round_trip(value: Any) -> None:
    calls = []
    real = torch.save

    def spy(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return real(*args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch, "save", spy)
        assert loadability_problem(value) is None
        check_loadable("k", value)
    assert calls == []


@pytest.mark.spec("SAVE-13")
def test_values_that_are_not_plain_data_take_the_round_trip() -> None:
    calls = []
    real = torch.save

    def spy(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return real(*args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch, "save", spy)
        assert loadability_problem({1, 2}) is None  # a set: not plain data, but loadable
        assert loadability_problem(Opaque(), [Opaque]) is None  # allowed by the planner
    assert len(calls) == 2  # the spy sees the round trips: the property above means something


@pytest.mark.spec("SAVE-12", "SAVE-13")
@given(plain, st.integers(0, 50), st.sampled_from(["opaque", "lambda"]))
def test_one_unloadable_leaf_anywhere_in_plain_containers_is_found(
    value: Any, where: int, kind: str
) -> None:
    bad = Opaque() if kind == "opaque" else (lambda: 0)
    damaged, inserted = _insert(value, bad, where)
    if not inserted:
        damaged = [value, bad]
    problem = loadability_problem(damaged)
    assert problem is not None
    with pytest.raises(UnloadableValueError, match="key 'k'"):
        check_loadable("k", damaged)


@pytest.mark.spec("SAVE-12", "SAVE-13")
def test_an_unloadable_dict_value_under_a_plain_key_is_found() -> None:
    assert loadability_problem({"a": Opaque()}) is not None
    assert loadability_problem({"a": 1, "b": Opaque()}) is not None
    assert loadability_problem({"a": 1, "b": 2}) is None


@pytest.mark.spec("SAVE-12")
def test_the_refusal_names_the_type_qualified_unless_builtin() -> None:
    with pytest.raises(UnloadableValueError) as info:
        refuse_unloadable({"f": lambda: 0, "o": Opaque(), "g": (i for i in range(2))})
    msg = str(info.value)
    assert "key 'f', type function: cannot be pickled" in msg
    assert "key 'g', type generator: cannot be pickled" in msg
    assert f"key 'o', type {_OPAQUE}: saves, but a default load" in msg
    assert f"allow {_OPAQUE} at save with DefaultSavePlanner(safe_globals=[...])" in msg


@pytest.mark.spec("SAVE-12")
def test_the_refusal_gives_torchs_reason_in_one_sentence() -> None:
    problem = loadability_problem(Opaque())
    assert problem is not None
    m = re.search(r"cannot unpickle it \((.*?)\); to keep it", problem)
    assert m is not None, problem
    reason = m.group(1)
    assert reason.startswith("Unsupported global") and _OPAQUE in reason
    assert ". " not in reason and "Please" not in reason
    # the allow-list of the save planner lets it through
    assert loadability_problem(Opaque(), [Opaque]) is None


@pytest.mark.spec("SAVE-13")
def test_check_loadable_raises_naming_the_key() -> None:
    with pytest.raises(UnloadableValueError, match=r"key 'opt\.state', type function"):
        check_loadable("opt.state", lambda: 0)
    check_loadable("ok", Opaque(), [Opaque])  # allowed: no error


path_parts = st.lists(
    st.one_of(st.text("ab.", min_size=1, max_size=3), st.integers(0, 3)), min_size=1, max_size=4
)


@pytest.mark.spec("SAVE-12")
@settings(max_examples=60)  # cheap examples
@given(path_parts, st.booleans())
def test_the_key_path_is_shown_exactly_when_the_key_does_not_spell_it(
    path: list[Any], given_path: bool
) -> None:
    key = ".".join(map(str, path))
    paths = {key: path} if given_path else {"other": ["x"]}
    with pytest.raises(UnloadableValueError) as info:
        refuse_unloadable({key: Opaque(), "fine": 1}, paths=paths)
    msg = str(info.value)
    spelled = [str(p) for p in path] == key.split(".")
    shown = f"key {key!r} (path {path})" in msg
    assert shown == (given_path and not spelled)
    if not shown:
        assert f"key {key!r}, type {_OPAQUE}" in msg
    assert "'fine'" not in msg
    # no paths at all: the key alone
    with pytest.raises(UnloadableValueError) as info2:
        refuse_unloadable({key: Opaque()})
    assert f"key {key!r}, type {_OPAQUE}" in str(info2.value)


@pytest.mark.spec("SAVE-12", "SAVE-13")
@pytest.mark.parametrize("n", [10_001, 30_000])
def test_an_unloadable_value_after_many_plain_ones_is_still_found(n: int) -> None:
    # past the plain-data walk's budget the check falls back to the round trip: never "plain"
    assert loadability_problem([*range(n), Opaque()]) is not None
    assert loadability_problem({"xs": list(range(n)), "o": Opaque()}) is not None
    assert loadability_problem([*range(n), "fine"]) is None


class Fussy:
    """Allowed by the caller, but its ``__setstate__`` refuses at load."""

    def __getstate__(self) -> dict[str, int]:
        return {"x": 1}

    def __setstate__(self, state: dict[str, int]) -> None:
        raise ValueError("this value refuses to load")


@pytest.mark.spec("SAVE-12")
def test_a_load_failure_that_is_not_a_refused_global_is_quoted_as_is() -> None:
    problem = loadability_problem(Fussy(), [Fussy])
    assert problem is not None
    assert "cannot unpickle it (this value refuses to load); to keep it" in problem


@pytest.mark.spec("SAVE-12", "ASYNC-17")
def test_a_staging_failure_also_says_why_the_value_could_not_be_saved() -> None:
    from refdcp.staging.cpu_stager import CpuStager

    gen = (i for i in range(3))  # cannot be deep-copied, nor pickled
    with pytest.raises(UnloadableValueError) as info:
        CpuStager().stage({"opt": {"it": gen}})
    msg = str(info.value)
    assert "key 'opt.it', type generator: cannot be staged (TypeError: " in msg
    assert "; cannot be pickled (TypeError: " in msg  # the save-time reason, appended

    class Bare(torch.Tensor):  # a tensor subclass without new_empty: no deep copy
        pass

    with pytest.raises(UnloadableValueError) as info2:
        CpuStager().stage({"u": torch.ones(2).as_subclass(Bare)})
    msg2 = str(info2.value).rstrip()
    assert "key 'u', type " in msg2 and "cannot be staged (RuntimeError: " in msg2
    assert "; None" not in msg2  # a dense tensor saves fine: no save-time reason appended
    assert "cannot be pickled" not in msg2 and "cannot unpickle" not in msg2
