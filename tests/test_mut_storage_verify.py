"""Offline verification reports every problem with fqn, file and offset (INTEG-6, STORE-28; issue 13)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

import refdcp
from refdcp.storage.errors import UnsafePathError
from refdcp.storage.metadata.safe import dump_metadata, load_metadata
from refdcp.storage.verify import (
    MetadataUnreadableError,
    Problem,
    verify_checkpoint,
    verify_files,
    verify_ranges,
)

SINGLE_PATH = "mutation-kill tests pinning one module of the default path (tests/MUTATION.md); the behaviour runs on both in the shared suites"

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _save(path: Path) -> dict[str, Any]:
    sd = {"a": torch.arange(16.0), "b": torch.arange(8), "c": torch.ones(2, 3), "step": 5}
    refdcp.save(sd, checkpoint_id=path)
    return sd


def _files(path: Path) -> dict[str, bytes]:
    return {n: (path / n).read_bytes() for n in os.listdir(path)}


def _md(path: Path) -> Any:
    return load_metadata((path / ".metadata").read_bytes())


@pytest.mark.spec("INTEG-6")
def test_an_intact_checkpoint_is_ok_and_counts_every_item(tmp_path: Path) -> None:
    _save(tmp_path)
    n = len(_md(tmp_path).storage_data)
    report = verify_checkpoint(tmp_path)
    assert report.ok and report.items_checked == n and report.items_without_checksum == 0
    j = report.to_json()
    assert j == {
        "path": str(tmp_path),
        "ok": True,
        "items_checked": n,
        "items_without_checksum": 0,
        "problems": [],
    }
    files = _files(tmp_path)
    same = verify_files(files[".metadata"], files.get, str(tmp_path))
    assert same.ok and same.items_checked == n


@pytest.mark.spec("INTEG-6")
def test_a_torch_checkpoint_has_items_without_checksum(tmp_path: Path) -> None:
    dcp.save({"a": torch.ones(3), "b": torch.zeros(2)}, checkpoint_id=tmp_path, no_dist=True)
    report = verify_checkpoint(tmp_path)
    assert report.ok and report.items_checked == 0 and report.items_without_checksum == 2


@pytest.mark.spec("INTEG-6")
def test_every_damaged_item_of_a_file_is_reported_with_its_offset(tmp_path: Path) -> None:
    _save(tmp_path)
    md = _md(tmp_path)
    infos = {k.fqn: i for k, i in md.storage_data.items()}
    name = infos["a"].relative_path
    raw = bytearray((tmp_path / name).read_bytes())
    for fqn in ("a", "c"):
        if infos[fqn].relative_path == name:
            raw[infos[fqn].offset + infos[fqn].length - 1] ^= 1
    (tmp_path / name).write_bytes(bytes(raw))
    report = verify_checkpoint(tmp_path)
    bad = {p.fqn: p for p in report.problems}
    assert "a" in bad and bad["a"].file == name and bad["a"].offset == infos["a"].offset
    assert "checksum mismatch" in bad["a"].message
    assert not report.ok and report.to_json()["ok"] is False
    assert report.items_checked == len(infos) - len(report.problems)


@pytest.mark.spec("STORE-28")
def test_a_truncated_file_reports_each_item_past_the_cut(tmp_path: Path) -> None:
    _save(tmp_path)
    md = _md(tmp_path)
    by_file: dict[str, list[Any]] = {}
    for k, i in md.storage_data.items():
        by_file.setdefault(i.relative_path, []).append((i.offset, k.fqn, i))
    name, items = max(by_file.items(), key=lambda kv: len(kv[1]))
    items.sort(key=lambda t: t[0])
    cut = items[-1][0] + 1  # inside the last item
    data = (tmp_path / name).read_bytes()
    (tmp_path / name).write_bytes(data[:cut])
    report = verify_checkpoint(tmp_path)
    assert [p.fqn for p in report.problems] == [items[-1][1]]
    assert "truncated" in report.problems[0].message
    (tmp_path / name).write_bytes(data[: items[0][0]])  # every item of the file is past the end
    before = len(os.listdir("/proc/self/fd"))
    report = verify_checkpoint(tmp_path)
    assert sorted(str(p.fqn) for p in report.problems) == sorted(str(t[1]) for t in items)
    assert all("truncated: 0 of" in p.message for p in report.problems), report.problems
    assert len(os.listdir("/proc/self/fd")) == before  # every data file it opened is closed


@pytest.mark.spec("INTEG-6")
def test_a_missing_data_file_is_reported_for_each_of_its_items(tmp_path: Path) -> None:
    _save(tmp_path)
    md = _md(tmp_path)
    name = next(iter(md.storage_data.values())).relative_path
    fqns = sorted(k.fqn for k, i in md.storage_data.items() if i.relative_path == name)
    (tmp_path / name).unlink()
    report = verify_checkpoint(tmp_path)
    assert sorted(p.fqn for p in report.problems if p.file == name) == fqns
    assert all(p.message == "data file missing" for p in report.problems)


@pytest.mark.spec("STORE-28", "STORE-26")
def test_unsafe_names_and_unreadable_files_are_reported_per_item(tmp_path: Path) -> None:
    _save(tmp_path)
    files = _files(tmp_path)
    md = _md(tmp_path)
    name = next(iter(md.storage_data.values())).relative_path
    fqns = sorted(k.fqn for k, i in md.storage_data.items() if i.relative_path == name)

    def refused(n: str, offset: int, length: int) -> bytes | None:
        if n == name:
            raise UnsafePathError(f"{n}: refused")
        return files.get(n, b"")[offset : offset + length]

    report = verify_ranges(files[".metadata"], refused, "x")
    assert sorted(p.fqn for p in report.problems) == fqns
    assert all(p.message == f"{name}: refused" and p.file == name for p in report.problems)

    def broken(n: str, offset: int, length: int) -> bytes | None:
        if n == name:
            raise PermissionError(13, "Permission denied")
        return files.get(n, b"")[offset : offset + length]

    report = verify_ranges(files[".metadata"], broken, "x")
    assert sorted(p.fqn for p in report.problems) == fqns
    assert all("cannot be read: Permission denied" in p.message for p in report.problems)


@pytest.mark.spec("INTEG-6")
def test_metadata_problems(tmp_path: Path) -> None:
    _save(tmp_path)
    files = _files(tmp_path)
    report = verify_ranges(None, lambda *a: None, "x")
    assert report.problems == [Problem(None, ".metadata", 0, "no .metadata: not committed")]
    bad = bytearray(files[".metadata"])
    bad[10] ^= 1
    report = verify_ranges(bytes(bad), lambda *a: None, "x")
    assert len(report.problems) == 1 and report.problems[0].fqn is None
    assert "metadata checksum mismatch" in report.problems[0].message
    md = _md(tmp_path)
    md.version = "9.9"
    report = verify_ranges(dump_metadata(md), lambda *a: None, "x")
    assert "not supported" in report.problems[0].message and len(report.problems) == 1


@pytest.mark.spec("INTEG-6")
def test_an_item_without_a_storage_location_is_reported(tmp_path: Path) -> None:
    _save(tmp_path)
    md = _md(tmp_path)
    for k in [k for k in md.storage_data if k.fqn in ("b", "step")]:
        del md.storage_data[k]
    (tmp_path / ".metadata").write_bytes(dump_metadata(md))
    report = verify_checkpoint(tmp_path)
    assert sorted(p.fqn for p in report.problems) == ["b", "step"]
    assert all(
        p.message == "no storage location" and p.file == ".metadata" for p in report.problems
    )
    assert all(p.offset == 0 for p in report.problems)


@pytest.mark.spec("INTEG-6")
def test_a_tensor_with_one_chunk_of_two_unlocated_is_reported(tmp_path: Path) -> None:
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    _save(tmp_path)
    md = _md(tmp_path)
    md.state_dict_metadata["a"].chunks = [  # type: ignore[union-attr]
        ChunkStorageMetadata(torch.Size([0]), torch.Size([8])),
        ChunkStorageMetadata(torch.Size([8]), torch.Size([8])),
    ]
    md.state_dict_metadata["c"].chunks = []  # type: ignore[union-attr]
    (tmp_path / ".metadata").write_bytes(dump_metadata(md))
    report = verify_checkpoint(tmp_path)
    located = [(p.fqn, p.message) for p in report.problems if "do not tile" not in p.message]
    assert located == [("a", "no storage location")]  # 'c' (no chunks) is a tiling problem


@pytest.mark.spec("INTEG-6")
def test_a_directory_that_is_not_a_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(MetadataUnreadableError, match="not a checkpoint directory"):
        verify_checkpoint(tmp_path / "missing")
    report = verify_checkpoint(tmp_path)
    assert not report.ok and report.problems[0].message == "no .metadata: not committed"
    (tmp_path / ".metadata").mkdir()
    with pytest.raises(MetadataUnreadableError):
        verify_checkpoint(tmp_path)
