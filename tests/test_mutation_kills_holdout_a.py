"""Tests for survivors of the hold-out mutation sample (seed 3; issue 13).

- ``metadata_shape.py:192``: the quick pass over ``planner_data`` must hand a tuple whose
  every part is bad (here one over-long string) to the detailed check (FMT-9, FMT-10).
- ``safe_metadata.py:355``: ``load_metadata`` pauses the cyclic garbage collector while it
  parses and must give the caller's setting back, on success and on failure (FMT-9, FMT-7,
  as API-20 does for ``save``/``load``).
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)

from refdcp.storage.errors import FormatVersionError, MalformedMetadataError
from refdcp.storage.metadata.limits import MetadataLimits
from refdcp.storage.metadata.safe import dump_metadata, load_metadata
from refdcp.storage.metadata.shape import check_metadata

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

LIMITS = MetadataLimits()
CAP = LIMITS.max_string_chars


def _md() -> Metadata:
    sdm: dict[str, Any] = {
        "w": TensorStorageMetadata(
            TensorProperties(dtype=torch.float32),
            torch.Size([4]),
            [ChunkStorageMetadata(torch.Size([0]), torch.Size([4]))],
        ),
        "step": BytesStorageMetadata(),
    }
    return Metadata(state_dict_metadata=sdm, planner_data={}, storage_data={})


@pytest.mark.spec("FMT-9", "FMT-10")
@pytest.mark.parametrize(
    "value",
    [("x" * (CAP + 1),), ("y" * (CAP + 1), "z" * (CAP + 2))],
    ids=["one-long-part", "only-long-parts"],
)
def test_a_planner_data_tuple_of_only_bad_parts_is_refused(value: tuple[str, ...]) -> None:
    """A tuple whose first part is already bad is not skipped by the quick pass."""
    md = _md()
    md.planner_data = {"a": ("fine", 1), "b": value, "c": ("fine", 2)}
    with pytest.raises(MalformedMetadataError) as err:
        check_metadata(md, file="ckpt/.metadata", limits=LIMITS)
    assert "planner_data" in err.value.field
    with pytest.raises(MalformedMetadataError):
        load_metadata(dump_metadata(md))
    md.planner_data = {"a": ("fine", 1), "c": ("x" * CAP, 2)}  # at the cap: accepted
    check_metadata(md, file="ckpt/.metadata", limits=LIMITS)


@pytest.fixture
def gc_state() -> Iterator[None]:
    was = gc.isenabled()
    try:
        yield
    finally:
        (gc.enable if was else gc.disable)()


@pytest.mark.spec("FMT-9", "FMT-7")
@pytest.mark.usefixtures("gc_state")
@pytest.mark.parametrize("enabled", [True, False])
def test_load_metadata_gives_the_callers_gc_setting_back(enabled: bool) -> None:
    """The collector is as the caller left it after a parse that succeeds and one that raises."""
    (gc.enable if enabled else gc.disable)()
    good = dump_metadata(_md())
    back = load_metadata(good)
    assert set(back.state_dict_metadata) == {"w", "step"}
    assert gc.isenabled() is enabled
    bad_md = _md()
    bad_md.version = "9.9.9"
    with pytest.raises(FormatVersionError):
        load_metadata(dump_metadata(bad_md))
    assert gc.isenabled() is enabled
    with pytest.raises(MalformedMetadataError):
        bad_md = _md()
        bad_md.planner_data = {"b": ("x" * (CAP + 1),)}
        load_metadata(dump_metadata(bad_md))
    assert gc.isenabled() is enabled
