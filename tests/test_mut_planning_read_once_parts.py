"""The parts of a read-once load, called directly (spec/read_once.md): the readers against
the reference on tiny items (ONCE-8, ONCE-1), each rank's role (ONCE-2, ONCE-3), the
pieces boxes travel as (ONCE-3) and the check of what a rank sent (ONCE-4).

``tests/test_read_once.py`` runs whole loads; the boundaries here (an object counted as
one byte, a one-byte box, an empty box, a view whose bytes are not its values) are
cheaper to reach one function at a time.
"""

from __future__ import annotations

import itertools
import re
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

from refdcp.errors import RefdcpError
from refdcp.planning.read_once import (
    ReadOnceRole,
    ReadOnceState,
    Sent,
    assign_readers,
    box_key,
    check_sender,
    piece,
    split_plans,
    unpiece,
)
from refdcp.reference.load_planner import read_once_readers


def _plain_id(value: object) -> str:
    """A test id of letters, digits and underscores only (the mutation runner selects by id)."""
    return re.sub(r"\W+", "_", str(value)).strip("_") or "empty"


# -- the readers: objects count one byte, tensors their bytes (ONCE-1, ONCE-8) ------------

#: stored items: name -> bytes (0 for an object); "stray" reads an offset no chunk has
_ITEMS = {"o1": 0, "o2": 0, "o3": 0, "t1": 1, "t2": 2, "t3": 3, "stray": 2}


def _metadata() -> Metadata:
    md: dict[str, Any] = {}
    for name, n in _ITEMS.items():
        if n == 0:
            md[name] = BytesStorageMetadata()
        else:
            md[name] = TensorStorageMetadata(
                TensorProperties(dtype=torch.uint8),
                torch.Size([n]),
                [ChunkStorageMetadata(torch.Size([0]), torch.Size([n]))],
            )
    return Metadata(state_dict_metadata=md)


def _read(name: str) -> ReadItem:
    if _ITEMS[name] == 0:
        where = MetadataIndex(name)
        return ReadItem(
            LoadItemType.BYTE_IO, where, torch.Size([0]), where, torch.Size([0]), torch.Size([1])
        )
    at = torch.Size([1 if name == "stray" else 0])
    where = MetadataIndex(name, at, 0)
    return ReadItem(
        LoadItemType.TENSOR, where, torch.Size([0]), where, torch.Size([0]), torch.Size([1])
    )


@pytest.mark.spec("ONCE-8", "ONCE-1")
@settings(max_examples=300)  # cheap examples
@given(st.lists(st.lists(st.sampled_from(sorted(_ITEMS)), unique=True), min_size=2, max_size=4))
@example([["o1", "o2", "o3"], ["t3", "o3"]])  # rank 0 alone: 2 objects = 2 < 3 bytes
@example([["stray", "o1"], ["o1"]])  # an offset no saved chunk has counts 0 bytes
def test_readers_equal_the_reference_on_one_byte_items(plans_of: list[list[str]]) -> None:
    plans = [LoadPlan([_read(n) for n in names]) for names in plans_of]
    md = _metadata()
    assert assign_readers(plans, md) == read_once_readers(plans, md)


# -- the roles (ONCE-2, ONCE-3) ------------------------------------------------------------


def _box(rank_rows: tuple[int, int]) -> ReadItem:
    lo, hi = rank_rows
    return ReadItem(
        LoadItemType.TENSOR,
        MetadataIndex("w", torch.Size([lo, 0]), 0),
        torch.Size([0, 0]),
        MetadataIndex("w", torch.Size([0, 0]), 0),
        torch.Size([lo, 0]),
        torch.Size([hi - lo, 4]),
    )


BOXES = [(0, 2), (2, 4), (4, 8), (0, 8)]


@pytest.mark.spec("ONCE-2", "ONCE-3")
@pytest.mark.parametrize(
    "wants",
    [
        w
        for w in itertools.product(
            [(), (0,), (1,), (0, 1), (3,), (1, 2)], [(0,), (0, 2), (2,), (3,), ()]
        )
        if w[0] and w[1]
    ],
    ids=_plain_id,
)
def test_each_role_sends_exactly_what_others_need(wants: tuple[tuple[int, ...], ...]) -> None:
    """Two ranks read boxes of one saved chunk ``w`` (so it has one reader): the reader sends
    exactly the boxes the other rank needs, fetches into scratch only those it does not
    read itself (the whole box, from the scratch's origin), and the other rank receives
    each of its boxes from the reader and keeps none of them in its plan."""
    plans = [LoadPlan([_box(BOXES[i]) for i in w]) for w in wants]
    readers = {("w", (0, 0)): 0}
    roles = split_plans(plans, readers)
    mine = [{box_key(_box(BOXES[i])) for i in w} for w in wants]
    reader, other = roles[0], roles[1]
    assert isinstance(reader.planner_data, ReadOnceRole)
    assert isinstance(other.planner_data, ReadOnceRole)
    assert set(reader.planner_data.sends) == mine[1]
    assert len(reader.planner_data.sends) == len(mine[1])
    fetched = {box_key(f) for f in reader.planner_data.fetch}
    assert fetched == mine[1] - mine[0]
    for f in reader.planner_data.fetch:
        assert list(f.dest_offsets) == [0, 0] and f in reader.items
    assert other.items == [] and other.planner_data.sends == ()
    assert {(box_key(i), r) for i, r in other.planner_data.receives} == {(b, 0) for b in mine[1]}


