"""MemoryStorage: commit semantics, determinism, thread safety (STORE-20..STORE-25)."""

from __future__ import annotations

import threading
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter

from refdcp.storage import CheckpointExistsError, CorruptionError, MemoryStorage

SINGLE_PATH = "refdcp.MemoryStorage under torch's driver"

warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def _sd(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(4, 6, generator=g),
        "h": torch.randn(5, generator=g).half(),
        "step": seed,
    }


def _dest() -> dict[str, Any]:
    return {"w": torch.zeros(4, 6), "h": torch.zeros(5).half(), "step": -1}


def _save(m: MemoryStorage, cid: str, seed: int, **kw: Any) -> None:
    dcp.save(_sd(seed), storage_writer=m.writer(cid, **kw), no_dist=True)


def _load(m: MemoryStorage, cid: str, verify: bool = False) -> dict[str, Any]:
    r = m.reader(cid)
    r.set_verify(verify)
    out = _dest()
    dcp.load(out, storage_reader=r, no_dist=True)
    return out


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return all(
        torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a
    )


@pytest.mark.spec("STORE-20")
def test_writer_reader_are_torch_storage() -> None:
    m = MemoryStorage()
    assert isinstance(m.writer("a"), StorageWriter) and isinstance(m.reader("a"), StorageReader)
    _save(m, "a", 1)
    _save(m, "b", 2)
    assert m.ids() == ["a", "b"]
    assert _same(_load(m, "a", verify=True), _sd(1)) and _same(_load(m, "b"), _sd(2))
    assert m.verify("a").ok


@pytest.mark.spec("STORE-20")
def test_concurrent_saves_to_distinct_ids() -> None:
    m = MemoryStorage()
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            for rep in range(3):
                _save(m, f"id{i}", i * 10 + rep)
                assert _same(_load(m, f"id{i}", verify=True), _sd(i * 10 + rep))
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors and not any(t.is_alive() for t in threads)
    assert m.ids() == [f"id{i}" for i in range(4)]


@pytest.mark.spec("STORE-21")
def test_failed_save_is_invisible() -> None:
    m = MemoryStorage()
    _save(m, "x", 1)
    before = m.files("x")

    class Boom(type(m.writer("x"))):  # type: ignore[misc]
        def finish(self, metadata: Any, results: Any) -> None:
            raise RuntimeError("injected")

    with pytest.raises(CheckpointException, match="injected"):
        dcp.save(_sd(2), storage_writer=Boom(m, "x"), no_dist=True)
    assert m.files("x") == before
    assert _same(_load(m, "x"), _sd(1))
    with pytest.raises(CheckpointException, match="no committed checkpoint"):
        _load(m, "never")


@pytest.mark.spec("STORE-22")
def test_deterministic_bytes() -> None:
    def run() -> list[dict[str, bytes]]:
        m = MemoryStorage()
        _save(m, "x", 1)
        _save(m, "x", 2)
        return [m.files("x")]

    assert run() == run()


@pytest.mark.spec("STORE-23")
def test_reader_pins_snapshot() -> None:
    m = MemoryStorage()
    _save(m, "x", 1)
    r = m.reader("x")
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    md = r.read_metadata()
    _save(m, "x", 2)  # commits while the load is in progress
    r.set_up_storage_reader(md, True)
    planner = DefaultLoadPlanner()
    out = _dest()
    planner.set_up_planner(out, md, True)
    r.read_data(planner.create_local_plan(), planner).wait()
    assert torch.equal(out["w"], _sd(1)["w"])
    assert _same(_load(m, "x"), _sd(2))


@pytest.mark.spec("STORE-24")
def test_memory_files_are_a_filesystem_checkpoint(tmp_path: Path) -> None:
    m = MemoryStorage()
    _save(m, "x", 5)
    for name, data in m.files("x").items():
        (tmp_path / name).write_bytes(data)
    out = _dest()
    dcp.load(out, storage_reader=dcp.FileSystemReader(tmp_path), no_dist=True)
    assert _same(out, _sd(5))


@pytest.mark.spec("STORE-25")
def test_overwrite_false() -> None:
    m = MemoryStorage()
    _save(m, "x", 1, overwrite=False)
    with pytest.raises(CheckpointException, match="overwrite=False"):
        _save(m, "x", 2, overwrite=False)
    w = m.writer("x", overwrite=False)
    from torch.distributed.checkpoint.planner import SavePlan

    with pytest.raises(CheckpointExistsError):
        w.prepare_local_plan(SavePlan([]))
    assert _same(_load(m, "x"), _sd(1))


@pytest.mark.spec("INTEG-3")
def test_memory_corruption_detected() -> None:
    m = MemoryStorage()
    _save(m, "x", 1)
    name = next(n for n in m.files("x") if n.endswith(".distcp"))
    data = bytearray(m.files("x")[name])
    data[len(data) // 2] ^= 1
    m.replace_file("x", name, bytes(data))
    assert not m.verify("x").ok
    r = m.reader("x")
    r.set_verify(True)
    md = r.read_metadata()
    r.set_up_storage_reader(md, True)
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    planner = DefaultLoadPlanner()
    planner.set_up_planner(_dest(), md, True)
    with pytest.raises(CorruptionError):
        r.read_data(planner.create_local_plan(), planner).wait()
