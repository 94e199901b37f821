"""The nesting limit of ``planner_data`` holds on its fast pass too (FMT-9; issue 28).

``check_metadata`` checks torch's common ``planner_data`` (fqn -> tuple of str/int)
in one tight pass that assumes two levels of nesting are allowed; under a smaller
``max_depth`` the same data goes through the general check, which refuses it. Model:
a value inside ``n`` nested containers needs ``max_depth >= n``.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata

from refdcp.storage.errors import MalformedMetadataError
from refdcp.storage.metadata.limits import MetadataLimits
from refdcp.storage.metadata.shape import check_metadata

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

_PART = st.text(max_size=4) | st.integers(-5, 5)
_VALUE = st.tuples() | st.lists(_PART, min_size=1, max_size=3).map(tuple) | _PART


def _levels(planner_data: dict[str, Any]) -> int:
    """Containers nested in the deepest path: the dict itself, then a tuple value."""
    return 1 + max((1 for v in planner_data.values() if isinstance(v, tuple)), default=0)


@pytest.mark.spec("FMT-9")
@settings(max_examples=60)
@given(
    planner_data=st.dictionaries(st.text(max_size=4), _VALUE, max_size=4),
    max_depth=st.integers(0, 4),
)
def test_planner_data_nested_deeper_than_the_limit_is_refused(
    planner_data: dict[str, Any], max_depth: int
) -> None:
    md = Metadata({"a": BytesStorageMetadata()}, planner_data=planner_data, storage_data={})
    limits = MetadataLimits(max_depth=max_depth)
    if max_depth >= _levels(planner_data):
        check_metadata(md, file="m", limits=limits)
    else:
        with pytest.raises(MalformedMetadataError, match=r"planner_data.*nested deeper than"):
            check_metadata(md, file="m", limits=limits)


@pytest.mark.spec("FMT-9")
@pytest.mark.parametrize("max_depth", [2, 3, 4])
def test_a_tuple_key_of_a_nested_dict_counts_one_level_deeper(max_depth: int) -> None:
    """planner_data (level 1) -> a dict (level 2) -> a tuple key (level 3)."""
    md = Metadata(
        {"a": BytesStorageMetadata()}, planner_data={"a": {("x", 1): "v"}}, storage_data={}
    )
    limits = MetadataLimits(max_depth=max_depth)
    if max_depth >= 3:
        check_metadata(md, file="m", limits=limits)
    else:
        with pytest.raises(MalformedMetadataError, match="nested deeper than 2"):
            check_metadata(md, file="m", limits=limits)


@pytest.mark.spec("FMT-9")
@pytest.mark.parametrize("max_depth", [2, 3, 64])
def test_a_planner_data_that_refers_back_to_itself_is_checked_once(max_depth: int) -> None:
    """A memoized reference back to planner_data adds no level: it was checked already."""
    planner_data: dict[str, Any] = {"b": ("x", 1)}
    planner_data["a"] = (planner_data,)
    md = Metadata({"a": BytesStorageMetadata()}, planner_data=planner_data, storage_data={})
    check_metadata(md, file="m", limits=MetadataLimits(max_depth=max_depth))
