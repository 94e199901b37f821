"""``read_once="auto"`` (ONCE-9): read once where the ranks share the storage's bandwidth."""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as tdcp
from hypothesis import given
from hypothesis import strategies as st

import refdcp
from refdcp.comm import FakeWorld
from refdcp.storage.fs import mounts
from refdcp.storage.fs.mounts import SHARED_FS_TYPES, fs_type_of, parse_mountinfo
from refdcp.storage.memory import MemoryReader, MemoryStorage
from refdcp.storage.shared import shared_storage
from refdcp.testing.storage_wrappers import CountingReader

SINGLE_PATH = "read_once='auto' (ONCE-9) picks where the default path reads once, a bandwidth knob"

warnings.filterwarnings("ignore", message="torch.distributed is disabled")

LOCAL_FS_TYPES = ("ext4", "xfs", "btrfs", "tmpfs", "overlay", "zfs", "9p", "virtiofs", "fuse")

# -- the mount table ----------------------------------------------------------------------

_NAMES = st.sampled_from(["a", "b", "ab", "c d", "e\\f", "g\th"])
_DIRS = st.lists(_NAMES, max_size=4).map(lambda parts: "/" + "/".join(parts))
_TYPES = st.sampled_from(sorted(SHARED_FS_TYPES)[:5] + list(LOCAL_FS_TYPES[:4]))


def _escape(path: str) -> str:
    return "".join(f"\\{ord(c):03o}" if c in " \t\n\\" else c for c in path)


def _model(path: str, table: list[tuple[str, str]]) -> str | None:
    """The mount at ``path``'s longest mount point, component by component; the last wins."""
    parts = [p for p in path.split("/") if p]
    best: tuple[int, str] | None = None
    for point, kind in table:
        pparts = [p for p in point.split("/") if p]
        if parts[: len(pparts)] == pparts and (best is None or len(pparts) >= best[0]):
            best = (len(pparts), kind)
    return None if best is None else best[1]


@pytest.mark.spec("ONCE-9")
@given(st.lists(st.tuples(_DIRS, _TYPES), min_size=1, max_size=6), _DIRS, st.booleans())
def test_the_type_of_a_path_is_that_of_its_longest_mount_point(
    table: list[tuple[str, str]], path: str, optional_fields: bool
) -> None:
    # the table as the kernel writes it (escaped names, optional fields before "-"), read back
    extra = " shared:1 master:2" if optional_fields else ""
    text = "\n".join(
        f"{i} 1 0:{i} / {_escape(point)} rw,relatime{extra} - {kind} src{i} rw"
        for i, (point, kind) in enumerate(table)
    )
    parsed = parse_mountinfo(text + "\nnot a mountinfo line\n")
    assert parsed == table
    assert fs_type_of(path, parsed) == _model(path, table)
    assert fs_type_of(path, []) is None


@pytest.mark.spec("ONCE-9")
def test_this_machines_mount_table_is_read() -> None:
    table = mounts.mount_table()
    assert any(point == "/" for point, _ in table)
    assert fs_type_of("/", table) is not None


# -- which readers read from shared storage ------------------------------------------------


def _mounted(monkeypatch: pytest.MonkeyPatch, where: Path, kind: str) -> None:
    real = os.path.realpath(where)
    monkeypatch.setattr(mounts, "mount_table", lambda: [("/", "ext4"), (real, kind)])


def _file_readers(path: Path) -> dict[str, Any]:
    return {
        "refdcp": refdcp.FileSystemReader(path),
        "torch": tdcp.FileSystemReader(path),
        "wrapped": CountingReader(CountingReader(refdcp.FileSystemReader(path))),
    }


@pytest.mark.spec("ONCE-9")
@pytest.mark.parametrize("kind", sorted(SHARED_FS_TYPES) + list(LOCAL_FS_TYPES))
def test_a_directory_is_shared_iff_its_file_system_is_a_network_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    _mounted(monkeypatch, tmp_path, kind)
    expect = kind if kind in SHARED_FS_TYPES else None
    for name, reader in _file_readers(tmp_path).items():
        assert shared_storage(reader) == expect, name
    # a directory beside the mount is on the root's file system
    other = tmp_path.parent / (tmp_path.name + "-beside")
    assert shared_storage(refdcp.FileSystemReader(other)) is None


