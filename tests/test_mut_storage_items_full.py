"""Item encoding and decoding at their edges (STORE-11, STORE-12, STORE-42, STORE-51, DEDUP-17; issue 28).

The full mutation run of ``storage/format/items.py`` left these unchecked: the
8 MiB line from which the writer checksums a tensor piece by piece (STORE-51)
and the refusal to report a CRC the writer has not computed yet; the value
digest's seed of a tensor stored through torch's pickling (DEDUP-17); which
reads cover a whole saved chunk (STORE-11); the box a read copies, the
refusal of a destination of another size even where torch would broadcast,
a blob decoded without its chunk's metadata, and a torch-pickled item read
with the weights-only unpickler (STORE-12, STORE-42).
"""

from __future__ import annotations

import io
import math
import pickle
from typing import Any

import crc32c
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

from refdcp.errors import RefdcpError
from refdcp.storage.format.items import (
    copy_into_destination,
    encode_tensor,
    load_tensor_from_blob,
    make_storage_info,
    narrow,
    value_digest_seed,
    whole_chunk,
)

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

MIB = 1 << 20


def _blob(enc: Any) -> bytes:
    return b"".join(bytes(p) for p in enc.parts)


# -- STORE-51: the writer checksums plain tensors of at least 8 MiB piece by piece ---------


@pytest.mark.spec("STORE-51")
@pytest.mark.parametrize("nbytes", [0, 1, 4096, 8 * MIB - 1, 8 * MIB, 8 * MIB + 4])
def test_the_writer_checksums_exactly_the_items_of_at_least_8_mib(nbytes: int) -> None:
    t = torch.arange(nbytes, dtype=torch.int64).to(torch.uint8)
    enc = encode_tensor(t, by_writer=True)
    head = bytes(enc.parts[0])
    if nbytes >= 8 * MIB:
        # the writer computes the CRC as it writes: until then there is none to record
        assert enc.head_crc == crc32c.crc32c(head)
        with pytest.raises(RuntimeError, match="has not computed this item's CRC-32C"):
            enc.final_crc()
        with pytest.raises(RuntimeError, match="STORE-51"):
            make_storage_info("f.distcp", 0, enc)
    else:
        assert enc.head_crc is None
        assert enc.final_crc() == crc32c.crc32c(_blob(enc))
        assert enc.value_crc == crc32c.crc32c(head + t.numpy().tobytes())


# -- DEDUP-17: the value digest's seed ------------------------------------------------------


@pytest.mark.spec("DEDUP-17")
@pytest.mark.parametrize(
    "t",
    [
        torch.tensor([[0.0, 3.0], [4.0, 0.0]]).to_sparse(),
        torch.tensor([[0.0, 3.0], [4.0, 0.0]]).to_sparse_csr(),
        torch.quantize_per_tensor(torch.tensor([0.5, 1.5]), 0.25, 1, torch.qint8),
        torch.quantize_per_tensor(torch.tensor([[0.5], [1.0]]), 0.1, 3, torch.quint8),
    ],
    ids=["sparse-coo", "sparse-csr", "qint8", "quint8"],
)
def test_a_tensor_stored_through_torchs_pickling_has_digest_seed_0(t: torch.Tensor) -> None:
    enc = encode_tensor(t)
    assert enc.data_offset is None and enc.value_crc is None  # pickled, not framed
    assert value_digest_seed(t) == 0


@pytest.mark.spec("DEDUP-17")
@pytest.mark.parametrize(
    "t",
    [
        torch.tensor(2.5),
        torch.zeros(0, 3),
        torch.arange(12, dtype=torch.int16).reshape(3, 4),
        torch.tensor([True, False, True]),
    ],
    ids=["0-d", "empty", "int16", "bool"],
)
def test_a_framed_tensors_digest_seed_is_the_crc_of_its_frames_head(t: torch.Tensor) -> None:
    enc = encode_tensor(t)
    head = bytes(enc.parts[0])
    assert value_digest_seed(t) == crc32c.crc32c(head)
    enc.final_crc()
    assert enc.value_crc == crc32c.crc32c(t.numpy().tobytes(), value_digest_seed(t))


# -- STORE-11 / STORE-12: whole chunks, boxes, destinations ---------------------------------


def _read_item(offsets: list[int], lengths: list[int]) -> ReadItem:
    index = MetadataIndex("w", torch.Size([0] * len(offsets)))
    return ReadItem(
        type=LoadItemType.TENSOR,
        dest_index=index,
        dest_offsets=torch.Size([0] * len(offsets)),
        storage_index=index,
        storage_offsets=torch.Size(offsets),
        lengths=torch.Size(lengths),
    )


@st.composite
def _box(draw: st.DrawFn) -> tuple[list[int], list[int], list[int]]:
    """(sizes, offsets, lengths): offsets and lengths at most one past each size."""
    sizes = draw(st.lists(st.integers(0, 4), min_size=1, max_size=3))
    offsets = [draw(st.sampled_from([0, 0, 1, s, s + 1])) for s in sizes]
    lengths = [draw(st.sampled_from([s, s, s - 1, 1, 0])) for s in sizes]
    return sizes, offsets, [max(n, 0) for n in lengths]


