"""The reference writer (refdcp/reference/storage.py) on its own: it creates the checkpoint
directory and records the save's id in the metadata (REF-1, SAVE-1)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import refdcp.reference
from refdcp.comm import FakeWorld
from refdcp.reference import ReferenceReader


@pytest.mark.spec("REF-1", "SAVE-1", "STORE-2")
def test_a_save_creates_missing_directories_and_records_its_id(tmp_path: Path) -> None:
    path = tmp_path / "a" / "b"
    FakeWorld(2).run(
        lambda c: refdcp.reference.save({"w": torch.ones(3)}, checkpoint_id=path, comm=c)
    )
    md = ReferenceReader(path).read_metadata()
    assert md.storage_meta is not None and md.storage_meta.checkpoint_id == str(path)
    token = md.storage_meta.save_id
    assert token and sorted(p.name for p in path.glob("*.distcp")) == [
        f"__0_0.{token}.distcp",
        f"__1_0.{token}.distcp",
    ]
