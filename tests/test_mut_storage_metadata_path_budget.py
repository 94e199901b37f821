"""Paths built from one memoized string are charged to the unpickle's budget (FMT-11; issue 28).

A path under the string cap passes the cap; many such paths built from one
string written once in the file must still be paid for: each ``PosixPath``
built is charged its length, and the file is refused exactly when what it
builds exceeds its size plus the slack.
"""

from __future__ import annotations

import pathlib
import pickle
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from refdcp.storage.errors import UnsafeMetadataError
from refdcp.storage.metadata.limits import MetadataLimits
from refdcp.storage.metadata.safe import safe_loads


class _Path:
    """Pickles as ``PosixPath(s)``: the same ``s`` object each time, so the file holds it once."""

    def __init__(self, s: str) -> None:
        self.s = s

    def __reduce__(self) -> tuple[Any, ...]:
        return (pathlib.PosixPath, (self.s,))


@pytest.mark.spec("FMT-11")
@settings(deadline=None)
@given(n=st.integers(1, 60), chars=st.integers(1, 500), slack=st.integers(0, 4000))
@example(n=40, chars=500, slack=1000)
@example(n=1, chars=500, slack=0)
def test_paths_from_one_memoized_string_are_refused_exactly_past_the_budget(
    n: int, chars: int, slack: int
) -> None:
    s = "p" * chars
    data = pickle.dumps([_Path(s) for _ in range(n)], protocol=4)
    limits = MetadataLimits(max_string_chars=1000, slack_units=slack)
    built = n * (chars + 1)  # what the paths cost: each part's length plus its separator
    if built > len(data) + slack:
        with pytest.raises(UnsafeMetadataError, match=r"more than its size allows \(PosixPath\)"):
            safe_loads(data, limits)
    else:
        assert safe_loads(data, limits) == [pathlib.PosixPath(s)] * n
