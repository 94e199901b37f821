"""Stored layouts are checked before a byte is read (FMT-28, FMT-29).

A ``.metadata`` can pass every type check and still describe a layout that
would load silently wrong: chunks that duplicate one another and leave a hole,
a chunk listed twice with the last one dropped, a storage record pointing at
another item's bytes (whose checksum then matches). Each is refused by a load
(with every verify mode) before any destination changes, and reported by
``refdcp verify``; torch-written checkpoints pass.
"""

from __future__ import annotations

import copy
import fcntl
import json
import os
import re
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)

import refdcp
import refdcp.reference
from refdcp.errors import CheckpointError
from refdcp.storage import MalformedMetadataError
from refdcp.storage.metadata import stored_layout
from refdcp.storage.metadata.safe import dump_metadata, load_metadata
from refdcp.storage.metadata.stored_layout import (
    check_stored_layout,
    readable_record_problem,
    readable_tiling_problem,
    record_problem,
    tiling_problem,
)
from refdcp.storage.verify import verify_checkpoint
from refdcp.testing.spawn import run_gloo
from tests import _layout_fns

C = ChunkStorageMetadata


def _chunk(off: tuple[int, ...], size: tuple[int, ...]) -> C:
    return C(offsets=torch.Size(off), sizes=torch.Size(size))


# -- the fast rule agrees with the readable one ------------------------------------------


@st.composite
def layouts(draw: st.DrawFn) -> tuple[tuple[int, ...], list[C]]:
    """A tensor shape and chunks: a true tiling (a grid) damaged in one of many ways, or
    random boxes (mostly wrong)."""
    ndim = draw(st.integers(0, 3))
    shape = tuple(draw(st.lists(st.integers(0, 5), min_size=ndim, max_size=ndim)))
    cuts = [sorted(set(draw(st.lists(st.integers(0, n), max_size=3))) | {0, n}) for n in shape]
    grid: list[C] = [_chunk((), ())]
    for d in range(ndim):
        grid = [
            _chunk((*g.offsets, a), (*g.sizes, b - a))
            for g in grid
            for a, b in zip(cuts[d], cuts[d][1:])
        ]
    if ndim and 0 in shape:
        grid = [_chunk((0,) * ndim, shape)] * draw(st.integers(0, 2))
    how = draw(
        st.sampled_from(["exact", "duplicate", "drop", "dup_last", "shift", "grow", "random"])
    )
    chunks = list(grid)
    if how == "duplicate" and chunks:
        chunks.append(chunks[draw(st.integers(0, len(chunks) - 1))])
    elif how == "drop" and chunks:
        chunks.pop(draw(st.integers(0, len(chunks) - 1)))
    elif how == "dup_last" and len(chunks) > 1:
        chunks[-1] = chunks[-2]
    elif how in ("shift", "grow") and chunks and ndim:
        i = draw(st.integers(0, len(chunks) - 1))
        d = draw(st.integers(0, ndim - 1))
        step = draw(st.sampled_from([-1, 1]))
        off, size = list(chunks[i].offsets), list(chunks[i].sizes)
        if how == "shift":
            off[d] += step
        else:
            size[d] = max(0, size[d] + step)
        chunks[i] = _chunk(tuple(off), tuple(size))
    elif how == "random":
        boxes = st.tuples(
            st.tuples(*[st.integers(-1, n) for n in shape]),
            st.tuples(*[st.integers(0, n + 1) for n in shape]),
        )
        chunks = [_chunk(o, s) for o, s in draw(st.lists(boxes, max_size=5))]
    return shape, chunks


@pytest.mark.spec("FMT-28")
@settings(max_examples=400, deadline=None)
@given(layouts())
def test_fast_tiling_check_agrees_with_the_readable_one(
    layout: tuple[tuple[int, ...], list[C]],
) -> None:
    shape, chunks = layout
    fast, plain = tiling_problem(torch.Size(shape), chunks), readable_tiling_problem(shape, chunks)
    assert (fast is None) == (plain is None), (fast, plain)


