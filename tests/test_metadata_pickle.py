"""The fast ``.metadata`` pickler writes exactly ``pickle.dumps(Metadata)``, and a ``.metadata``
either implementation saves (``impl``) is a plain pickle torch loads (FMT-1)."""

from __future__ import annotations

import copyreg
import pickle
import tempfile
import warnings
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from refdcp.storage.metadata.pickler import dumps_metadata, fast_reducers
from refdcp.storage.metadata.safe import TRAILER_PREFIX, load_metadata

warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def _metadata() -> Metadata:
    """Every record kind, shared and unshared objects, None and non-None optional fields."""
    shared = torch.Size([0, 0])
    props = TensorProperties(dtype=torch.bfloat16, requires_grad=True)
    md: dict[str, Any] = {
        "w": TensorStorageMetadata(
            props,
            torch.Size([4, 6]),
            [
                ChunkStorageMetadata(shared, torch.Size([2, 6])),
                ChunkStorageMetadata(torch.Size([2, 0]), torch.Size([2, 6])),
            ],
        ),
        "b": TensorStorageMetadata(TensorProperties(), torch.Size([]), []),
        "obj": BytesStorageMetadata(),
    }
    info = _StorageInfo("__0_0.distcp", 0, 100)
    info.refdcp_crc32c = 123  # type: ignore[attr-defined]
    transformed = _StorageInfo("__1_0.distcp", 5, 7, transform_descriptors=["zstd"])
    storage: dict[Any, Any] = {
        MetadataIndex("w", shared): info,
        MetadataIndex("w", [2, 0], index=1): transformed,
        MetadataIndex("obj"): _StorageInfo("__0_0.distcp", 100, 9),
    }
    meta = Metadata(
        state_dict_metadata=md,
        planner_data={"w": ("w",), "__refdcp_planner__": {"rich": {}, "empties": []}},
        storage_data=storage,
        storage_meta=StorageMeta(checkpoint_id=Path("/x"), save_id="s"),
        version="1.0.0",
    )
    meta.refdcp_format = 1  # type: ignore[attr-defined]
    return meta


# The next four tests are single path: they check the default path's fast pickler
# (dumps_metadata); the last test saves through both implementations.


@pytest.mark.spec("FMT-1")
def test_same_bytes_as_pickle_dumps() -> None:
    md = _metadata()
    blob = dumps_metadata(md)
    assert blob == pickle.dumps(md)
    back = pickle.loads(blob)
    assert back == md
    assert back.storage_data[MetadataIndex("w", [0, 0])].refdcp_crc32c == 123


@pytest.mark.spec("FMT-1")
def test_every_record_class_has_a_fast_reducer_in_this_torch() -> None:
    # the speed-up must not silently vanish with a torch whose classes still pickle the default way
    expected = {
        MetadataIndex,
        ChunkStorageMetadata,
        TensorStorageMetadata,
        BytesStorageMetadata,
        StorageMeta,
        Metadata,
        _StorageInfo,
        torch.Size,
    }
    assert set(fast_reducers()) == expected


@pytest.mark.spec("FMT-1")
def test_copyreg_reducers_take_precedence(monkeypatch: pytest.MonkeyPatch) -> None:
    def reduce_index(idx: MetadataIndex) -> Any:
        return (MetadataIndex, (idx.fqn.upper(),))

    monkeypatch.setitem(copyreg.dispatch_table, MetadataIndex, reduce_index)
    md = _metadata()
    blob = dumps_metadata(md)
    assert blob == pickle.dumps(md)
    assert MetadataIndex("OBJ") in pickle.loads(blob).storage_data


class _Info(_StorageInfo):
    def __getstate__(self) -> dict[str, Any]:
        return {"relative_path": "sub", "offset": 1, "length": 2}


@pytest.mark.spec("FMT-1")
def test_subclass_records_take_pickles_default_path() -> None:
    md = _metadata()
    md.storage_data[MetadataIndex("extra")] = _Info("x", 0, 1)
    blob = dumps_metadata(md)
    assert blob == pickle.dumps(md)
    assert pickle.loads(blob).storage_data[MetadataIndex("extra")].relative_path == "sub"


@pytest.mark.spec("FMT-1", "INTEG-2")
def test_saved_metadata_is_pickle_dumps_and_torch_loads_it(impl: ModuleType) -> None:
    sd = {f"m.p{i}": torch.full((3,), float(i)) for i in range(50)}
    sd["step"] = 7  # type: ignore[assignment]
    with tempfile.TemporaryDirectory() as d:
        impl.save(sd, checkpoint_id=d, no_dist=True)
        data = (Path(d) / ".metadata").read_bytes()
        body = data[: data.rindex(TRAILER_PREFIX)]
        md = pickle.loads(body)  # plain pickle, as torch's reader does
        assert load_metadata(data) == md
        out = {k: torch.zeros(3) for k in sd if k != "step"}
        out["step"] = 0  # type: ignore[assignment]
        dcp.load(out, storage_reader=dcp.FileSystemReader(d), no_dist=True)
        assert all(torch.equal(out[k], v) for k, v in sd.items() if k != "step")
        assert out["step"] == 7
