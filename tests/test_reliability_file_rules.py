"""One file-opening rule, clean-up that honours every committed metadata, and the save-side
refusals and commit status of issue 26 (STORE-56, STORE-33, TOOL-29, SAVE-17, SAVE-16)."""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
import warnings
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.storage import WriteResult

import refdcp
from refdcp.errors import CheckpointError
from refdcp.storage import FileSystemWriter, UnsafePathError
from refdcp.storage.errors import CorruptionError
from refdcp.storage.fs.lock import live_lock_tokens
from refdcp.storage.metadata.safe import dump_metadata, load_metadata
from refdcp.tools.cli import main as cli_main
from refdcp.tools.convert import convert

warnings.filterwarnings("ignore", message="torch.distributed is not initialized")


def _sd(v: float = 1.0) -> dict[str, Any]:
    return {"w": torch.full((4,), v), "cfg": {"lr": v}}


def _failure(err: CheckpointError) -> BaseException:
    (failure,) = err.rank_failures.values()
    return failure.exception


# -- lock files: no link followed, no FIFO blocks (STORE-56) -------------------------------


@pytest.mark.spec("STORE-56")
def test_a_planted_lock_symlink_is_refused_and_its_target_untouched(tmp_path: Path) -> None:
    # single path: the reference takes no directory lock (REF-8)
    root = tmp_path / "ckpt"
    root.mkdir()
    outside = tmp_path / "precious.txt"
    outside.write_text("keep me")
    os.symlink(outside, root / ".metadata.lock")
    with pytest.raises(CheckpointError) as err:
        refdcp.save(_sd(), checkpoint_id=root)
    assert isinstance(_failure(err.value), UnsafePathError)
    assert ".metadata.lock" in str(_failure(err.value))
    assert outside.read_text() == "keep me"
    assert sorted(p.name for p in root.iterdir()) == [".metadata.lock"]  # nothing written


def _returns_within(fn: Any, seconds: float) -> bool:
    done = threading.Event()

    def run() -> None:
        fn()
        done.set()

    threading.Thread(target=run, daemon=True).start()
    return done.wait(seconds)


@pytest.mark.spec("STORE-56")
def test_a_fifo_named_like_a_lock_never_blocks_a_save(tmp_path: Path, impl: ModuleType) -> None:
    root = tmp_path / "ckpt"
    root.mkdir()
    fifo = root / "x.lock"
    os.mkfifo(fifo)
    try:
        assert _returns_within(lambda: impl.save(_sd(), checkpoint_id=root), 60.0)
        assert _returns_within(lambda: impl.save(_sd(2.0), checkpoint_id=root), 60.0)
        assert live_lock_tokens(root) == set()
        dest = _sd(0.0)
        impl.load(dest, checkpoint_id=root)
        assert torch.equal(dest["w"], torch.full((4,), 2.0))
    finally:
        # release a scan blocked on the FIFO (the code before STORE-56), so no thread is left
        try:
            fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
            os.close(fd)
        except OSError:
            pass


@pytest.mark.spec("STORE-56")
def test_the_lock_scan_skips_links_and_fifos(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "a.lock")
    (tmp_path / "target").write_text("{}")
    os.symlink(tmp_path / "target", tmp_path / "b.lock")
    assert _returns_within(lambda: live_lock_tokens(tmp_path), 10.0)
    assert live_lock_tokens(tmp_path) == set()


# -- convert opens data files as loads do (TOOL-29) ---------------------------------------------


def _ckpt(impl: ModuleType, root: Path) -> tuple[Path, str]:
    md = impl.save({"w": torch.arange(8.0)}, checkpoint_id=root)
    (info,) = md.storage_data.values()
    return root, info.relative_path


@pytest.mark.spec("TOOL-29")
def test_convert_refuses_a_fifo_data_file_without_blocking(
    tmp_path: Path, impl: ModuleType
) -> None:
    root, name = _ckpt(impl, tmp_path / "ckpt")
    (root / name).unlink()
    os.mkfifo(root / name)
    got: list[BaseException] = []

    def run() -> None:
        try:
            convert(root, tmp_path / "out.pt")
        except BaseException as exc:
            got.append(exc)

    try:
        assert _returns_within(run, 60.0)
    finally:
        with contextlib.suppress(OSError):
            os.close(os.open(root / name, os.O_WRONLY | os.O_NONBLOCK))
    assert isinstance(got[0], UnsafePathError) and "FIFO" in str(got[0])
    assert not (tmp_path / "out.pt").exists()


