"""A failed load leaves nested non-tensor values as they were (LOAD-19)."""

from __future__ import annotations

import warnings
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from refdcp.comm import FakeWorld
from refdcp.errors import CheckpointError

warnings.filterwarnings("ignore", message="torch.distributed is not initialized")


def _state(v: float) -> dict[str, Any]:
    return {
        "w": torch.full((3,), v),
        "cfg": {"lr": v, "betas": (v, v), "inner": {"steps": [int(v)]}},
        "top": v,
    }


def _unchanged(sd: dict[str, Any], v: float) -> bool:
    return sd["cfg"] == {"lr": v, "betas": (v, v), "inner": {"steps": [int(v)]}} and sd["top"] == v


@pytest.mark.spec("LOAD-19", "LOAD-5", "REF-9")
def test_a_load_failing_after_its_reads_leaves_nested_values_alone(
    tmp_path: Path, impl: ModuleType
) -> None:
    impl.save(_state(1.0), checkpoint_id=tmp_path)

    def fail_before_apply(i: int, action: Any) -> None:
        if "apply" in str(action).lower():
            raise RuntimeError("injected before apply")

    dest = _state(7.0)
    cfg = dest["cfg"]
    with pytest.raises(CheckpointError):
        impl.load(dest, checkpoint_id=tmp_path, fault=fail_before_apply)
    assert _unchanged(dest, 7.0) and dest["cfg"] is cfg
    impl.load(dest, checkpoint_id=tmp_path)  # and a load that succeeds places them
    assert _unchanged(dest, 1.0)


@pytest.mark.spec("LOAD-19", "REF-9")
def test_a_tensor_failing_its_check_after_the_values_leaves_nested_values_alone(
    tmp_path: Path, impl: ModuleType
) -> None:
    md = impl.save(_state(1.0), checkpoint_id=tmp_path)
    info = next(v for k, v in md.storage_data.items() if k.fqn == "w")
    path = tmp_path / info.relative_path
    data = bytearray(path.read_bytes())
    data[info.offset + info.length - 30] ^= 0xFF  # damage w's stored bytes
    path.write_bytes(bytes(data))
    dest = _state(7.0)
    with pytest.raises(CheckpointError):
        impl.load(dest, checkpoint_id=tmp_path)
    assert _unchanged(dest, 7.0)


@pytest.mark.spec("LOAD-19", "LOAD-5", "REF-9")
def test_another_ranks_failed_read_leaves_this_ranks_nested_values_alone(
    tmp_path: Path, impl: ModuleType
) -> None:
    FakeWorld(2).run(lambda comm: impl.save(_state(1.0), checkpoint_id=tmp_path, comm=comm))

    def load(comm: Any) -> bool:
        def fail_read_on_rank1(i: int, action: Any) -> None:
            if comm.rank == 1 and "read" in str(action).lower():
                raise RuntimeError("injected read failure on rank 1")

        dest = _state(7.0)
        with pytest.raises(CheckpointError):
            impl.load(dest, checkpoint_id=tmp_path, comm=comm, fault=fail_read_on_rank1)
        return _unchanged(dest, 7.0)

    assert FakeWorld(2).run(load) == [True, True]


@pytest.mark.spec("LOAD-19")
def test_torchs_load_with_refdcps_planner_still_places_nested_values(
    tmp_path: Path, impl: ModuleType
) -> None:
    import torch.distributed.checkpoint as dcp

    impl.save(_state(1.0), checkpoint_id=tmp_path)
    dest = _state(7.0)
    dcp.load(dest, checkpoint_id=tmp_path, planner=impl.DefaultLoadPlanner(), no_dist=True)
    assert _unchanged(dest, 1.0)
