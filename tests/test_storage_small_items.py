"""The small-tensor write path writes exactly what ``encode_tensor`` frames (FMT-3, INTEG-1, SAVE-10)."""

from __future__ import annotations

import pickle
import tempfile
from types import ModuleType

import pytest
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.storage import WriteResult

from refdcp.storage.format import records
from refdcp.storage.format.items import encode_tensor, make_storage_info
from refdcp.storage.format.records import FAST, small_write_result, storage_info, write_result
from refdcp.storage.format.small_tensors import SMALL_MAX_BYTES, small_tensor_parts

PLAIN = [
    torch.arange(6, dtype=torch.float32).reshape(2, 3),
    torch.tensor(3.5, dtype=torch.float64),
    torch.arange(10, dtype=torch.int8)[2:7],  # a contiguous view at a storage offset
    torch.ones(3, 4, dtype=torch.bfloat16).requires_grad_(),
    torch.nn.Parameter(torch.full((5,), 2.0)),
]
NOT_SMALL = [
    torch.zeros(0),  # empty
    torch.arange(12.0).reshape(3, 4).t(),  # not contiguous: bytes are not the values
    torch.tensor([1 + 2j, 3 - 1j]).conj(),  # conjugate view
    torch.zeros(SMALL_MAX_BYTES // 4),  # too large for the small path
    torch.zeros(3, device="meta"),
]


def _bytes(parts: list[object]) -> bytes:
    return b"".join(bytes(memoryview(p).cast("B")) for p in parts)  # type: ignore[arg-type]


@pytest.mark.spec("FMT-3", "INTEG-1")
@pytest.mark.parametrize("t", PLAIN, ids=lambda t: f"{t.dtype}{tuple(t.shape)}")
def test_small_parts_equal_encode_tensor(t: torch.Tensor) -> None:
    small = small_tensor_parts(t)
    assert small is not None
    head, data, tail, length, crc, data_offset, value = small
    enc = encode_tensor(t)
    assert _bytes([head, data, tail]) == _bytes(enc.parts)
    assert (length, crc, data_offset) == (enc.length, enc.final_crc(), enc.data_offset)
    assert value == enc.value_crc  # the same value digest on both paths (STORE-52)


@pytest.mark.spec("SAVE-10")
@pytest.mark.parametrize("t", NOT_SMALL, ids=lambda t: f"{t.dtype}{tuple(t.shape)}{t.device}")
def test_tensors_whose_bytes_are_not_plain_values_take_encode_tensor(t: torch.Tensor) -> None:
    assert small_tensor_parts(t) is None


@pytest.mark.spec("INTEG-1")
def test_records_equal_torchs_constructors() -> None:
    assert FAST
    enc = encode_tensor(torch.ones(4))
    fast = storage_info("__0_0.distcp", 64, enc.length, enc.final_crc(), enc.data_offset)
    slow = make_storage_info("__0_0.distcp", 64, enc)
    assert fast == slow and vars(fast) == {k: v for k, v in vars(slow).items() if v is not None}
    assert pickle.dumps(fast) == pickle.dumps(slow)  # torch's __getstate__ drops the None
    idx = MetadataIndex("w", [0])
    assert write_result(idx, 5, fast) == WriteResult(index=idx, size_in_bytes=5, storage_data=slow)
    assert isinstance(fast, _StorageInfo) and fast.transform_descriptors is None


@pytest.mark.spec("INTEG-1", "STORE-52")
@pytest.mark.parametrize("fast", [True, False], ids=["fast", "constructors"])
@pytest.mark.parametrize("t", PLAIN[:3], ids=lambda t: f"{t.dtype}{tuple(t.shape)}")
def test_small_write_result_is_write_result_of_storage_info(
    t: torch.Tensor, fast: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The writer's one-call record of a small item is the two builders' (fields, their
    order, the value digest on the result, the pickled bytes of the stored record)."""
    monkeypatch.setattr(records, "FAST", fast)
    parts = small_tensor_parts(t)
    assert parts is not None
    _, _, _, length, crc, data_offset, value = parts
    idx = MetadataIndex("w", [0])
    got = small_write_result(idx, "__0_0.distcp", 128, parts)
    want = write_result(
        idx, length, storage_info("__0_0.distcp", 128, length, crc, data_offset), value
    )
    assert got == want and list(vars(got)) == list(vars(want))
    assert list(vars(got.storage_data)) == list(vars(want.storage_data))
    assert vars(got.storage_data) == vars(want.storage_data)
    assert pickle.dumps(got.storage_data) == pickle.dumps(want.storage_data)
    assert records.value_crc_of(got) == value


@pytest.mark.spec("SAVE-10", "LOAD-10")
def test_mixed_small_and_other_tensors_round_trip_through_torch(impl: ModuleType) -> None:
    import torch.distributed.checkpoint as dcp

    sd = {f"p{i}": t for i, t in enumerate(PLAIN + NOT_SMALL[:4])}
    expected = {k: v.detach().resolve_conj() for k, v in sd.items()}
    with tempfile.TemporaryDirectory() as d:
        impl.save(sd, checkpoint_id=d, no_dist=True)
        ours = {k: torch.zeros_like(v) for k, v in expected.items()}
        impl.load(ours, checkpoint_id=d, no_dist=True)  # every checksum checked (LOAD-10)
        theirs = {k: torch.zeros_like(v) for k, v in expected.items()}
        dcp.load(theirs, storage_reader=dcp.FileSystemReader(d), no_dist=True)
    for k, v in expected.items():
        assert torch.equal(ours[k], v) and torch.equal(theirs[k], v), k