@pytest.mark.spec("TOOL-29")
def test_convert_refuses_a_data_file_symlinked_outside(tmp_path: Path, impl: ModuleType) -> None:
    root, name = _ckpt(impl, tmp_path / "ckpt")
    outside = tmp_path / "outside.distcp"
    shutil.move(root / name, outside)
    os.symlink(outside, root / name)
    with pytest.raises(UnsafePathError, match="symbolic link"):
        convert(root, tmp_path / "out.pt")
    assert cli_main(["convert", str(root), str(tmp_path / "out2.pt")]) != 0


@pytest.mark.spec("TOOL-29")
def test_convert_checks_a_lying_length_before_allocating(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], impl: ModuleType
) -> None:
    root, name = _ckpt(impl, tmp_path / "ckpt")
    md = load_metadata((root / ".metadata").read_bytes(), file=".metadata")
    (info,) = md.storage_data.values()
    info.length = 1 << 40  # 1 TiB
    (root / ".metadata").write_bytes(dump_metadata(md))
    with pytest.raises(CorruptionError, match="item truncated") as err:
        convert(root, tmp_path / "out.pt")
    assert err.value.fqn == "w" and err.value.file == name
    assert cli_main(["convert", str(root), str(tmp_path / "out2.pt")]) == 1
    assert "item truncated" in capsys.readouterr().err


# -- a key a default load would refuse is refused at save (SAVE-17) --------------------------


@pytest.mark.spec("SAVE-17")
def test_a_key_over_the_load_string_cap_is_refused_at_local_plan(tmp_path: Path) -> None:
    # single path: the reference does not bound string lengths (REF-8, FMT-10)
    long_key = "k" * 100_000
    with pytest.raises(CheckpointError) as err:
        refdcp.save({long_key: torch.ones(2), "ok": torch.ones(1)}, checkpoint_id=tmp_path)
    assert err.value.step == "local_plan"
    message = str(_failure(err.value))
    assert "100000 characters" in message and "k" * 80 in message
    assert not any(tmp_path.iterdir())  # nothing written
    refdcp.save({"k" * 1000: torch.ones(2)}, checkpoint_id=tmp_path)  # under the cap: saved


# -- commit status False whenever the rename did not happen (SAVE-16) ------------------------


class _DirectoryReplaced(FileSystemWriter):
    """Replaces the checkpoint directory by a file just before the metadata is written."""

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        moved = self.path.with_name(self.path.name + ".moved")
        os.rename(self.path, moved)
        self.path.write_text("not a directory")
        super().finish(metadata, results)


@pytest.mark.spec("SAVE-16", "STORE-58")
def test_a_directory_replaced_by_a_file_before_the_rename_commits_where_the_data_is(
    tmp_path: Path,
    impl: ModuleType,
) -> None:
    """The save commits in the directory it opened (now ``ckpt.moved``) and says so, with
    commit status True; the file now at the path is left as it was."""
    root = tmp_path / "ckpt"
    with pytest.raises(CheckpointError) as err:
        impl.save(_sd(), storage_writer=_DirectoryReplaced(root))
    assert err.value.committed is True, err.value.commit_status
    assert str(tmp_path / "ckpt.moved") in str(err.value)
    assert root.read_text() == "not a directory"
    out = {"w": torch.zeros(4), "cfg": {"lr": 0.0}}
    impl.load(out, checkpoint_id=tmp_path / "ckpt.moved", verify=True)
    assert torch.equal(out["w"], _sd()["w"])


# -- clean-up honours global and rank-local metadata (STORE-33) ------------------------------


def _referenced(root: Path, name: str) -> set[str]:
    md = load_metadata((root / name).read_bytes(), file=name)
    return {info.relative_path for info in md.storage_data.values()}


@pytest.mark.spec("STORE-33")
@pytest.mark.parametrize("first", ["global", "rank-local"])
def test_global_and_rank_local_checkpoints_in_one_directory_both_survive_saves(
    tmp_path: Path, first: str
) -> None:
    # single path: a rank-local save is use_collectives=False, which the reference refuses (REF-17)
    def save(kind: str, v: float) -> None:
        refdcp.save(_sd(v), checkpoint_id=tmp_path, use_collectives=kind == "global")

    other = "rank-local" if first == "global" else "global"
    save(first, 1.0)
    save(other, 2.0)
    save(first, 3.0)
    save(other, 4.0)
    for name in (".metadata", "__0.metadata"):
        missing = {n for n in _referenced(tmp_path, name) if not (tmp_path / n).exists()}
        assert not missing, (name, missing)
    dest = _sd(0.0)
    refdcp.load(dest, checkpoint_id=tmp_path)
    assert torch.equal(dest["w"], torch.full((4,), 3.0 if first == "global" else 4.0))
