"""The global-metadata screen clears common layouts without the exact per-tensor check (META-9)."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from refdcp.planning.metadata import build as global_metadata
from refdcp.planning.metadata.build import build_state_dict_metadata


def _item(fqn: str, off: tuple[int, ...], sz: tuple[int, ...], glob: tuple[int, ...]) -> WriteItem:
    return WriteItem(
        index=MetadataIndex(fqn, torch.Size(off)),
        type=WriteItemType.SHARD,
        tensor_data=TensorWriteData(
            chunk=ChunkStorageMetadata(torch.Size(off), torch.Size(sz)),
            properties=TensorProperties(dtype=torch.float32),
            size=torch.Size(glob),
        ),
    )


def _grid(fqn: str, tiles: tuple[int, ...], tile: tuple[int, ...]) -> list[WriteItem]:
    glob = tuple(t * s for t, s in zip(tiles, tile))
    return [
        _item(fqn, tuple(i * s for i, s in zip(idx, tile)), tile, glob)
        for idx in itertools.product(*(range(t) for t in tiles))
    ]


def _exact_checks(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Record the FQNs the exact (slow, worded) check runs for."""
    seen: list[str] = []
    exact = global_metadata._check_chunks

    def spy(fqn: str, md: object, ranks: list[int]) -> list[str]:
        seen.append(fqn)
        return exact(fqn, md, ranks)  # type: ignore[arg-type]

    monkeypatch.setattr(global_metadata, "_check_chunks", spy)
    return seen


LAYOUTS = {
    "row slabs": ((8, 1), (2, 6)),
    "column slabs": ((1, 8), (6, 2)),
    "2-d tile grid": ((4, 4), (3, 2)),
    "3-d tile grid": ((2, 3, 2), (2, 1, 3)),
}


@pytest.mark.spec("META-9")
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("shuffled", [False, True])
def test_valid_slabs_and_grids_skip_the_exact_check(
    layout: str, shuffled: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    tiles, tile = LAYOUTS[layout]
    items = _grid("w", tiles, tile) + _grid("v", tiles, tile)
    if shuffled:  # any plan order: the screen sorts what is not already in order
        random.Random(7).shuffle(items)
    plans = [items[r::5] for r in range(5)]
    seen = _exact_checks(monkeypatch)
    md, problems = build_state_dict_metadata(plans)
    assert problems == []
    assert seen == []
    assert len(md["w"].chunks) == len(items) // 2  # type: ignore[union-attr]


@pytest.mark.spec("META-9", "META-3")
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_a_damaged_grid_still_gets_the_exact_check(
    layout: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    tiles, tile = LAYOUTS[layout]
    items = _grid("w", tiles, tile) + _grid("v", tiles, tile)
    last = items[len(items) // 2 - 1]  # the last tile of "w", one step back along a split dim
    d = next(i for i, t in enumerate(tiles) if t > 1)
    off = tuple(o - (i == d) for i, o in enumerate(last.index.offset))  # type: ignore[arg-type]
    items[len(items) // 2 - 1] = _item("w", off, tile, tuple(last.tensor_data.size))  # type: ignore[union-attr]
    seen = _exact_checks(monkeypatch)
    _, problems = build_state_dict_metadata([items[0::2], items[1::2]])
    assert seen == ["w"]
    assert any(p.startswith("'w'") and "overlaps" in p for p in problems), problems
