"""Tests for survivors of the default mutation sample at 0fb1c27 (safe_metadata)."""

from __future__ import annotations

import pickle

import crc32c
import pytest
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from refdcp.storage.errors import CorruptionError
from refdcp.storage.metadata.safe import TRAILER_PREFIX, load_metadata, safe_loads


@pytest.mark.spec("INTEG-2")
@pytest.mark.parametrize(
    "body", [pickle.dumps(None), pickle.dumps([1, 2]), b""], ids=["none", "list", "empty"]
)
def test_a_short_metadata_with_a_wrong_trailer_is_a_checksum_mismatch(body: bytes) -> None:
    # the whole file is 24-47 bytes: the trailer is still found at its end and checked
    data = body + TRAILER_PREFIX + b"%08x\n" % (crc32c.crc32c(body) ^ 1)
    assert len(data) < 48
    with pytest.raises(CorruptionError, match="metadata checksum mismatch"):
        load_metadata(data, file="f")


@pytest.mark.spec("FMT-6")
def test_safe_loads_gives_the_real_dcp_classes_back() -> None:
    chunk = ChunkStorageMetadata(offsets=torch.Size([0]), sizes=torch.Size([4]))
    entry = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([4]), [chunk])
    key = MetadataIndex("w", torch.Size([0]), 0)
    md = Metadata({"w": entry}, storage_data={key: _StorageInfo("__0_0.distcp", 0, 16)})
    back = safe_loads(pickle.dumps(md))
    assert type(back) is Metadata
    got = back.state_dict_metadata["w"]
    assert type(got) is TensorStorageMetadata and type(got.chunks[0]) is ChunkStorageMetadata
    assert type(got.properties) is TensorProperties
    ((got_key, got_info),) = back.storage_data.items()
    assert type(got_key) is MetadataIndex and type(got_info) is _StorageInfo
    assert back == md
