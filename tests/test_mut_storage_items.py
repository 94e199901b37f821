"""Item encoding and decoding, observed through the storages (FMT-2..FMT-4, STORE-12, INTEG-3; issue 13).

Every dtype and shape (0-d, empty, views, non-contiguous, quantized)
round-trips bit-exactly through the in-memory and filesystem storages without
a warning; ``verify_blob`` names truncation and mismatch; the bytes refdcp
stores for a tensor (sparse included) are exactly what ``torch.load`` reads back.
"""

from __future__ import annotations

import io
import warnings
from pathlib import Path
from typing import Any

import crc32c
import pytest
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo

import refdcp
from refdcp.storage.errors import CorruptionError, MissingChecksumError
from refdcp.storage.format.items import (
    checksum_of,
    data_offset_of,
    encode_bytes,
    encode_tensor,
    make_storage_info,
    raw_view,
    verify_blob,
)

SINGLE_PATH = "mutation-kill tests pinning one module of the default path (tests/MUTATION.md); the behaviour runs on both in the shared suites"

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _state() -> dict[str, Any]:
    base = torch.arange(40, dtype=torch.float64)
    return {
        "f32": torch.arange(12, dtype=torch.float32).reshape(3, 4),
        "i8": torch.tensor([-3, 0, 5], dtype=torch.int8),
        "bool": torch.tensor([True, False]),
        "bf16": torch.arange(6, dtype=torch.bfloat16),
        "c64": torch.tensor([1 + 1j, -2j], dtype=torch.complex64),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 3),
        "view": base[5:9],
        "strided": torch.arange(12, dtype=torch.int32).reshape(3, 4).t(),
        "q": torch.quantize_per_tensor(torch.tensor([0.5, 1.0]), 0.1, 3, torch.quint8),
        "step": 3,
    }


