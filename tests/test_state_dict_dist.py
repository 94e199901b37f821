"""FSDP2-sharded models go through torch's DSD (spec/tooling.md, SD-9), on 2 Gloo ranks."""

from __future__ import annotations

from typing import Any

import pytest

from refdcp.testing.spawn import run_gloo


def _fsdp2_compare(rank: int, world_size: int) -> dict[str, Any]:
    import torch
    from torch import nn
    from torch.distributed.checkpoint import state_dict as tsd
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from refdcp.state import state_dict as rsd

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    fully_shard(model, mesh=init_device_mesh("cpu", (world_size,)))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    x = torch.randn(4, 4, generator=torch.Generator().manual_seed(rank))
    model(x).sum().backward()
    opt.step()

    delegated = rsd.uses_torch_implementation(model)
    msd, osd = rsd.get_state_dict(model, opt)
    tmsd, tosd = tsd.get_state_dict(model, opt)
    same_model = list(msd) == list(tmsd) and all(
        isinstance(msd[k], DTensor) and torch.equal(msd[k].to_local(), tmsd[k].to_local())
        for k in msd
    )
    same_optim = sorted(osd["state"]) == sorted(tosd["state"]) and all(
        torch.equal(osd["state"][k]["exp_avg"].to_local(), tosd["state"][k]["exp_avg"].to_local())
        for k in osd["state"]
    )
    # Setting back what was read leaves the model and optimizer as they were.
    before = {k: v.to_local().clone() for k, v in msd.items()}
    rsd.set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
    after = rsd.get_model_state_dict(model)
    unchanged = all(torch.equal(after[k].to_local(), before[k]) for k in before)
    return {
        "delegated": delegated,
        "same_model": same_model,
        "same_optim": same_optim,
        "unchanged": unchanged,
        "keys": sorted(osd["state"]),
    }


@pytest.mark.dist
@pytest.mark.timeout(180)
@pytest.mark.spec("SD-9")
def test_fsdp2_model_is_handled_by_torch() -> None:
    results = run_gloo(2, _fsdp2_compare, timeout=150.0)
    for r in results:
        assert r["delegated"] and r["same_model"] and r["same_optim"] and r["unchanged"]
        assert r["keys"] == ["0.bias", "0.weight", "2.bias", "2.weight"]