@pytest.mark.spec("ONCE-9")
def test_urls_protocols_and_unknown_readers() -> None:
    def fsspec_like(protocol: Any, path: str) -> Any:
        return SimpleNamespace(fs=SimpleNamespace(fs=SimpleNamespace(protocol=protocol)), path=path)

    cases: list[tuple[Any, str | None]] = [
        (SimpleNamespace(path="s3://bucket/ckpt"), "s3"),
        (SimpleNamespace(path="GS://bucket/ckpt"), "gs"),
        (SimpleNamespace(path="az://c/ckpt"), "az"),
        (SimpleNamespace(path="file:///tmp/ckpt"), None),
        (fsspec_like(("s3", "s3a"), "bucket/ckpt"), "s3"),
        (fsspec_like("gcs", "bucket/ckpt"), "gcs"),
        (fsspec_like(("file", "local"), "/"), None),
        (fsspec_like(None, "/"), None),
        (SimpleNamespace(inner=SimpleNamespace(path="s3://b/c")), "s3"),
        (MemoryReader(MemoryStorage(), "ckpt"), None),
        (object(), None),
    ]
    for reader, expect in cases:
        assert shared_storage(reader) == expect, reader


@pytest.mark.spec("ONCE-9")
def test_torchs_fsspec_reader_on_a_local_directory_follows_its_mount(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fsspec_fs = pytest.importorskip("torch.distributed.checkpoint._fsspec_filesystem")
    reader = fsspec_fs.FsspecReader(str(tmp_path))
    assert shared_storage(reader) is None
    _mounted(monkeypatch, tmp_path, "lustre")
    assert shared_storage(reader) == "lustre"


# -- the default load ----------------------------------------------------------------------


class _DeviceComm:
    """A FakeWorld communicator that says its bytes move through a device, as NCCL's do."""

    device = torch.device("meta")

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def _replicated(fill: bool) -> dict[str, Any]:
    make = torch.arange if fill else torch.zeros
    return {
        "w": make(4096, dtype=torch.float32).reshape(64, 64),
        "b": make(512, dtype=torch.int64),
        "step": 7 if fill else 0,
    }


def _bytes_read(path: Path, world: int, device: bool = False, **kw: Any) -> list[int]:
    def rank(comm: Any) -> int:
        sd = _replicated(False)
        reader = CountingReader(refdcp.FileSystemReader(path))
        c = _DeviceComm(comm) if device else comm
        refdcp.load(sd, storage_reader=reader, comm=c, **kw)
        want = _replicated(True)
        assert torch.equal(sd["w"], want["w"]) and torch.equal(sd["b"], want["b"])
        assert sd["step"] == 7
        return reader.bytes_read

    return list(FakeWorld(world).run(rank))


@pytest.mark.spec("ONCE-9", "ONCE-6", "ONCE-7")
@pytest.mark.parametrize("world", [2, 3])
def test_the_default_reads_once_on_shared_storage_and_n_times_on_a_local_disk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, world: int
) -> None:
    refdcp.save(_replicated(True), checkpoint_id=tmp_path, no_dist=True)
    once = sum(_bytes_read(tmp_path, world, read_once=True))
    every = _bytes_read(tmp_path, world, read_once=False)
    assert every == [every[0]] * world and once == every[0] > 0

    # a local disk (this machine's): the default reads on every rank
    assert _bytes_read(tmp_path, world) == every
    for kind in ("nfs4", "lustre", "fuse.mountpoint-s3"):
        _mounted(monkeypatch, tmp_path, kind)
        assert sum(_bytes_read(tmp_path, world)) == once, kind  # the default: once
        assert sum(_bytes_read(tmp_path, world, read_once="auto")) == once, kind
        assert _bytes_read(tmp_path, world, read_once=False) == every, kind  # forced off
        assert _bytes_read(tmp_path, world, device=True) == every, kind  # NCCL: off
    for kind in ("ext4", "tmpfs"):
        _mounted(monkeypatch, tmp_path, kind)
        assert _bytes_read(tmp_path, world) == every, kind
        assert sum(_bytes_read(tmp_path, world, read_once=True)) == once, kind  # forced on


@pytest.mark.spec("ONCE-9", "ONCE-6")
def test_one_rank_on_local_storage_gives_every_rank_a_plain_load(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    refdcp.save(_replicated(True), checkpoint_id=tmp_path, no_dist=True)
    every = _bytes_read(tmp_path, 2, read_once=False)
    _mounted(monkeypatch, tmp_path, "nfs4")

    def rank(comm: Any) -> int:
        sd = _replicated(False)
        reader = CountingReader(refdcp.FileSystemReader(tmp_path))
        refdcp.load(sd, storage_reader=reader, comm=_DeviceComm(comm) if comm.rank else comm)
        assert torch.equal(sd["w"], _replicated(True)["w"])
        return reader.bytes_read

    assert list(FakeWorld(2).run(rank)) == every