@pytest.mark.spec("STORE-11")
@settings(deadline=None)
@given(_box())
@example(([3], [0], [3]))
@example(([3], [1], [3]))
@example(([3], [0], [2]))
@example(([2, 3], [0, 0], [2, 3]))
@example(([2, 3], [0, 1], [2, 3]))
@example(([2, 3], [1, 0], [2, 3]))
def test_a_read_is_whole_exactly_when_it_starts_at_0_and_spans_the_chunk(
    box: tuple[list[int], list[int], list[int]],
) -> None:
    sizes, offsets, lengths = box
    expected = all(o == 0 for o in offsets) and lengths == sizes
    assert whole_chunk(_read_item(offsets, lengths), sizes) is expected


@pytest.mark.spec("STORE-12")
@settings(deadline=None)
@given(_box())
@example(([3], [1], [3]))
@example(([3], [2], [3]))
@example(([2, 3], [0, 1], [2, 3]))
@example(([4, 2], [0, 0], [4, 2]))
@example(([4, 2], [1, 0], [2, 2]))
def test_narrow_gives_exactly_the_box_or_refuses_one_outside_the_tensor(
    box: tuple[list[int], list[int], list[int]],
) -> None:
    sizes, offsets, lengths = box
    t = torch.arange(math.prod(sizes)).reshape(sizes)
    inside = all(o + n <= s for o, n, s in zip(offsets, lengths, sizes, strict=True))
    if not inside:
        with pytest.raises((RuntimeError, IndexError)):
            narrow(t, offsets, lengths)
        return
    out = narrow(t, offsets, lengths)
    want = t[tuple(slice(o, o + n) for o, n in zip(offsets, lengths, strict=True))]
    assert out.shape == torch.Size(lengths) and torch.equal(out, want)
    if out.numel():
        assert out.data_ptr() == want.data_ptr()  # a view, not a copy


class _Planner:
    """resolve_tensor hands out ``dest``; commit_tensor records what was committed."""

    def __init__(self, dest: torch.Tensor) -> None:
        self.dest = dest
        self.committed: list[torch.Tensor] = []

    def resolve_tensor(self, req: ReadItem) -> torch.Tensor:
        return self.dest

    def commit_tensor(self, req: ReadItem, tensor: torch.Tensor) -> None:
        self.committed.append(tensor)


@pytest.mark.spec("STORE-12")
@pytest.mark.parametrize(
    ("dest_shape", "source_shape"),
    [((3, 4), (1, 4)), ((3, 4), (4,)), ((2,), ()), ((2, 2), (2, 1)), ((3,), (2,)), ((1,), (1, 1))],
)
def test_a_destination_of_another_size_is_refused_even_where_torch_would_broadcast(
    dest_shape: tuple[int, ...], source_shape: tuple[int, ...]
) -> None:
    dest = torch.full(dest_shape, -1.0)
    planner: Any = _Planner(dest)
    source = torch.ones(source_shape)
    req = _read_item([0] * len(source_shape), list(source_shape))
    with pytest.raises(RefdcpError, match="destination size") as err:
        copy_into_destination(planner, req, source)
    assert str(tuple(dest_shape)) in str(err.value) and str(tuple(source_shape)) in str(err.value)
    assert planner.committed == [] and bool((dest == -1).all())  # untouched, never committed


@pytest.mark.spec("STORE-12")
@pytest.mark.parametrize("with_chunk", [True, False])
@pytest.mark.parametrize(
    ("offsets", "lengths"), [([0, 0], [3, 4]), ([1, 0], [2, 4]), ([0, 1], [3, 2]), ([2, 3], [1, 1])]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.int16, torch.bfloat16])
def test_a_blob_delivers_its_box_with_or_without_the_chunks_metadata(
    with_chunk: bool, offsets: list[int], lengths: list[int], dtype: torch.dtype
) -> None:
    t = torch.arange(12).reshape(3, 4).to(dtype)
    enc = encode_tensor(t)
    info = make_storage_info("f.distcp", 0, enc)
    chunk = (dtype, (3, 4)) if with_chunk else None
    want = t[offsets[0] : offsets[0] + lengths[0], offsets[1] : offsets[1] + lengths[1]]
    planner: Any = _Planner(torch.zeros(lengths, dtype=dtype))
    load_tensor_from_blob(
        memoryview(_blob(enc)), info, chunk, _read_item(offsets, lengths), planner
    )
    assert len(planner.committed) == 1
    assert planner.committed[0].data_ptr() == planner.dest.data_ptr()  # the destination itself
    assert torch.equal(planner.dest, want)


_CALLS: list[str] = []


def _ran_on_load() -> torch.Tensor:
    _CALLS.append("ran")
    return torch.zeros(2)


class _Hostile:
    """Pickles as a call of a function of this module: no weights-only unpickler allows it."""

    def __reduce__(self) -> tuple[Any, ...]:
        return (_ran_on_load, ())


@pytest.mark.spec("STORE-42", "FMT-22")
def test_a_pickled_item_is_read_with_the_weights_only_unpickler() -> None:
    buf = io.BytesIO()
    torch.save(_Hostile(), buf)
    blob = buf.getvalue()
    info = _StorageInfo("f.distcp", 0, len(blob))  # no data offset: torch's pickling
    planner: Any = _Planner(torch.ones(2))
    _CALLS.clear()
    with pytest.raises(pickle.UnpicklingError):
        load_tensor_from_blob(
            memoryview(blob), info, (torch.float32, (2,)), _read_item([0], [2]), planner
        )
    assert _CALLS == [] and planner.committed == [] and bool((planner.dest == 1).all())
