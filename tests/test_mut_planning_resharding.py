"""The resharding sweep's max-end index: exact at the boundaries, and its cost counter counts
(RESHARD-6).

``test_planning_reshard.py`` bounds the nodes the index visits; these checks make
that bound mean something: a fresh index has visited nothing, every lookup visits
at least the root and each chunk it returns, and a chunk that ends exactly where
the target starts is not returned (it shares no element with the target).
"""

from __future__ import annotations

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from refdcp.planning.resharding import _EndIndex


@pytest.mark.spec("RESHARD-6")
@settings(max_examples=100)  # cheap examples
@given(
    st.lists(st.tuples(st.integers(0, 20), st.integers(1, 8)), min_size=1, max_size=20),
    st.data(),
)
@example([(0, 2), (2, 2)], None)  # x = 2: the first chunk ends exactly there
def test_chunks_ending_exactly_at_x_are_not_returned(
    chunks: list[tuple[int, int]], data: st.DataObject | None
) -> None:
    chunks = sorted(chunks)
    ends = [a + n for a, n in chunks]
    if data is None:
        x, last = 2, len(ends)
    else:  # x is often some chunk's end: the boundary
        x = data.draw(st.one_of(st.sampled_from(ends), st.integers(-1, 30)))
        last = data.draw(st.integers(0, len(ends)))
    index = _EndIndex(ends)
    assert index.visited == 0
    got = index.indices_ending_after(x, last)
    assert got == [i for i in range(last) if ends[i] > x]
    # the root (itself a leaf for one chunk) and each returned leaf
    assert index.visited >= max(1, len(got))
    before = index.visited
    again = index.indices_ending_after(x, last)
    assert again == got and index.visited >= before + max(1, len(got))


@pytest.mark.spec("RESHARD-6")
def test_every_small_index_is_exact_for_every_x_and_prefix() -> None:
    """Deterministic and exhaustive over small sizes (1-12 chunks, sizes that are not
    powers of two included): the tree's shape never drops or misplaces a chunk."""
    for n in range(1, 13):
        for pattern in (range(n), range(n, 0, -1), [(7 * i) % 5 for i in range(n)]):
            ends = [1 + v for v in pattern]
            index = _EndIndex(ends)
            for x in range(-1, max(ends) + 1):
                for last in range(n + 1):
                    expect = [i for i in range(last) if ends[i] > x]
                    assert index.indices_ending_after(x, last) == expect, (ends, x, last)
