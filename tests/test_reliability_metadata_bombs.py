"""Memory bombs and malformed fields in ``.metadata`` (issue 11, item 3; FMT-9..FMT-11).

A 1 MB ``.metadata`` (one 1 MiB string referenced 2,000 times through an
allowed ``PosixPath``) drove load, verify and torch's load past 6 GB, and a
3 GiB sparse ``.metadata`` was read whole. Now: the file size is checked
before reading, every constructor that copies memoized data is charged
against a budget proportional to the file size, strings are capped, and
every field is type-checked with an error naming it.
"""

from __future__ import annotations

import os
import pathlib
import re
import struct
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

import refdcp
from refdcp.errors import CheckpointError
from refdcp.storage import FileSystemReader, UnsafeMetadataError
from refdcp.storage.metadata.safe import dump_metadata, load_metadata
from refdcp.storage.verify import MetadataUnreadableError, verify_checkpoint
from refdcp.tools.inspect import inspect_command

warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def _sd() -> dict[str, Any]:
    return {"model.weight": torch.ones(4, 4), "step": 1}


def _empty() -> dict[str, Any]:
    return {"model.weight": torch.zeros(4, 4), "step": 0}


def _ckpt(impl: ModuleType, root: Path) -> Path:
    path = root / "ckpt"
    impl.save(_sd(), checkpoint_id=path)
    return path


def _md(path: Path) -> Metadata:
    return load_metadata((path / ".metadata").read_bytes())


class _PathBomb:
    """Pickles as ``PosixPath(s, s, ..., s)``: ``s`` is written once, referenced ``n`` times."""

    def __init__(self, s: str, n: int) -> None:
        self.s, self.n = s, n

    def __reduce__(self) -> tuple[Any, ...]:
        return (pathlib.PosixPath, (self.s,) * self.n)


class _SizeBomb:
    """Pickles as ``torch.Size(t)`` with one memoized tuple ``t``."""

    def __init__(self, t: tuple[int, ...]) -> None:
        self.t = t

    def __reduce__(self) -> tuple[Any, ...]:
        return (torch.Size, (self.t,))


_ENTRY_POINTS: dict[str, Callable[[Path], Any]] = {
    "load": lambda p: refdcp.load(_empty(), checkpoint_id=p),
    "load_verify": lambda p: refdcp.load(_empty(), checkpoint_id=p, verify=True),
    "torch_load": lambda p: dcp.load(_empty(), storage_reader=FileSystemReader(p), no_dist=True),
}


def _refused(path: Path, match: str) -> None:
    for entry in _ENTRY_POINTS.values():
        with pytest.raises(BaseException, match=match):
            entry(path)
    try:
        report = verify_checkpoint(path)
    except MetadataUnreadableError as exc:  # over the size cap: nothing could be checked
        assert re.search(match, str(exc))
    else:
        assert not report.ok and re.search(match, report.problems[0].message)
    assert inspect_command(str(path), as_json=True) == 2


@pytest.mark.spec("FMT-11", "FMT-10")
@pytest.mark.parametrize("count", [64, 2000])
def test_a_string_referenced_thousands_of_times_through_a_path_is_refused(
    tmp_path: Path, count: int, impl: ModuleType
) -> None:
    path = _ckpt(impl, tmp_path)
    md = _md(path)
    md.storage_meta = StorageMeta(checkpoint_id=_PathBomb("x" * (1 << 20), count))  # type: ignore[arg-type]
    blob = dump_metadata(md)
    assert len(blob) < 2 << 20  # a ~1 MB file that would build a 64 MiB .. 2 GiB string
    (path / ".metadata").write_bytes(blob)
    t0 = time.perf_counter()
    _refused(path, "builds a path of")
    assert time.perf_counter() - t0 < 120  # refused, not built (a generous bound; no timing claim)


