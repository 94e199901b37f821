"""Data-file paths from an untrusted ``.metadata`` (issue 11, item 2; STORE-26..28, INTEG-8).

A crafted ``.metadata`` naming ``../x``, ``/abs/x``, a FIFO or ``/dev/zero``
made load, load(verify=True), torch's load with refdcp's reader and
``refdcp verify`` read outside files (verify printed OK), hang, or read until
memory ran out. Each is now refused, naming the item and the file.
"""

from __future__ import annotations

import os
import threading
import warnings
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

import refdcp
from refdcp.storage import FileSystemReader
from refdcp.storage.metadata.safe import dump_metadata, load_metadata
from refdcp.storage.verify import verify_checkpoint
from refdcp.tools.verify import verify_command

warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def _sd() -> dict[str, Any]:
    return {"w": torch.arange(64, dtype=torch.float32).reshape(8, 8), "step": 3}


def _empty() -> dict[str, Any]:
    return {"w": torch.zeros(8, 8), "step": 0}


def _ckpt(impl: ModuleType, root: Path) -> Path:
    path = root / "ckpt"
    impl.save(_sd(), checkpoint_id=path)
    return path


def _point_items_at(path: Path, name: str) -> None:
    """Rewrite .metadata so every item's data file is ``name`` (offsets and checksums kept)."""
    md = load_metadata((path / ".metadata").read_bytes())
    for info in md.storage_data.values():
        info.relative_path = name
    (path / ".metadata").write_bytes(dump_metadata(md))


def _outside_copy(path: Path, target: Path) -> None:
    """An outside file with exactly the checkpoint's bytes: reading it would 'succeed'."""
    (data,) = [n for n in os.listdir(path) if n.endswith(".distcp")]
    target.write_bytes((path / data).read_bytes())


_LOADERS: dict[str, Callable[[Path], Any]] = {
    "load": lambda p: refdcp.load(_empty(), checkpoint_id=p),
    "load_verify": lambda p: refdcp.load(_empty(), checkpoint_id=p, verify=True),
    "torch_load": lambda p: dcp.load(_empty(), storage_reader=FileSystemReader(p), no_dist=True),
}


def _names(tmp_path: Path) -> dict[str, str]:
    return {
        "parent": "../outside.distcp",
        "nested": "sub/../../outside.distcp",
        "absolute": str(tmp_path / "outside.distcp"),
        "dev_zero": "/dev/zero",
    }


@pytest.mark.spec("STORE-26")
@pytest.mark.parametrize("loader", sorted(_LOADERS))
@pytest.mark.parametrize("kind", ["parent", "nested", "absolute", "dev_zero"])
def test_paths_outside_the_checkpoint_are_refused(
    tmp_path: Path, loader: str, kind: str, impl: ModuleType
) -> None:
    path = _ckpt(impl, tmp_path)
    _outside_copy(path, tmp_path / "outside.distcp")
    _point_items_at(path, _names(tmp_path)[kind])
    with pytest.raises(BaseException, match="not a plain file name"):
        _LOADERS[loader](path)


@pytest.mark.spec("STORE-26", "INTEG-8")
@pytest.mark.parametrize("kind", ["parent", "nested", "absolute", "dev_zero"])
def test_verify_reports_paths_outside_the_checkpoint(
    tmp_path: Path, kind: str, capsys: pytest.CaptureFixture[str], impl: ModuleType
) -> None:
    path = _ckpt(impl, tmp_path)
    _outside_copy(path, tmp_path / "outside.distcp")
    _point_items_at(path, _names(tmp_path)[kind])
    report = verify_checkpoint(path)
    assert not report.ok
    assert report.items_checked == 0
    assert "not a plain file name" in report.problems[0].message
    assert verify_command(str(path), json=False) == 1
    assert "OK" not in capsys.readouterr().out.split(":")[0]


