"""Snapshots of DTensors and tensor subclasses, a closed pool, a state dict that lost a tensor
(STAGE-9, STAGE-10, STAGE-19, STAGE-22, STAGE-23).

The DTensor here lives on a one-rank device mesh built without a process group
(``_init_backend=False``), so staging is checked in this process; the
multi-rank, Gloo-backed check is ``test_staging_stagers.py`` (marked dist).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from refdcp.staging.buffer_pool import BufferPool, allocate
from refdcp.staging.cpu_stager import CpuStager, copy_into
from refdcp.staging.tree import build_snapshot, layout_of


def _dtensor(local: torch.Tensor, global_shape: tuple[int, ...]) -> Any:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    mesh = DeviceMesh("cpu", [0], _init_backend=False, _rank=0)
    stride = torch.empty(global_shape).stride()
    spec = DTensorSpec(mesh, (Shard(0),), TensorMeta(torch.Size(global_shape), stride, local.dtype))
    return DTensor(local, spec, requires_grad=False)  # type: ignore[no-untyped-call]


@pytest.mark.spec("STAGE-19")
@pytest.mark.parametrize("cached", [False, True])
def test_a_dtensor_stages_its_local_shard_and_comes_back_with_its_spec(cached: bool) -> None:
    from torch.distributed.tensor import DTensor

    src = {"w": _dtensor(torch.arange(12.0).reshape(3, 4), (3, 4)), "n": 2}
    layout = layout_of(src, type_check=True)  # accepted by type_check
    assert [s.path for s in layout] == [("w", "local")] and layout[0].shape == (3, 4)
    stager = CpuStager(cache_staged_state_dict=cached, type_check=True, pin_memory=False)
    snap = stager.stage(src)
    w = snap["w"]
    assert isinstance(w, DTensor) and w.placements == src["w"].placements
    assert w._spec == src["w"]._spec and tuple(w.shape) == (3, 4) and not w.requires_grad
    assert torch.equal(w._local_tensor, torch.arange(12.0).reshape(3, 4))
    ptr = w._local_tensor.data_ptr()
    assert ptr != src["w"]._local_tensor.data_ptr()
    src["w"]._local_tensor.add_(100)  # the snapshot is isolated from the source (STAGE-6)
    assert torch.equal(w._local_tensor, torch.arange(12.0).reshape(3, 4))
    if cached:
        stager.release(snap)
        again = stager.stage(src)
        assert again["w"]._local_tensor.data_ptr() == ptr  # the pooled buffer is reused
        assert torch.equal(again["w"]._local_tensor, torch.arange(12.0).reshape(3, 4) + 100)
        stager.release(again)
    stager.close()


class Tagged(torch.Tensor):
    """A tensor subclass that can be deep-copied (keeps its type)."""

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        return torch.Tensor(self).detach().clone().as_subclass(Tagged)


@pytest.mark.spec("STAGE-9", "STAGE-10")
def test_a_tensor_subclass_is_not_a_plain_tensor() -> None:
    t = torch.arange(4.0).as_subclass(Tagged)
    sd = {"a": [t, torch.ones(2)]}
    assert [s.path for s in layout_of(sd)] == [("a", 1)]  # only the plain tensor gets a slot
    snap = CpuStager(cache_staged_state_dict=True, pin_memory=False).stage(sd)
    assert type(snap["a"][0]) is Tagged and torch.equal(
        torch.Tensor(snap["a"][0]), torch.arange(4.0)
    )
    with pytest.raises(TypeError, match=r"value at a\.0 has type Tagged"):
        CpuStager(type_check=True).stage(sd)


@pytest.mark.spec("STAGE-22")
def test_a_closed_pool_refuses_to_lease_and_allocates_nothing() -> None:
    layout = layout_of({"w": torch.zeros(4)})
    pool = BufferPool(max_sets=2)
    lease = pool.acquire(layout)
    pool.copy_done(lease)
    lease.release()
    pool.close()
    with pytest.raises(RuntimeError, match="pool is closed"):
        pool.acquire(layout)
    assert pool.states() == [] and pool.allocations == 1
    stager = CpuStager(cache_staged_state_dict=True, pin_memory=False)
    stager.release(stager.stage({"w": torch.ones(2)}))
    stager.close()
    with pytest.raises(RuntimeError, match="pool is closed"):
        stager.stage({"w": torch.ones(2)})


@pytest.mark.spec("STAGE-23")
def test_a_state_dict_that_lost_a_tensor_since_its_layout_was_taken_is_refused() -> None:
    before = {"a": torch.ones(2), "b": torch.ones(3)}
    layout = layout_of(before)
    after = {"a": torch.ones(2), "b": 3}  # "b" is no longer a tensor
    with pytest.raises(ValueError, match="changed shape while it was being staged"):
        build_snapshot(after, layout, allocate(layout), copy_into)
    snap = build_snapshot(before, layout, allocate(layout), copy_into)
    assert torch.equal(snap["b"], torch.ones(3))
