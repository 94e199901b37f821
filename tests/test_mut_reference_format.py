"""The reference path's stored bytes (refdcp/reference/format.py), checked on the reference
alone: the recorded raw-data offset of a dense tensor (FMT-3), plain values of any tensor
(FMT-4), weights-only decoding and the `.metadata` size cap (FMT-10)."""

from __future__ import annotations

import io
import pickle
from typing import Any

import pytest
import torch

from refdcp.reference import format as fmt
from refdcp.storage import UnsafeMetadataError


def _dense() -> list[torch.Tensor]:
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    return [base, base[1:3, ::2], base.t(), torch.arange(5, dtype=torch.int16), torch.ones(0)]


@pytest.mark.spec("FMT-3", "FMT-4", "REF-1")
@pytest.mark.parametrize("t", _dense(), ids=["plain", "view", "transposed", "int16", "empty"])
def test_a_dense_tensor_records_where_its_raw_bytes_start(t: torch.Tensor) -> None:
    blob, off = fmt.encode_item(t)
    assert off is not None and off % 64 == 0
    raw = t.contiguous().numpy().tobytes()
    assert blob[off : off + len(raw)] == raw
    assert torch.equal(fmt.decode_tensor(blob), t) and fmt.decode_tensor(blob).is_contiguous()
    info = fmt.storage_info("f", 10, blob, off)
    assert info.refdcp_data_offset == off and (info.offset, info.length) == (10, len(blob))  # type: ignore[attr-defined]
    assert not hasattr(fmt.storage_info("f", 0, blob, None), "refdcp_data_offset")


@pytest.mark.spec("FMT-3", "REF-1")
def test_sparse_and_quantized_tensors_record_no_data_offset() -> None:
    sparse = torch.eye(3).to_sparse()
    q = torch.quantize_per_tensor(torch.arange(4.0), 0.5, 0, torch.quint8)
    for t in (sparse, q):
        blob, off = fmt.encode_item(t)
        assert off is None
        back = fmt.decode_tensor(blob)
        assert back.layout == t.layout and back.is_quantized == t.is_quantized
        assert torch.equal(
            back.to_dense() if back.is_sparse else back.dequantize(),
            t.to_dense() if t.is_sparse else t.dequantize(),
        )
    assert fmt.plain_values(sparse).layout == torch.sparse_coo


@pytest.mark.spec("FMT-4", "SAVE-10")
def test_plain_values_resolve_views_conjugation_and_negation() -> None:
    base = torch.arange(12.0).reshape(3, 4)
    view = base[:, 1::2]
    out = fmt.plain_values(view)
    assert out.is_contiguous() and torch.equal(out, view)
    assert out.untyped_storage().nbytes() == view.numel() * 4  # only its own elements
    z = torch.tensor([1 + 2j, 3 - 1j]).conj()
    pz = fmt.plain_values(z)
    assert not pz.is_conj() and torch.equal(pz, torch.tensor([1 - 2j, 3 + 1j]))
    neg = torch.tensor([1 + 2j]).conj().imag  # a negative-bit view
    pn = fmt.plain_values(neg)
    assert not pn.is_neg() and torch.equal(pn, torch.tensor([-2.0]))


class _Gadget:
    def __reduce__(self) -> Any:
        return (print, ("unpickled",))


@pytest.mark.spec("FMT-3", "REF-1")
def test_a_stored_tensor_is_decoded_weights_only() -> None:
    buf = io.BytesIO()
    torch.save({"x": _Gadget()}, buf)
    with pytest.raises(pickle.UnpicklingError):
        fmt.decode_tensor(buf.getvalue())


