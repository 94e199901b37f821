"""refdcp's storage driven by refdcp.save/load over FakeWorld (STORE-14, STORE-20, INTEG-4)."""

from __future__ import annotations

import warnings
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch.distributed.checkpoint as dcp

from refdcp.comm import FakeWorld
from refdcp.errors import CheckpointError
from refdcp.storage import CorruptionError, FileSystemReader, FileSystemWriter, MemoryStorage
from tests.test_storage_compat import blank, compare, local_state

warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def _union(world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for r in range(world):
        out.update(local_state(r, world))
    return out


@pytest.mark.spec("STORE-14", "STORE-7")
@pytest.mark.parametrize("world", [1, 2, 4])
def test_refdcp_save_torch_reader(tmp_path: Path, world: int, impl: ModuleType) -> None:
    def rank(comm: Any) -> None:
        impl.save(
            local_state(comm.rank, world),
            storage_writer=FileSystemWriter(tmp_path, thread_count=2),
            comm=comm,
        )

    FakeWorld(world).run(rank, timeout=120)
    want = _union(world)
    out = blank(want)
    dcp.load(out, storage_reader=dcp.FileSystemReader(tmp_path), no_dist=True)
    assert compare(want, out) == []


@pytest.mark.spec("STORE-14", "FMT-5")
@pytest.mark.parametrize("world", [1, 2, 4])
def test_torch_writer_refdcp_reader(tmp_path: Path, world: int, impl: ModuleType) -> None:
    def save(comm: Any) -> None:
        impl.save(
            local_state(comm.rank, world), storage_writer=dcp.FileSystemWriter(tmp_path), comm=comm
        )

    def load(comm: Any) -> list[str]:
        sd = _union(world)  # refdcp's load policy refuses unexpected keys: load everything
        out = blank(sd)
        impl.load(out, storage_reader=FileSystemReader(tmp_path), comm=comm)
        return compare(sd, out)

    FakeWorld(world).run(save, timeout=120)
    assert FakeWorld(world).run(load, timeout=120) == [[] for _ in range(world)]


@pytest.mark.spec("STORE-20", "STORE-21", "INTEG-4")
@pytest.mark.parametrize("world", [1, 2, 4])
def test_memory_storage_in_fake_world(world: int, impl: ModuleType) -> None:
    storage = MemoryStorage()

    def save(comm: Any, seed: int) -> None:
        sd = local_state(comm.rank, world)
        sd["seed"] = seed
        impl.save(sd, storage_writer=storage.writer("ck"), comm=comm)

    def load(comm: Any) -> tuple[list[str], Any]:
        sd = _union(world)
        out = blank(sd)
        out["seed"] = None
        impl.load(out, storage_reader=storage.reader("ck"), comm=comm, verify=True)
        return compare(sd, out), out["seed"]

    FakeWorld(world).run(save, 1, timeout=120)
    FakeWorld(world).run(save, 2, timeout=120)
    assert FakeWorld(world).run(load, timeout=120) == [([], 2) for _ in range(world)]
    assert storage.verify("ck").ok


@pytest.mark.spec("INTEG-4", "INTEG-3")
def test_refdcp_load_verify_reports_corruption_on_every_rank(
    tmp_path: Path, impl: ModuleType
) -> None:
    world = 2

    def save(comm: Any) -> None:
        impl.save(
            local_state(comm.rank, world), storage_writer=FileSystemWriter(tmp_path), comm=comm
        )

    FakeWorld(world).run(save, timeout=120)
    victim = sorted(p for p in tmp_path.iterdir() if p.name.startswith("__1_"))[0]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))

    def load(comm: Any, verify: bool) -> None:
        sd = _union(world)
        impl.load(blank(sd), storage_reader=FileSystemReader(tmp_path), comm=comm, verify=verify)

    results = FakeWorld(world).run(load, True, return_exceptions=True, timeout=120)
    for res in results:
        assert isinstance(res, CheckpointError), res
        causes = [f.exception for f in res.rank_failures.values()]
        assert any(isinstance(c, CorruptionError) and c.file == victim.name for c in causes), res
