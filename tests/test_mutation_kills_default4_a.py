"""Tests for survivors of the default mutation sample at 0fb1c27 (seed 1; issue 13).

- ``filesystem.py:147``: a part of 4 MiB or more handed to ``_FileOut.write`` (a 4-8 MiB
  tensor's bytes, a large BYTE_IO item) is written at once and must reach the file (STORE-1).
- ``filesystem.py:215``: ``checkpoint_id`` is the writer's and reader's path, as torch's (STORE-10).
- ``filesystem.py:481``: ``finish`` frees the save lock once committed, also when torch's
  ``dcp.save`` drives the writer (it never calls ``abort_save``) (STORE-29).
- ``inplace.py:143``: an unexpected error while probing an archive propagates as itself (STORE-40).
- ``items.py:91``: a CRC pool entry of another process id is replaced (STORE-49).
- ``items.py:218``: ``ChunkIndex`` keys a chunk by its offsets' and sizes' values whatever
  their sequence type (META-8).
"""

from __future__ import annotations

import errno
import io
import os
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

import refdcp
from refdcp.storage.format import items
from refdcp.storage.format.items import ChunkIndex
from refdcp.storage.fs import inplace
from refdcp.storage.fs.filesystem import FileSystemReader, FileSystemWriter
from refdcp.storage.fs.inplace import locate_tensor_data

SINGLE_PATH = "mutation-kill tests pinning one module of the default path (tests/MUTATION.md); the behaviour runs on both in the shared suites"

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.mark.spec("STORE-1")
def test_parts_of_4_to_8_mib_reach_the_file(tmp_path: Path) -> None:
    big = torch.arange(5 << 18, dtype=torch.float32)  # 5 MiB: written at once, CRC inline
    blob = bytes(range(256)) * (5 << 12)  # 5 MiB, pickled as one BYTE_IO item
    sd = {"small": torch.tensor([1.0, 2.0]), "big": big, "blob": blob}
    refdcp.save(sd, storage_writer=FileSystemWriter(tmp_path))
    out: dict[str, object] = {"small": torch.zeros(2), "big": torch.zeros_like(big), "blob": b""}
    refdcp.load(out, storage_reader=FileSystemReader(tmp_path))
    assert torch.equal(out["big"], big)
    assert torch.equal(out["small"], torch.tensor([1.0, 2.0]))
    assert out["blob"] == blob


@pytest.mark.spec("STORE-10")
def test_checkpoint_id_is_the_path_as_torchs(tmp_path: Path) -> None:
    torch_id = dcp.FileSystemWriter(tmp_path).checkpoint_id
    assert FileSystemWriter(tmp_path).checkpoint_id == Path(tmp_path) == Path(torch_id)
    assert FileSystemReader(tmp_path).checkpoint_id == Path(tmp_path)


@pytest.mark.spec("STORE-29")
def test_finish_frees_the_lock_under_torchs_save(tmp_path: Path) -> None:
    writer = FileSystemWriter(tmp_path)
    dcp.save({"w": torch.arange(4.0)}, storage_writer=writer, no_dist=True)
    assert (tmp_path / ".metadata").exists()
    assert not (tmp_path / ".metadata.lock").exists()
    assert writer._lock is None


@pytest.mark.spec("STORE-40")
def test_an_unexpected_read_error_propagates(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    buf = io.BytesIO()
    torch.save(torch.arange(4.0), buf)
    (tmp_path / "a.pt").write_bytes(buf.getvalue())

    def fail(_: bytes) -> None:
        raise OSError(errno.EIO, "I/O error")

    monkeypatch.setattr(inplace, "_describe", fail)
    fd = os.open(tmp_path / "a.pt", os.O_RDONLY)
    try:
        with pytest.raises(OSError, match="I/O error"):
            locate_tensor_data(fd, 0, len(buf.getvalue()), torch.float32, [4])
    finally:
        os.close(fd)


@pytest.mark.spec("STORE-49")
def test_a_crc_pool_of_another_process_is_replaced(monkeypatch: pytest.MonkeyPatch) -> None:
    stale = object()
    monkeypatch.setattr(items, "_CRC_POOL", (-1, stale))  # as if forked without the at-fork hook
    pool = items._crc_pool()
    assert pool is not stale
    assert items._CRC_POOL is not None and items._CRC_POOL[0] == os.getpid()
    assert pool.submit(lambda: 7).result() == 7


@pytest.mark.spec("META-8")
@pytest.mark.parametrize("offsets_kind", [list, tuple, torch.Size])
@pytest.mark.parametrize("sizes_kind", [list, tuple, torch.Size])
def test_chunk_index_keys_chunks_by_value(offsets_kind: type, sizes_kind: type) -> None:
    chunk = ChunkStorageMetadata(offsets=offsets_kind([2]), sizes=sizes_kind([3]))
    md = Metadata(
        {
            "w": TensorStorageMetadata(
                TensorProperties(dtype=torch.float16), torch.Size([5]), [chunk]
            )
        }
    )
    found = ChunkIndex(md).lookup(MetadataIndex("w", torch.Size([2])))
    assert found == (torch.float16, (3,))
