"""The filesystem reader refuses metadata it cannot serve, by name (FMT-5, LOAD-10; issue 13).

Driven through torch's ``StorageReader`` protocol (``read_metadata``,
``set_up_storage_reader``, ``read_data``) as torch's ``dcp.load`` drives it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

import refdcp
from refdcp.errors import RefdcpError
from refdcp.storage import FileSystemReader
from refdcp.storage.metadata.safe import dump_metadata, load_metadata

SINGLE_PATH = "mutation-kill tests pinning one module of the default path (tests/MUTATION.md); the behaviour runs on both in the shared suites"

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _read_item(fqn: str, offsets: tuple[int, ...], lengths: tuple[int, ...]) -> ReadItem:
    return ReadItem(
        type=LoadItemType.TENSOR,
        dest_index=MetadataIndex(fqn, torch.Size(offsets)),
        dest_offsets=torch.Size(offsets),
        storage_index=MetadataIndex(fqn, torch.Size(offsets), 0),
        storage_offsets=torch.Size([0] * len(offsets)),
        lengths=torch.Size(lengths),
    )


@pytest.mark.spec("FMT-5")
def test_a_metadata_without_storage_data_is_not_a_filesystem_checkpoint(tmp_path: Path) -> None:
    refdcp.save({"w": torch.ones(4)}, checkpoint_id=tmp_path)
    md = load_metadata((tmp_path / ".metadata").read_bytes())
    md.storage_data = None
    (tmp_path / ".metadata").write_bytes(dump_metadata(md))
    reader = FileSystemReader(tmp_path)
    got = reader.read_metadata()
    with pytest.raises(RefdcpError, match="no storage_data: not a filesystem checkpoint"):
        reader.set_up_storage_reader(got, True)
    with pytest.raises(BaseException, match="not a filesystem checkpoint"):
        refdcp.load({"w": torch.zeros(4)}, checkpoint_id=tmp_path)


@pytest.mark.spec("LOAD-10")
def test_a_read_of_a_chunk_the_metadata_does_not_describe_is_refused(tmp_path: Path) -> None:
    refdcp.save({"w": torch.arange(4.0)}, checkpoint_id=tmp_path)
    reader = FileSystemReader(tmp_path)
    md = reader.read_metadata()
    md.state_dict_metadata["w"].chunks = []  # type: ignore[union-attr]
    reader.set_up_storage_reader(md, True)
    with pytest.raises(RefdcpError, match=r"w: chunk torch.Size\(\[0\]\) is not in the metadata"):
        reader.read_data(LoadPlan([_read_item("w", (0,), (4,))]), _NoPlanner())


class _NoPlanner:
    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"the planner must not be asked for {name}")


@pytest.mark.spec("STORE-12")
@pytest.mark.parametrize("dest", ["same", "cast", "non-contiguous"])
def test_every_tensor_read_is_committed_to_the_planner_once(tmp_path: Path, dest: str) -> None:
    from refdcp.planning import DefaultLoadPlanner

    committed: list[str] = []

    class Recording(DefaultLoadPlanner):
        def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
            committed.append(read_item.dest_index.fqn)
            super().commit_tensor(read_item, tensor)

    sd = {"a": torch.arange(6.0).reshape(2, 3), "b": torch.ones(4, dtype=torch.float64)}
    refdcp.save(sd, checkpoint_id=tmp_path)
    out: dict[str, Any] = {
        "same": {"a": torch.zeros(2, 3), "b": torch.zeros(4, dtype=torch.float64)},
        "cast": {"a": torch.zeros(2, 3, dtype=torch.float64), "b": torch.zeros(4)},
        "non-contiguous": {
            "a": torch.zeros(3, 2).t(),
            "b": torch.zeros(8, dtype=torch.float64)[::2],
        },
    }[dest]
    refdcp.load(out, checkpoint_id=tmp_path, planner=Recording(allow_cast=dest == "cast"))
    assert sorted(committed) == ["a", "b"]
    assert torch.equal(out["a"].double(), sd["a"].double()) and torch.equal(
        out["b"].double(), sd["b"]
    )
