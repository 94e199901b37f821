"""``refdcp inspect`` on a checkpoint written by torch over 2 Gloo ranks (TOOL-2, TOOL-3)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from refdcp.testing.spawn import run_gloo
from refdcp.tools.inspect import format_report, inspect_checkpoint
from tests.test_inspect import check_golden, normalise_json, normalise_text


def _save_two_ranks(rank: int, world_size: int, path: str) -> None:
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    full = torch.arange(24, dtype=torch.float32).reshape(6, 4)
    state = {
        "sharded": distribute_tensor(full, mesh, [Shard(0)]),
        "replicated": torch.ones(3),
        "step": 5,
    }
    dcp.save(state, checkpoint_id=path)


@pytest.fixture(scope="module")
def two_rank_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("dist") / "ckpt"
    run_gloo(2, _save_two_ranks, str(path), timeout=120.0)
    return path


@pytest.mark.dist
@pytest.mark.timeout(180)
@pytest.mark.spec("TOOL-2", "TOOL-3")
def test_chunks_name_the_rank_that_wrote_them(two_rank_ckpt: Path) -> None:
    report = inspect_checkpoint(two_rank_ckpt)
    keys = {k["fqn"]: k for k in report["keys"]}
    sharded = keys["sharded"]["chunks"]
    assert [(c["offsets"], c["sizes"], c["rank"]) for c in sharded] == [
        ([0, 0], [3, 4], 0),
        ([3, 0], [3, 4], 1),
    ]
    assert all(c["file"] == f"__{c['rank']}_0.distcp" for c in sharded)
    assert [f["name"] for f in report["files"]] == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert set(report["ranks"]) == {"0", "1"}
    sizes = {f["name"]: f["size"] for f in report["files"]}
    # torch's dedup balances replicated items onto the less loaded rank 1.
    assert {k: keys[k]["chunks"][0]["rank"] for k in ("replicated", "step")} == {
        "replicated": 1,
        "step": 1,
    }
    assert report["ranks"]["0"] == {"items": 1, "bytes": sizes["__0_0.distcp"], "files": 1}
    assert report["ranks"]["1"]["items"] == 3 and report["ranks"]["1"]["files"] == 1
    for rank, totals in report["ranks"].items():
        assert totals["bytes"] == sizes[f"__{rank}_0.distcp"]


@pytest.mark.dist
@pytest.mark.timeout(180)
@pytest.mark.spec("TOOL-2", "TOOL-11")
def test_two_rank_golden(two_rank_ckpt: Path) -> None:
    report = inspect_checkpoint(two_rank_ckpt)
    check_golden(
        "inspect_torch_two_ranks.txt", normalise_text(format_report(report), two_rank_ckpt)
    )
    check_golden("inspect_torch_two_ranks.json", normalise_json(report, two_rank_ckpt))
    assert json.loads(normalise_json(report, two_rank_ckpt))["ranks"]
