"""Each implementation's LocalShards (``impl``) with torch's planner and DefaultStager (PLAN-13, PLAN-14)."""

from __future__ import annotations

import warnings
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import default_planner as tp
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from refdcp.comm import FakeWorld

warnings.filterwarnings("ignore", message="torch.distributed is disabled")

CPU_ONLY = StagingOptions(False, False, False, False)


def _planners(kind: str, impl: ModuleType) -> tuple[Any, Any]:
    if kind == "torch":
        return tp.DefaultSavePlanner(), tp.DefaultLoadPlanner()
    return impl.DefaultSavePlanner(), impl.DefaultLoadPlanner()


@pytest.mark.spec("PLAN-13", "PLAN-3")
@pytest.mark.parametrize("saver", ["torch", "impl"])
@pytest.mark.parametrize("loader", ["torch", "impl"])
@pytest.mark.parametrize("world", [1, 2])
def test_zero_element_local_shards_keep_their_key(
    impl: ModuleType, tmp_path: Path, saver: str, loader: str, world: int
) -> None:
    def save(comm: Any) -> Any:
        sd = {"z": impl.LocalShards((0, 4), [], dtype=torch.float16), "w": torch.ones(2)}
        return impl.save(
            sd,
            storage_writer=dcp.FileSystemWriter(str(tmp_path)),
            planner=_planners(saver, impl)[0],
            comm=comm,
        )

    md = FakeWorld(world).run(save)[0]
    z = md.state_dict_metadata["z"]  # the key is recorded by either planner
    assert tuple(z.size) == (0, 4) and z.properties.dtype == torch.float16

    def load(comm: Any) -> bool:
        dest = {"z": impl.LocalShards((0, 4), [], dtype=torch.float16), "w": torch.zeros(2)}
        impl.load(
            dest,
            storage_reader=dcp.FileSystemReader(str(tmp_path)),
            planner=_planners(loader, impl)[1],
            comm=comm,
        )
        return bool(torch.equal(dest["w"], torch.ones(2)))

    assert FakeWorld(world).run(load) == [True] * world


@pytest.mark.spec("PLAN-13")
def test_torch_save_planner_keeps_zero_element_local_shards(
    impl: ModuleType, tmp_path: Path
) -> None:
    md = dcp.save(
        {"z": impl.LocalShards((3, 0), [], dtype=torch.int64)}, checkpoint_id=tmp_path, no_dist=True
    )
    assert list(md.state_dict_metadata) == ["z"]
    dest = {"z": torch.zeros(3, 0, dtype=torch.int64)}
    dcp.load(dest, checkpoint_id=tmp_path, no_dist=True)  # strict: fails if the key is missing


@pytest.mark.spec("PLAN-14")
@pytest.mark.parametrize("entry", ["torch", "impl"])
def test_torch_default_stager_stages_local_shards(
    impl: ModuleType, tmp_path: Path, entry: str
) -> None:
    rows = torch.arange(12.0).reshape(3, 4)
    src = {"w": impl.LocalShards((3, 4), [((0, 0), rows)]), "step": 3}
    stager = DefaultStager(CPU_ONLY)
    if entry == "torch":
        dcp.async_save(src, checkpoint_id=tmp_path, async_stager=stager, no_dist=True).result()
    else:
        impl.async_save(src, checkpoint_id=tmp_path, async_stager=stager, no_dist=True).result()
    stager.close()
    rows.fill_(-1.0)  # the snapshot was a copy
    got = torch.zeros(3, 4)
    dest = {"w": impl.LocalShards((3, 4), [((0, 0), got)]), "step": 0}
    impl.load(dest, checkpoint_id=tmp_path, no_dist=True)
    assert torch.equal(got, torch.arange(12.0).reshape(3, 4)) and dest["step"] == 3


@pytest.mark.spec("PLAN-14", "PLAN-5")
def test_only_new_empty_is_allowed(impl: ModuleType) -> None:
    ls = impl.LocalShards((4,), [((0,), torch.ones(4))])
    empty = ls.new_empty((4,))
    assert isinstance(empty, impl.LocalShards) and empty.chunks == [] and empty.shape == (4,)
    with pytest.raises(TypeError):
        ls + 1
    with pytest.raises(TypeError, match="checkpointing container"):
        ls.clone()