@pytest.mark.spec("ONCE-2")
def test_a_fetch_added_later_reads_the_box_into_scratch() -> None:
    """A box the reader cannot send from its destination (a cast one) is read again into
    scratch: ``add_fetch`` returns that read, and the state counts it among its fetches."""
    item = _box((2, 4))
    state = ReadOnceState(ReadOnceRole(sends=(box_key(item),), fetch=(), receives=()))
    fetch = state.add_fetch(item)
    assert fetch in state.fetch and fetch != item
    assert box_key(fetch) == box_key(item) and list(fetch.dest_offsets) == [0, 0]
    assert fetch.lengths == item.lengths and fetch.storage_offsets == item.storage_offsets


# -- pieces (ONCE-3) -----------------------------------------------------------------------


def _views(dtype: torch.dtype) -> list[torch.Tensor]:
    base = torch.arange(12).reshape(3, 4).to(dtype)
    out = [base, base.t(), base[1:, ::2], base[:1, :1], base[:0], base.reshape(-1)[5]]
    if dtype.is_complex:
        out += [base.conj(), torch._neg_view(base)]
    return out


@pytest.mark.spec("ONCE-3")
@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.uint8, torch.bool, torch.int16, torch.complex64], ids=_plain_id
)
def test_a_piece_carries_the_values_back(dtype: torch.dtype) -> None:
    for t in _views(dtype):
        name, shape, raw = piece(t)
        assert shape == tuple(t.shape) and raw.dtype == np.uint8
        back = unpiece((name, shape, raw))
        assert back.dtype == t.dtype and back.shape == t.shape
        assert torch.equal(back, t.resolve_conj().resolve_neg()), t


@pytest.mark.spec("ONCE-3", "COMM-63")
def test_a_piece_is_over_the_tensors_memory_when_it_holds_the_values() -> None:
    t = torch.arange(6, dtype=torch.float32)
    raw = piece(t)[2]
    assert raw.ctypes.data == t.data_ptr()  # no copy: pickled out of band as it is
    for other in (t.reshape(2, 3).t(), t.to(torch.complex64).conj()):
        assert piece(other)[2].ctypes.data != other.data_ptr()


@pytest.mark.spec("ONCE-3")
def test_unpiece_shares_a_writeable_buffer_and_copies_a_read_only_one() -> None:
    raw = np.arange(8, dtype=np.uint8)
    back = unpiece(("uint8", (2, 4), raw))
    assert back.data_ptr() == raw.ctypes.data
    frozen = np.frombuffer(bytes(range(8)), dtype=np.uint8)
    assert not frozen.flags.writeable
    copy = unpiece(("uint8", (8,), frozen))
    assert copy.data_ptr() != frozen.ctypes.data
    copy[0] = 7  # the result is the caller's to write
    assert list(copy) == [7, *range(1, 8)]


@pytest.mark.spec("ONCE-3")
@pytest.mark.parametrize("name", ["Tensor", "no_such_dtype", "nn"])
def test_a_piece_naming_no_dtype_is_refused(name: str) -> None:
    with pytest.raises(RefdcpError, match="names no dtype"):
        unpiece((name, (1,), np.zeros(4, dtype=np.uint8)))


# -- what a rank sent (ONCE-4) -------------------------------------------------------------


@pytest.mark.spec("ONCE-4")
@pytest.mark.parametrize("sent", [None, {}, b"x", ("float32", (1,), b"")], ids=_plain_id)
def test_a_rank_that_sent_no_pieces_is_named(sent: Any) -> None:
    with pytest.raises(RefdcpError, match="rank 3 sent no pieces"):
        check_sender(sent, 3, None)


@pytest.mark.spec("ONCE-4")
@pytest.mark.parametrize(("theirs", "ours"), list(itertools.product([None, False, True], repeat=2)))
def test_a_rank_that_checked_with_another_verify_mode_is_refused(
    theirs: bool | None, ours: bool | None
) -> None:
    sent = Sent(theirs, {})
    if theirs == ours:
        assert check_sender(sent, 1, ours) is sent
    else:
        with pytest.raises(RefdcpError, match=f"rank 1 checked its pieces with verify={theirs}"):
            check_sender(sent, 1, ours)