class _Sized:
    """Stands for a `.metadata` of a given size without allocating it."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, key: Any) -> bytes:
        raise LookupError("read past the size check")


@pytest.mark.spec("FMT-10", "REF-1", "REF-20")
def test_the_metadata_size_cap_is_one_gib() -> None:
    with pytest.raises(UnsafeMetadataError, match="size limit"):
        fmt.load_metadata(_Sized((1 << 30) + 1), ".metadata")  # type: ignore[arg-type]
    with pytest.raises(LookupError):
        fmt.load_metadata(_Sized(1 << 30), ".metadata")  # type: ignore[arg-type]


@pytest.mark.spec("INTEG-2", "REF-1")
def test_a_trailer_without_its_final_newline_is_no_trailer() -> None:
    from torch.distributed.checkpoint.metadata import Metadata

    from refdcp.storage import CorruptionError

    data = fmt.dump_metadata(Metadata(state_dict_metadata={}))
    assert fmt.load_metadata(data, ".metadata").state_dict_metadata == {}
    with pytest.raises(CorruptionError, match="lacks its checksum trailer"):
        fmt.load_metadata(data[:-1] + b"x", ".metadata")


def _md(records: dict[Any, Any] | None = None, **tensors: Any) -> Any:
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        TensorProperties,
        TensorStorageMetadata,
    )

    sd = {
        fqn: TensorStorageMetadata(
            TensorProperties(dtype=torch.float32),
            torch.Size(size),
            [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in chunks],
        )
        for fqn, (size, chunks) in tensors.items()
    }
    return Metadata(state_dict_metadata=sd, storage_data=records or {})


def _rec(path: Any = "__0_0.distcp", offset: Any = 0, length: Any = 8) -> Any:
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    return _StorageInfo(path, offset, length)


def _idx(fqn: str, *off: int) -> Any:
    from torch.distributed.checkpoint.metadata import MetadataIndex

    return MetadataIndex(fqn, torch.Size(off))


@pytest.mark.spec("FMT-7", "REF-1")
def test_an_unknown_format_or_version_is_refused() -> None:
    from refdcp.storage import FormatVersionError

    md = _md()
    md.version = "9.9.9"
    with pytest.raises(FormatVersionError):
        fmt.load_metadata(fmt.dump_metadata(md), ".metadata")
    md = _md()
    md.refdcp_format = 2
    body = pickle.dumps(md)
    import crc32c

    data = body + fmt.TRAILER + b"%08x\n" % crc32c.crc32c(body)
    with pytest.raises(FormatVersionError):
        fmt.load_metadata(data, ".metadata")


@pytest.mark.spec("FMT-6", "REF-1")
def test_a_dtype_name_from_another_module_is_refused() -> None:
    for data in (b"cbuiltins\nfloat32\n.", b"ccollections\nSize\n."):
        with pytest.raises(UnsafeMetadataError, match="not allowed"):
            fmt.load_metadata(data, ".metadata")


@pytest.mark.spec("STORE-26", "FMT-9", "REF-1")
def test_every_non_empty_chunk_needs_a_record_and_empty_ones_do_not() -> None:
    from refdcp.storage import MalformedMetadataError

    ok = _md({_idx("w", 0): _rec()}, w=((2,), [((0,), (2,))]), e=((0,), [((0,), (0,))]))
    assert set(fmt.load_metadata(fmt.dump_metadata(ok), "m").state_dict_metadata) == {"w", "e"}
    # an empty chunk listed first does not excuse the non-empty one after it
    bad = _md({}, w=((3,), [((0,), (0,)), ((0,), (3,))]))
    with pytest.raises(MalformedMetadataError, match="no storage record"):
        fmt.load_metadata(fmt.dump_metadata(bad), "m")
    with pytest.raises(MalformedMetadataError, match="no storage record"):
        fmt.load_metadata(fmt.dump_metadata(_md({}, w=((2,), [((0,), (2,))]))), "m")


@pytest.mark.spec("STORE-26", "FMT-9", "REF-1")
@pytest.mark.parametrize(
    "name",
    ["", ".", "..", "a/b", "a\\b", "a\0b", "x" * 256, 5, None],
    ids=["empty", "dot", "dotdot", "slash", "backslash", "nul", "long", "int", "none"],
)
def test_a_record_must_name_a_plain_file(name: Any) -> None:
    from refdcp.storage import UnsafePathError

    md = _md({_idx("w", 0): _rec(name)}, w=((2,), [((0,), (2,))]))
    with pytest.raises(UnsafePathError):
        fmt.load_metadata(fmt.dump_metadata(md), "m")
    fine = _md({_idx("w", 0): _rec("x" * 255)}, w=((2,), [((0,), (2,))]))
    fmt.load_metadata(fmt.dump_metadata(fine), "m")


@pytest.mark.spec("STORE-26", "FMT-29", "REF-1")
def test_records_need_non_negative_ranges_that_share_no_byte() -> None:
    from refdcp.storage import MalformedMetadataError

    two = {"w": ((4,), [((0,), (2,)), ((2,), (2,))])}
    for off, length in ((-1, 8), (0, -1), (0.0, 8), (0, True)):
        md = _md(
            {_idx("w", 0): _rec(offset=off, length=length), _idx("w", 2): _rec(offset=100)}, **two
        )
        with pytest.raises(MalformedMetadataError):
            fmt.load_metadata(fmt.dump_metadata(md), "m")
    apart = _md({_idx("w", 0): _rec(offset=0, length=8), _idx("w", 2): _rec(offset=8)}, **two)
    fmt.load_metadata(fmt.dump_metadata(apart), "m")
    shared = _md({_idx("w", 0): _rec(offset=0, length=8), _idx("w", 2): _rec(offset=7)}, **two)
    with pytest.raises(MalformedMetadataError, match="share bytes"):
        fmt.load_metadata(fmt.dump_metadata(shared), "m")
