"""The reference save planner (refdcp/reference/save_planner.py) on its own: the planner data
it stores (FLAT-6) and the bytes it hands a writer for an object (PLAN-6)."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.planner import WriteItemType

import refdcp.reference
from refdcp.comm import FakeWorld
from refdcp.reference.save_planner import ReferenceSavePlanner, _tensor_item, write_items

SINGLE_PATH = "mutation-kill tests pinning refdcp/reference itself (tests/MUTATION.md); they target the reference module, not an implementation choice"


def _sd(rank: int) -> dict[str, Any]:
    return {"w": torch.ones(2), "m": {rank: torch.ones(1)}, "e": {}, "lst": (torch.ones(1),)}


@pytest.mark.spec("FLAT-6", "REF-1")
def test_planner_data_maps_every_rank_s_fqns_and_keeps_the_structure_record(
    tmp_path: Path,
) -> None:
    mds = FakeWorld(2).run(
        lambda c: refdcp.reference.save(_sd(c.rank), checkpoint_id=tmp_path, comm=c)
    )
    assert mds[0].planner_data == {
        "w": ("w",),
        "m.0": ("m", "0"),
        "m.1": ("m", "1"),
        "lst.0": ("lst", 0),
        "__refdcp_planner__": {
            "version": 1,
            "rich": {
                "m.0": (("d", "m"), ("d", 0)),
                "m.1": (("d", "m"), ("d", 1)),
                "lst.0": (("d", "lst"), ("t", 0)),
            },
            "empties": [(("d", "e"),)],
        },
    }
    assert mds[1].planner_data == mds[0].planner_data


@pytest.mark.spec("PLAN-6", "REF-1")
def test_an_object_s_bytes_are_handed_over_from_their_start() -> None:
    planner = ReferenceSavePlanner()
    planner.set_up_planner({"o": "text"}, None, True)
    (item,) = planner.create_local_plan().items
    assert item.type == WriteItemType.BYTE_IO
    data = planner.resolve_data(item)
    assert isinstance(data, io.BytesIO) and data.tell() == 0
    assert torch.load(data, weights_only=True) == "text"


class _Shards:
    """A value that lists its own write items (PLAN-3), as LocalShards-like wrappers do."""

    def __init__(self, sizes: list[int]) -> None:
        self.sizes = sizes

    def __create_write_items__(self, fqn: str, value: Any) -> list[Any]:
        out, off = [], 0
        for n in self.sizes:
            out.append(
                _tensor_item(
                    fqn, torch.zeros(n), [off], torch.Size([sum(self.sizes)]), WriteItemType.SHARD
                )
            )
            off += n
        return out


@pytest.mark.spec("PLAN-1", "PLAN-3", "REF-1")
def test_empty_shards_a_value_lists_are_dropped() -> None:
    items = write_items("s", _Shards([2, 0, 3]))
    assert [(tuple(i.index.offset), tuple(i.tensor_data.chunk.sizes)) for i in items] == [
        ((0,), (2,)),
        ((2,), (3,)),
    ]