@pytest.mark.spec("FMT-28", "FMT-30")
@settings(max_examples=200, deadline=None)
@given(layouts())
def test_the_sweep_for_many_split_dimensions_agrees_with_the_readable_one(
    layout: tuple[tuple[int, ...], list[C]],
) -> None:
    shape, chunks = layout
    saved = stored_layout.CORNER_BUDGET
    stored_layout.CORNER_BUDGET = 0  # force the sweep
    try:
        fast = tiling_problem(torch.Size(shape), chunks)
    finally:
        stored_layout.CORNER_BUDGET = saved
    assert (fast is None) == (readable_tiling_problem(shape, chunks) is None), fast


@pytest.mark.spec("FMT-29")
@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["a", "b"]), st.integers(0, 30), st.integers(0, 8)), max_size=8
    )
)
def test_fast_byte_range_check_agrees_with_the_readable_one(
    raw: list[tuple[str, int, int]],
) -> None:
    records = [(f"item{i}", f, o, n) for i, (f, o, n) in enumerate(raw)]
    fast, plain = record_problem(records), readable_record_problem(records)
    assert (fast is None) == (plain is None), (fast, plain)


@pytest.mark.spec("FMT-28")
def test_a_wrong_tiling_names_an_element_and_the_chunks_that_hold_it() -> None:
    dup = [_chunk((0, 0), (2, 3)), _chunk((0, 0), (2, 3))]
    assert tiling_problem(torch.Size((4, 3)), dup) == (
        "element [0, 0] is in 2 chunks: #0 at [0, 0] sizes [2, 3], #1 at [0, 0] sizes [2, 3]"
    )
    hole = [_chunk((0, 0), (2, 3)), _chunk((3, 0), (1, 3))]
    assert tiling_problem(torch.Size((4, 3)), hole) == "element [2, 0] is in no chunk (a hole)"
    out = [_chunk((0, 0), (5, 3))]
    assert "is not inside the tensor of size [4, 3]" in str(tiling_problem(torch.Size((4, 3)), out))


