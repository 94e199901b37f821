"""The save-time loadability check's bounds: the plain-data walk's size (SAVE-13), the key
length cap (SAVE-17), and one error listing every problem (SAVE-12)."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch

from refdcp.planning.errors import UnloadableValueError
from refdcp.planning.loadable import loadability_problem, refuse_unloadable
from refdcp.storage.metadata.limits import get_metadata_limits


def _round_trips(value: Any) -> tuple[str | None, int]:
    calls = []
    real = torch.save

    def spy(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return real(*args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch, "save", spy)
        why = loadability_problem(value)
    return why, len(calls)


@pytest.mark.spec("SAVE-13")
@pytest.mark.parametrize(
    ("values", "trips"),
    [(9_999, 0), (10_000, 1)],  # a list of n ints is n + 1 values
)
def test_plain_data_of_at_most_10000_values_skips_the_round_trip(values: int, trips: int) -> None:
    assert _round_trips(list(range(values))) == (None, trips)


@pytest.mark.spec("SAVE-13")
def test_the_budget_counts_keys_and_nested_containers() -> None:
    # 1 dict + 2,000 x (key + tuple + 3 ints) = 10,001 values: over the budget
    over = {i: (i, i, i) for i in range(2_000)}
    assert _round_trips(over) == (None, 1)
    under = {i: (i, i, i) for i in range(1_999)}  # 9,996 values
    assert _round_trips(under) == (None, 0)


def _quantized() -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.qint8)


@pytest.mark.spec("SAVE-13")
@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.ones(3).to_sparse(),
        lambda: torch.ones(3, device="meta"),
        _quantized,
    ],
    ids=["sparse", "meta", "quantized"],
)
def test_a_tensor_that_is_not_dense_in_a_container_is_not_plain_data(
    make: Callable[[], torch.Tensor],
) -> None:
    """Only dense tensors are plain data: inside a list, any other tensor takes the round trip
    (which decides; a pickled container of them loads back)."""
    _, trips = _round_trips([1, make()])
    assert trips == 1


@pytest.mark.spec("SAVE-17")
def test_a_key_of_exactly_the_cap_is_accepted_one_more_is_refused() -> None:
    cap = get_metadata_limits().max_string_chars
    refuse_unloadable({"k" * cap: 1})
    with pytest.raises(UnloadableValueError, match=f"{cap + 1} characters"):
        refuse_unloadable({"k" * (cap + 1): 1})


@pytest.mark.spec("SAVE-12", "SAVE-17")
def test_a_long_key_does_not_hide_the_problems_after_it() -> None:
    cap = get_metadata_limits().max_string_chars
    with pytest.raises(UnloadableValueError) as err:
        refuse_unloadable({"k" * (cap + 1): 1, "long2" * cap: 2, "lam": lambda: 0})
    text = str(err.value)
    assert text.count("characters):") == 2 and "'lam'" in text