@pytest.mark.spec("FMT-11")
def test_sizes_copied_from_one_memoized_tuple_are_refused(tmp_path: Path, impl: ModuleType) -> None:
    path = _ckpt(impl, tmp_path)
    md = _md(path)
    shared = tuple(range(200))
    md.planner_data = [_SizeBomb(shared) for _ in range(20_000)]  # 4M ints from ~120 kB
    (path / ".metadata").write_bytes(dump_metadata(md))
    _refused(path, "memory bomb")


def _build_bomb(keys: int, objects: int) -> bytes:
    """Raw pickle: ``objects`` DCP objects, each BUILD with one memoized ``keys``-entry dict."""
    out = bytearray(b"\x80\x04")
    out += b"ctorch.distributed.checkpoint.metadata\nBytesStorageMetadata\nq\x00"
    out += b"}("
    for k in range(keys):
        key = f"k{k}".encode()
        out += b"X" + struct.pack("<I", len(key)) + key + b"K\x01"
    out += b"uq\x01"
    out += b"]("
    for _ in range(objects):
        out += b"h\x00)\x81h\x01b"  # BINGET cls, EMPTY_TUPLE, NEWOBJ, BINGET state, BUILD
    out += b"e."
    return bytes(out)


@pytest.mark.spec("FMT-11")
def test_a_state_dict_built_into_many_objects_is_refused() -> None:
    blob = _build_bomb(5_000, 1_000)  # 5M dict entries from ~60 kB
    with pytest.raises(UnsafeMetadataError, match="memory bomb"):
        load_metadata(blob)


@pytest.mark.spec("FMT-10")
def test_a_huge_sparse_metadata_is_refused_unread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, impl: ModuleType
) -> None:
    path = _ckpt(impl, tmp_path)
    with open(path / ".metadata", "r+b") as f:
        f.truncate(3 << 30)  # 3 GiB, sparse
    read = 0
    real = os.read

    def spy(fd: int, n: int) -> bytes:
        nonlocal read
        data = real(fd, n)
        read += len(data)
        return data

    monkeypatch.setattr(os, "read", spy)
    _refused(path, "over the metadata size limit")
    assert read == 0


@pytest.mark.spec("FMT-10")
def test_limits_are_configurable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # single path: FMT-10's configurable limits are the fast reader's (REF-8)
    from refdcp.storage.metadata.limits import set_metadata_limits

    path = _ckpt(refdcp, tmp_path)
    size = (path / ".metadata").stat().st_size
    previous = set_metadata_limits(max_file_bytes=size - 1)
    try:
        with pytest.raises(BaseException, match="over the metadata size limit"):
            refdcp.load(_empty(), checkpoint_id=path)
    finally:
        set_metadata_limits(previous)
    set_metadata_limits()
    long_key = "model." + "w" * 300
    refdcp.save({long_key: torch.ones(2)}, checkpoint_id=tmp_path / "long")
    monkeypatch.setenv("REFDCP_MAX_METADATA_STRING", "250")
    with pytest.raises(BaseException, match=r"state_dict_metadata\['model.www.*over the limit"):
        refdcp.load({long_key: torch.zeros(2)}, checkpoint_id=tmp_path / "long")
    monkeypatch.delenv("REFDCP_MAX_METADATA_STRING")
    out = {long_key: torch.zeros(2)}
    refdcp.load(out, checkpoint_id=tmp_path / "long")
    assert torch.equal(out[long_key], torch.ones(2))


def _drop(name: str) -> Callable[[Metadata], None]:
    return lambda md: md.__dict__.pop(name)


def _chunk_sizes_list(md: Metadata) -> None:
    md.state_dict_metadata["model.weight"].chunks[0].sizes = [4, 4]  # type: ignore[assignment, union-attr]


def _info(md: Metadata) -> Any:
    return next(i for k, i in md.storage_data.items() if k.fqn == "model.weight")