@pytest.mark.slow  # a minute on 2 cores; the small cases above run in make test
@pytest.mark.spec("FMT-28", "FMT-29", "FMT-30")
def test_400k_chunks_and_records_are_checked_at_scale() -> None:
    """400k chunks and records, correct and with one planted fault each, are judged right
    (their time is a benchmark's business, not a unit test's)."""
    g = 632
    grid = [_chunk((i * 2, j * 3), (2, 3)) for i in range(g) for j in range(g)]
    rows = [_chunk((i * 4, 0), (4, 16)) for i in range(400_000)]
    records = [(i, f"f{i % 8}", (i // 8) * 100, 100) for i in range(400_000)]
    assert tiling_problem(torch.Size((2 * g, 3 * g)), grid) is None
    assert tiling_problem(torch.Size((1_600_000, 16)), rows) is None
    assert record_problem(records) is None
    assert tiling_problem(torch.Size((1_600_000, 16)), rows[:-1]) is not None  # a hole
    assert tiling_problem(torch.Size((1_600_000, 16)), [*rows, rows[7]]) is not None
    assert record_problem([*records, (-1, "f3", 150, 100)]) is not None  # shares bytes


# -- torch-written checkpoints pass ---------------------------------------------------------


def _torch_written(factory: pytest.TempPathFactory, world: int) -> tuple[Path, list[str]]:
    """torch's sharded save at ``world`` gloo ranks, written once per test session and shared
    by both implementations' tests (and the xdist workers, under a lock): spawning is the cost."""
    base = factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # the session's directory, above the workers' own
    root = base / f"torch_sharded_{world}"
    root.mkdir(parents=True, exist_ok=True)
    with open(root / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        done = root / "keys.json"
        if not done.exists():
            keys = run_gloo(world, _layout_fns.torch_saves_sharded, str(root / "ck"), timeout=120.0)
            done.write_text(json.dumps(keys[0]))
    return root / "ck", json.loads(done.read_text())


@pytest.mark.spec("FMT-28", "FMT-29")
@pytest.mark.parametrize("world", [1, 3])  # 1: rows and cols; 3: rows and a grid
def test_torch_written_sharded_checkpoints_pass(
    tmp_path_factory: pytest.TempPathFactory, world: int, impl: ModuleType
) -> None:
    path, keys = _torch_written(tmp_path_factory, world)
    md = load_metadata((path / ".metadata").read_bytes(), file=".metadata")
    assert sorted(md.state_dict_metadata) == keys
    check_stored_layout(md)
    assert verify_checkpoint(path).problems == []  # torch writes no checksums
    dest = {k: torch.zeros(tuple(md.state_dict_metadata[k].size)) for k in keys}  # type: ignore[union-attr]
    impl.load(dest, checkpoint_id=path)
    assert torch.equal(dest["plain"], torch.arange(35.0).reshape(7, 5))
    assert torch.equal(dest["rows"], dest["plain"]) and torch.equal(
        dest["grid" if world > 1 else "cols"], dest["plain"]
    )


# -- the silent attacks -------------------------------------------------------------------


def _rows(value: float) -> refdcp.LocalShards:
    return refdcp.LocalShards((6, 3), [((r, 0), torch.full((2, 3), value + r)) for r in (0, 2, 4)])


def _save(root: Path) -> Path:
    """A checkpoint with a 3-chunk tensor ``w`` (rows 0-1, 2-3, 4-5), two same-shaped
    tensors ``a`` and ``b`` and two non-tensor values."""
    w = _rows(1.0)
    sd = {"w": w, "a": torch.arange(6.0), "b": -torch.arange(6.0), "x": {"lr": 0.1}, "y": [1, 2]}
    refdcp.save(sd, checkpoint_id=root)
    return root


def _edit(root: Path, change: Callable[[Metadata], None]) -> None:
    path = root / ".metadata"
    md = load_metadata(path.read_bytes(), file=str(path))
    change(md)
    path.write_bytes(dump_metadata(md))


def _chunks(md: Metadata) -> list[C]:
    w = md.state_dict_metadata["w"]
    assert isinstance(w, TensorStorageMetadata)
    w.chunks.sort(key=lambda c: tuple(c.offsets))  # rows 0-1, 2-3, 4-5
    return w.chunks


def _duplicate_and_hole(md: Metadata) -> None:
    c = _chunks(md)
    c[1] = c[0]


def _overlap_and_hole(md: Metadata) -> None:
    c = _chunks(md)
    storage = md.storage_data
    old = MetadataIndex("w", c[1].offsets)
    c[1] = _chunk((1, 0), (2, 3))
    storage[MetadataIndex("w", c[1].offsets)] = storage.pop(old)


def _listed_twice_last_dropped(md: Metadata) -> None:
    c = _chunks(md)
    c[-1] = c[-2]


def _record_at_other_items_bytes(md: Metadata) -> None:
    storage = md.storage_data
    storage[MetadataIndex("b", torch.Size((0,)))] = copy.copy(
        storage[MetadataIndex("a", torch.Size((0,)))]
    )


def _value_record_at_other_values_bytes(md: Metadata) -> None:
    storage = md.storage_data
    storage[MetadataIndex("x.lr")] = copy.copy(storage[MetadataIndex("y")])


ATTACKS: dict[str, tuple[Callable[[Metadata], None], str]] = {
    "duplicate chunk and a hole": (_duplicate_and_hole, r"'w'.*element \[0, 0\] is in 2 chunks"),
    "overlap and a hole": (_overlap_and_hole, r"'w'.*element \[1, 0\] is in 2 chunks"),
    "chunk listed twice, last dropped": (
        _listed_twice_last_dropped,
        r"'w'.*element \[2, 0\] is in 2 chunks",
    ),
    "record at another item's bytes": (
        _record_at_other_items_bytes,
        r"'a' chunk at \[0\] .* and 'b' chunk at \[0\] .* share bytes|'b' chunk at \[0\] .* and 'a'",
    ),
    "value record at another value's bytes": (_value_record_at_other_values_bytes, r"share bytes"),
}


def _refused(load: Callable[[], None], match: str, impl: ModuleType = refdcp) -> None:
    """The load fails with a MalformedMetadataError (on its rank); the default path's message
    matches (the reference names the same problem in its own words, REF-9)."""
    with pytest.raises(CheckpointError) as info:
        load()
    (failure,) = info.value.rank_failures.values()
    assert isinstance(failure.exception, MalformedMetadataError), failure.exception
    if impl is refdcp:
        assert re.search(match, str(failure.exception)), str(failure.exception)


def _fresh() -> dict[str, Any]:
    return {
        "w": _rows(7.0),
        "a": torch.full((6,), 7.0),
        "b": torch.full((6,), 7.0),
        "x": {"lr": 7.0},
        "y": [7],
    }


def _same(x: Any, y: Any) -> bool:
    if isinstance(x, refdcp.LocalShards):
        return all(torch.equal(p[1], q[1]) for p, q in zip(x._chunks, y._chunks))
    if isinstance(x, torch.Tensor):
        return torch.equal(x, y)
    if isinstance(x, dict):
        return x.keys() == y.keys() and all(_same(x[k], y[k]) for k in x)
    return bool(x == y)


@pytest.mark.spec("FMT-28", "FMT-29", "REF-9")
@pytest.mark.parametrize("attack", sorted(ATTACKS))
@pytest.mark.parametrize("verify", [None, True, False])
def test_silent_layout_attacks_are_refused_before_any_destination_changes(
    tmp_path: Path, attack: str, verify: bool | None, impl: ModuleType
) -> None:
    change, match = ATTACKS[attack]
    root = _save(tmp_path / "ckpt")
    _edit(root, change)
    dest, before = _fresh(), _fresh()
    kwargs: dict[str, Any] = {} if verify is None else {"verify": verify}
    _refused(lambda: impl.load(dest, checkpoint_id=root, **kwargs), match, impl)
    assert _same(dest, before)


@pytest.mark.spec("FMT-28", "FMT-29", "TOOL-28")
@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_verify_reports_every_silent_layout_attack(tmp_path: Path, attack: str) -> None:
    change, match = ATTACKS[attack]
    root = _save(tmp_path / "ckpt")
    assert verify_checkpoint(root).ok
    _edit(root, change)
    report = verify_checkpoint(root)
    assert not report.ok
    assert any(re.search(match, f"{p.fqn!r} {p.message}") for p in report.problems), report.problems


@pytest.mark.spec("FMT-29")
def test_a_chunk_without_a_storage_record_is_refused_before_any_read(
    tmp_path: Path, impl: ModuleType
) -> None:
    root = _save(tmp_path / "ckpt")
    _edit(root, lambda md: md.storage_data.pop(MetadataIndex("w", torch.Size((2, 0)))))
    dest, before = _fresh(), _fresh()
    load = lambda: impl.load(dest, checkpoint_id=root)  # noqa: E731
    _refused(load, r"'w'.*chunk at \[2, 0\] has no storage record", impl)
    assert _same(dest, before)


@pytest.mark.spec("FMT-28")
def test_torch_single_rank_save_with_a_hole_is_refused_naming_the_element(
    tmp_path: Path, impl: ModuleType
) -> None:
    """torch checks coverage only with several ranks: its single-rank save of shards with a
    hole commits; refdcp refuses to load it rather than leave the hole's old values."""
    held = [((0, 0), torch.ones(1, 2))]
    dcp.save({"h": refdcp.LocalShards((3, 2), held)}, checkpoint_id=tmp_path, no_dist=True)
    dest = {"h": torch.full((3, 2), 5.0)}
    _refused(
        lambda: impl.load(dest, checkpoint_id=tmp_path),
        r"'h'.*element \[1, 0\] is in no chunk",
        impl,
    )
    assert torch.equal(dest["h"], torch.full((3, 2), 5.0))
