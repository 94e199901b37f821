"""The writer's smallest parts and its writeback hint (STORE-11, STORE-60)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import refdcp
from refdcp.storage.fs import filesystem

SINGLE_PATH = "mutation-kill tests pinning one module of the default path (tests/MUTATION.md); the behaviour runs on both in the shared suites"


@pytest.mark.spec("STORE-11", "STORE-60")
@pytest.mark.parametrize("sync_files", [True, False])
def test_one_byte_tensors_round_trip_beside_empty_and_larger_ones(
    tmp_path: Path, sync_files: bool
) -> None:
    state = {
        "u8": torch.tensor([7], dtype=torch.uint8),
        "flag": torch.tensor(True),
        "i8": torch.tensor([-3], dtype=torch.int8),
        "empty": torch.zeros(0, dtype=torch.uint8),
        "f32": torch.arange(5, dtype=torch.float32),
    }
    refdcp.save(
        state, storage_writer=refdcp.FileSystemWriter(tmp_path, sync_files=sync_files), no_dist=True
    )
    out = {k: torch.zeros_like(v) for k, v in state.items()}
    refdcp.load(out, checkpoint_id=tmp_path, no_dist=True, verify=True)
    for k, v in state.items():
        assert torch.equal(out[k], v), k


@pytest.mark.spec("STORE-60")
def test_the_writeback_hint_does_nothing_where_the_call_is_missing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(filesystem, "_SYNC_FILE_RANGE", None)
    fd = os.open(tmp_path / "f", os.O_CREAT | os.O_WRONLY, 0o600)
    try:
        os.write(fd, b"x" * 4096)
        filesystem.start_writeback(fd, 0, 4096)  # no call to make: nothing happens
        filesystem.start_writeback(fd, 4096, 0)
    finally:
        os.close(fd)
    assert (tmp_path / "f").read_bytes() == b"x" * 4096


@pytest.mark.spec("STORE-11", "STORE-50")
def test_large_items_after_any_count_of_small_ones_round_trip(tmp_path: Path) -> None:
    """A large item after 0-63 small ones in one file: whatever STORE-50 pad the small
    frames leave before it, every value comes back."""
    for count in range(0, 64, 3):
        state = {f"a{i:02d}": torch.full((3,), i, dtype=torch.uint8) for i in range(count)}
        state["z_large"] = torch.arange(1 << 19, dtype=torch.float32)  # 2 MiB
        where = tmp_path / str(count)
        writer = refdcp.FileSystemWriter(where, sync_files=False, thread_count=1)
        refdcp.save(state, storage_writer=writer, no_dist=True)
        out = {k: torch.zeros_like(v) for k, v in state.items()}
        refdcp.load(out, checkpoint_id=where, no_dist=True, verify=True)
        assert all(torch.equal(out[k], v) for k, v in state.items()), count