def _zeros_like(sd: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in sd.items():
        if not isinstance(v, torch.Tensor):
            out[k] = None
        elif v.is_sparse or v.is_quantized:
            out[k] = (
                v.clone() * 0
                if v.is_sparse
                else torch.quantize_per_tensor(torch.zeros(2), 0.1, 3, torch.quint8)
            )
        else:
            out[k] = torch.zeros_like(v).contiguous()
    return out


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        if a.is_sparse:
            return torch.equal(a.to_dense(), b.to_dense())
        if a.is_quantized:
            return torch.equal(a.int_repr(), b.int_repr()) and a.q_scale() == b.q_scale()
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    return bool(a == b)


@pytest.mark.spec("STORE-12", "FMT-3", "FMT-4")
@pytest.mark.parametrize("backend", ["memory", "filesystem"])
@pytest.mark.parametrize("verify", [None, True, False])
def test_every_kind_of_item_round_trips_bit_exact_without_warnings(
    tmp_path: Path, backend: str, verify: bool | None
) -> None:
    sd = _state()
    storage = refdcp.MemoryStorage()
    if backend == "memory":
        refdcp.save(sd, storage_writer=storage.writer("c"), no_dist=True)
    else:
        refdcp.save(sd, checkpoint_id=tmp_path)
    out = _zeros_like(sd)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.filterwarnings("ignore", message="torch.distributed is")
        warnings.filterwarnings("ignore", category=FutureWarning)
        warnings.filterwarnings("ignore", message="TypedStorage is deprecated")  # torch.load's
        if backend == "memory":
            refdcp.load(out, storage_reader=storage.reader("c"), no_dist=True, verify=verify)
        else:
            refdcp.load(out, checkpoint_id=tmp_path, verify=verify)
    for k, v in sd.items():
        assert _same(v, out[k]), k


@pytest.mark.spec("FMT-3", "FMT-4")
@pytest.mark.parametrize(
    "t",
    [
        torch.arange(10, dtype=torch.float32),
        torch.arange(30, dtype=torch.int16).reshape(5, 6)[1:3],
        torch.arange(12, dtype=torch.float64).reshape(3, 4).t(),
        torch.tensor(7, dtype=torch.uint8),
        torch.zeros(0, dtype=torch.float16),
        torch.ones(3, requires_grad=True),
    ],
    ids=["1-d", "view", "transposed", "0-d", "empty", "requires_grad"],
)
def test_the_encoded_item_is_a_torch_save_archive_of_just_the_elements(t: torch.Tensor) -> None:
    enc = encode_tensor(t)
    blob = b"".join(bytes(p) for p in enc.parts)
    assert len(blob) == enc.length
    assert enc.final_crc() == crc32c.crc32c(blob)
    back = torch.load(io.BytesIO(blob), weights_only=True)
    assert back.dtype == t.dtype and torch.equal(back, t.detach())
    assert back.untyped_storage().nbytes() == t.nbytes  # FMT-4: only the view's elements
    assert enc.data_offset is not None and enc.data_offset % 64 == 0
    n = t.nbytes
    assert blob[enc.data_offset : enc.data_offset + n] == t.detach().contiguous().numpy().tobytes()
    info = make_storage_info("f.distcp", 128, enc)
    assert (info.relative_path, info.offset, info.length) == ("f.distcp", 128, enc.length)
    assert checksum_of(info) == crc32c.crc32c(blob) and data_offset_of(info) == enc.data_offset


@pytest.mark.spec("FMT-22", "FMT-4")
def test_sparse_and_quantized_items_are_archives_torch_reads_back() -> None:
    big = torch.quantize_per_tensor(torch.rand(9 << 20), 0.01, 0, torch.quint8)  # 9 MiB
    for t in (
        torch.tensor([[0.0, 3.0], [4.0, 0.0]]).to_sparse(),
        torch.quantize_per_tensor(torch.tensor([0.5, 1.5]), 0.25, 1, torch.qint8),
        big,  # large enough for the CRC to be computed on the pool
    ):
        enc = encode_tensor(t)
        blob = b"".join(bytes(p) for p in enc.parts)
        assert enc.data_offset is None and enc.length == len(blob)
        assert enc.final_crc() == crc32c.crc32c(blob)
        back = torch.load(io.BytesIO(blob), weights_only=True)
        assert _same(t, back)
        info = make_storage_info("f", 0, enc)
        assert data_offset_of(info) is None and not hasattr(info, "refdcp_data_offset")


@pytest.mark.spec("FMT-2")
@pytest.mark.parametrize("data", [b"", b"abc", io.BytesIO(b"xyz" * 100)])
def test_bytes_items_are_stored_verbatim(data: Any) -> None:
    enc = encode_bytes(data)
    raw = data.getvalue() if isinstance(data, io.BytesIO) else data
    assert b"".join(bytes(p) for p in enc.parts) == raw
    assert (enc.length, enc.crc, enc.data_offset) == (len(raw), crc32c.crc32c(raw), None)


@pytest.mark.spec("FMT-3")
def test_raw_view_is_the_tensors_memory() -> None:
    for n in (0, 1, 7, 4096):
        t = torch.arange(n, dtype=torch.uint8)
        v = raw_view(t)
        assert v.nbytes == n and bytes(v) == t.numpy().tobytes()
        if n:
            v[0] = 99
            assert int(t[0]) == 99  # not a copy
    views = [raw_view(torch.zeros(k + 1, dtype=torch.uint8)) for k in range(5000)]
    assert [v.nbytes for v in views[:3]] == [1, 2, 3] and views[-1].nbytes == 5000


@pytest.mark.spec("INTEG-3")
def test_verify_blob_names_mismatch_truncation_and_a_missing_checksum() -> None:
    blob = b"0123456789"
    info = _StorageInfo("f.distcp", 40, 10)
    info.refdcp_crc32c = crc32c.crc32c(blob)  # type: ignore[attr-defined]
    verify_blob(blob, info, "w", "f.distcp")
    verify_blob(memoryview(blob), info, "w", "f.distcp")
    with pytest.raises(CorruptionError, match="checksum mismatch") as err:
        verify_blob(b"0123456788", info, "w", "f.distcp")
    assert (err.value.fqn, err.value.file, err.value.offset) == ("w", "f.distcp", 40)
    for short in (b"012345678", b"0123456789a"):
        with pytest.raises(CorruptionError, match=f"item truncated: {len(short)} of 10 bytes"):
            verify_blob(short, info, "w", "f.distcp")
    bare = _StorageInfo("f.distcp", 40, 10)
    with pytest.raises(MissingChecksumError, match=r"w: no checksum recorded in f\.distcp"):
        verify_blob(blob, bare, "w", "f.distcp")
    bare.refdcp_crc32c = "123"  # type: ignore[attr-defined]
    assert checksum_of(bare) is None
