"""The reference path's refusals, each reached on its own (error paths no other test ran):
a damaged `.metadata` (INTEG-2, FMT-5..7), a missing or truncated data file (STORE-13), a
non-regular file (STORE-27), a planner without metadata, a load that the policy refuses
(POLICY-1), the reserved FQN (FLAT-6), and storage ids (API-7)."""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.metadata import MetadataIndex

import refdcp.reference
from refdcp.comm import SingleRank
from refdcp.errors import CheckpointError
from refdcp.reference import ReferenceReader, ReferenceWriter
from refdcp.reference import format as fmt
from refdcp.reference.load_planner import ReferenceLoadPlanner
from refdcp.reference.save_planner import chunk_of
from refdcp.storage import (
    CorruptionError,
    MalformedMetadataError,
    UnsafeMetadataError,
    UnsafePathError,
)

SINGLE_PATH = "mutation-kill tests pinning refdcp/reference itself (tests/MUTATION.md); they target the reference module, not an implementation choice"


def _saved(path: Path, sd: dict[str, Any] | None = None) -> None:
    refdcp.reference.save(sd or {"w": torch.arange(4.0)}, checkpoint_id=path, comm=SingleRank())


@pytest.mark.spec("INTEG-2", "FMT-5", "FMT-6", "REF-1")
def test_a_damaged_metadata_file_is_refused_with_the_right_error() -> None:
    from torch.distributed.checkpoint.metadata import Metadata

    good = fmt.dump_metadata(Metadata(state_dict_metadata={}))
    flipped = bytearray(good)
    flipped[5] ^= 1
    with pytest.raises(CorruptionError, match="metadata checksum mismatch") as e:
        fmt.load_metadata(bytes(flipped), "m")
    assert e.value.offset == 0
    with pytest.raises(CorruptionError, match="does not unpickle") as e2:
        fmt.load_metadata(b"\x80\x04junk", "m")
    assert e2.value.offset == 0
    with pytest.raises(MalformedMetadataError, match="holds a list"):
        fmt.load_metadata(pickle.dumps([1, 2]), "m")
    with pytest.raises(UnsafeMetadataError, match="persistent"):
        fmt.load_metadata(b"\x80\x02P0\n.", "m")


@pytest.mark.spec("STORE-13", "STORE-27", "REF-1")
def test_missing_truncated_and_irregular_data_files_are_refused(tmp_path: Path) -> None:
    _saved(tmp_path)
    md = ReferenceReader(tmp_path).read_metadata()
    (info,) = md.storage_data.values()
    data = tmp_path / info.relative_path
    blob = data.read_bytes()
    reader = ReferenceReader(tmp_path)
    reader.read_metadata()
    index = MetadataIndex("w", torch.Size([0]))
    data.write_bytes(blob[:-1])
    with pytest.raises(CorruptionError, match="truncated") as e:
        reader._read_item(index)
    assert e.value.offset == info.offset
    data.unlink()
    with pytest.raises(CorruptionError, match="data file missing") as e2:
        reader._read_item(index)
    assert e2.value.offset == 0
    data.mkdir()
    with pytest.raises(UnsafePathError, match="not a regular file"):
        reader._read_item(index)
    data.rmdir()
    os.mkfifo(data)
    with pytest.raises(UnsafePathError, match="not a regular file"):
        reader._read_item(index)  # O_NONBLOCK: a FIFO with no writer does not hang the open
    fds = len(os.listdir("/proc/self/fd"))
    with pytest.raises(UnsafePathError):
        reader._read_item(index)
    assert len(os.listdir("/proc/self/fd")) == fds  # the refused file is closed
    data.unlink()


@pytest.mark.spec("POLICY-1", "RESHARD-5", "REF-1")
def test_the_load_planner_refuses_before_any_read(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="needs the checkpoint's metadata"):
        ReferenceLoadPlanner().set_up_planner({})
    _saved(tmp_path)
    with pytest.raises(CheckpointError, match="'missing'"):
        refdcp.reference.load(
            {"w": torch.zeros(4), "missing": torch.zeros(1)},
            checkpoint_id=tmp_path,
            comm=SingleRank(),
        )


@pytest.mark.spec("FLAT-6", "REF-1")
def test_the_reserved_fqn_is_refused(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="reserved"):
        _saved(tmp_path, {"__refdcp_planner__": 1})


@pytest.mark.spec("API-7", "REF-1")
def test_storage_ids_are_local_paths_only() -> None:
    for cls in (ReferenceWriter, ReferenceReader):
        assert cls.validate_checkpoint_id("/tmp/x") is True
        assert cls.validate_checkpoint_id(Path("rel")) is True
        assert cls.validate_checkpoint_id("s3://bucket/x") is False
        assert cls.validate_checkpoint_id(5) is False  # type: ignore[arg-type]


@pytest.mark.spec("PLAN-6", "REF-1")
def test_chunk_of_a_non_tensor_is_refused() -> None:
    with pytest.raises(ValueError, match="is not a tensor"):
        chunk_of("text", MetadataIndex("o"))