def _make_special(path: Path, kind: str) -> str:
    name = "__0_0.0123456789ab.distcp"
    target = path / name
    if kind == "fifo":
        os.mkfifo(target)
    elif kind == "symlink_dev_zero":
        os.symlink("/dev/zero", target)
    elif kind == "symlink_outside":
        os.symlink(path.parent / "outside.distcp", target)
    elif kind == "directory":
        target.mkdir()
    return name


def _run_bounded(fn: Callable[[], Any], path: Path, seconds: float = 60) -> BaseException | None:
    """Run ``fn`` in a thread; a FIFO open that blocks is released by opening it for writing."""
    outcome: list[BaseException | None] = []

    def target() -> None:
        try:
            fn()
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(seconds)
    if t.is_alive():
        fifo = path / "__0_0.0123456789ab.distcp"
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)  # unblock the reader, then fail
        os.close(fd)
        t.join(10)
        raise AssertionError(f"{fn} blocked on a FIFO for {seconds} s")
    return outcome[0]


@pytest.mark.spec("STORE-27", "INTEG-8")
@pytest.mark.parametrize("kind", ["fifo", "symlink_dev_zero", "symlink_outside", "directory"])
def test_non_regular_data_files_are_refused(tmp_path: Path, kind: str, impl: ModuleType) -> None:
    path = _ckpt(impl, tmp_path)
    _outside_copy(path, tmp_path / "outside.distcp")
    name = _make_special(path, kind)
    _point_items_at(path, name)
    for loader in _LOADERS.values():
        err = _run_bounded(lambda loader=loader: loader(path), path, 20)
        assert err is not None and (
            "not a regular file" in str(err) or "symbolic link" in str(err)
        ), err
    report_box: list[Any] = []
    assert _run_bounded(lambda: report_box.append(verify_checkpoint(path)), path, 20) is None
    report = report_box[0]
    assert not report.ok
    assert all(
        "not a regular file" in p.message or "symbolic link" in p.message for p in report.problems
    )
    assert not any(p.message == "data file missing" for p in report.problems)


@pytest.mark.spec("STORE-28")
def test_verify_reads_only_the_stated_range(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, impl: ModuleType
) -> None:
    """A data file far larger than its items: verify reads the items' bytes, not the file."""
    path = _ckpt(impl, tmp_path)
    (data,) = [n for n in os.listdir(path) if n.endswith(".distcp")]
    with open(path / data, "r+b") as f:
        f.truncate(8 << 30)  # 8 GiB, sparse
    read = 0
    real = os.preadv

    def spy(fd: int, buffers: list[Any], offset: int) -> int:
        nonlocal read
        n = real(fd, buffers, offset)
        read += n
        return n

    monkeypatch.setattr(os, "preadv", spy)
    report = verify_checkpoint(path)
    assert report.ok, report.problems
    assert 0 < read < 1 << 20


@pytest.mark.spec("STORE-28")
def test_a_chunk_larger_than_its_item_is_refused_before_allocating(
    tmp_path: Path, impl: ModuleType
) -> None:
    path = _ckpt(impl, tmp_path)
    md = load_metadata((path / ".metadata").read_bytes())
    for info in md.storage_data.values():
        if getattr(info, "refdcp_data_offset", None) is not None:
            info.length = info.refdcp_data_offset + 16  # the chunk needs 256 bytes
    (path / ".metadata").write_bytes(dump_metadata(md))
    # the reference refuses the item by its checksum instead of by the shape (see REF-8)
    match = r"needs .* bytes but the item is" if impl is refdcp else "checksum mismatch"
    with pytest.raises(BaseException, match=match):
        impl.load(_empty(), checkpoint_id=path)


@pytest.mark.spec("STORE-26")
def test_plain_names_still_load(tmp_path: Path, impl: ModuleType) -> None:
    path = _ckpt(impl, tmp_path)
    out = _empty()
    impl.load(out, checkpoint_id=path, verify=True)
    assert torch.equal(out["w"], _sd()["w"]) and out["step"] == 3