_MUTATIONS: dict[str, tuple[Callable[[Metadata], None], str]] = {
    "no state_dict_metadata": (_drop("state_dict_metadata"), r"state_dict_metadata: missing"),
    "chunk sizes a list": (_chunk_sizes_list, r"chunks\[0\]\.sizes: expected a torch.Size"),
    "storage offset a str": (
        lambda md: setattr(_info(md), "offset", "0"),
        r"storage_data\['model.weight'\]\.offset: expected a non-negative int",
    ),
    "negative length": (
        lambda md: setattr(_info(md), "length", -5),
        r"\.length: expected a non-negative int",
    ),
    "version an int": (lambda md: setattr(md, "version", 5), r"version: expected a str"),
    "state_dict_metadata a list": (
        lambda md: setattr(md, "state_dict_metadata", []),
        r"state_dict_metadata: expected a dict",
    ),
    "entry a StorageMeta": (
        lambda md: md.state_dict_metadata.__setitem__("x", StorageMeta()),  # type: ignore[arg-type]
        r"state_dict_metadata\['x'\]: expected TensorStorageMetadata",
    ),
    "chunk outside the tensor": (
        lambda md: setattr(
            md.state_dict_metadata["model.weight"].chunks[0], "offsets", torch.Size([3, 0])
        ),
        r"chunks\[0\]: offsets \[3, 0\] \+ sizes \[4, 4\] exceed",
    ),
}


@pytest.mark.spec("FMT-9")
@pytest.mark.parametrize("case", sorted(_MUTATIONS))
def test_every_field_is_type_checked_and_named(tmp_path: Path, case: str, impl: ModuleType) -> None:
    from refdcp.storage.errors import FormatVersionError, MalformedMetadataError

    path = _ckpt(impl, tmp_path)
    md = _md(path)
    mutate, match = _MUTATIONS[case]
    mutate(md)
    (path / ".metadata").write_bytes(dump_metadata(md))
    with pytest.raises(MalformedMetadataError, match=match):
        load_metadata((path / ".metadata").read_bytes())
    if impl is refdcp:  # the fast reader's messages (FMT-9)
        with pytest.raises(BaseException, match=match):
            impl.load(_empty(), checkpoint_id=path)
        return
    with pytest.raises(CheckpointError) as info:  # the reference: refused, named, before reading
        impl.load(_empty(), checkpoint_id=path)
    (failure,) = info.value.rank_failures.values()
    assert info.value.step == "set_up"
    assert isinstance(failure.exception, (MalformedMetadataError, FormatVersionError))


def _big_metadata(n: int) -> Metadata:
    sdm: dict[str, Any] = {}
    storage: dict[Any, Any] = {}
    for i in range(n):
        fqn = f"model.layers.{i}.mlp.down_proj.weight"
        sdm[fqn] = TensorStorageMetadata(
            TensorProperties(dtype=torch.bfloat16),
            torch.Size([4096, 1024]),
            [ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([4096, 1024]))],
        )
        info = _StorageInfo(f"__{i % 64}_0.0123456789ab.distcp", i * 4096, 4096)
        info.refdcp_crc32c = i  # type: ignore[attr-defined]
        info.refdcp_data_offset = 64  # type: ignore[attr-defined]
        storage[MetadataIndex(fqn, torch.Size([0, 0]), 0)] = info
    return Metadata(
        sdm,
        planner_data={k: (k,) for k in sdm},
        storage_data=storage,
        storage_meta=StorageMeta(Path("/ckpt/run-1/step-1000"), "0123456789ab"),
        version="1.0.0",
    )


@pytest.mark.spec("FMT-10", "FMT-11")
def test_defaults_admit_a_real_checkpoint_fast() -> None:
    md = load_metadata(dump_metadata(_big_metadata(10_000)))
    assert len(md.state_dict_metadata) == 10_000
    assert type(next(iter(md.storage_data))) is MetadataIndex


@pytest.mark.slow
@pytest.mark.spec("FMT-10", "FMT-11")
def test_defaults_admit_a_checkpoint_of_100k_items() -> None:
    md = load_metadata(dump_metadata(_big_metadata(100_000)))
    assert len(md.state_dict_metadata) == 100_000
    assert all(type(i) is _StorageInfo for i in md.storage_data.values())
