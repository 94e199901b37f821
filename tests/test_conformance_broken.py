"""Deliberately broken backends: each is caught by the requirement that names its fault."""

from __future__ import annotations

import contextlib
import dataclasses
import io
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from conformance.examples.dict_backend import DictBackend, DictReader, DictWriter, _tensor_bytes
from conformance.registry import Result
from conformance.runner import failed_musts, run_checks

pytestmark = pytest.mark.timeout(120)


class DropsItemWriter(DictWriter):
    """Forgets the result of the last write item."""

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        results = super().write_data(plan, planner).wait()
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results[:-1])
        return fut


class LossyWriter(DictWriter):
    """Stores float32 tensors rounded through float16: its own reader agrees, the truth does not."""

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        class Rounding:
            def resolve_data(self, item: Any) -> Any:
                data = planner.resolve_data(item)
                if isinstance(data, torch.Tensor) and data.dtype == torch.float32:
                    return data.to(torch.float16).to(torch.float32)
                return data

        return super().write_data(plan, Rounding())  # type: ignore[arg-type]


class EarlyCommitWriter(DictWriter):
    """The coordinator publishes a checkpoint from write_data, before other ranks wrote."""

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        if self.is_coordinator:
            import pickle

            self.store.commit(self.location, pickle.dumps(Metadata({})), set())
        return super().write_data(plan, planner)


class SwallowingWriter(DictWriter):
    """Catches errors while writing and reports the item as written anyway."""

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        results = []
        for n, item in enumerate(plan.items):
            try:
                data = planner.resolve_data(item)
                raw = (
                    data.getvalue()
                    if item.type == WriteItemType.BYTE_IO and isinstance(data, io.BytesIO)
                    else _tensor_bytes(data)  # type: ignore[arg-type]
                )
            except Exception:
                raw = b""
            name = f"{self.save_id}/{plan.storage_data}{n}"
            self.store.stage(self.location, name, raw)
            results.append(WriteResult(index=item.index, size_in_bytes=len(raw), storage_data=name))
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut


class SwallowFinishWriter(DictWriter):
    """finish() hides its own failure: the save "succeeds" and nothing is committed."""

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        with contextlib.suppress(Exception):  # the fault under test
            super().finish(metadata, results)


class InPlaceWriter(DictWriter):
    """Writes data straight into the committed checkpoint: a failed save leaves it half-written."""

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        results = super().write_data(plan, planner).wait()
        with self.store.lock:
            committed = self.store.committed.get(self.location)
            if committed is not None:
                old_blobs = committed[1]
                for r in results:
                    stable = r.storage_data.split("/", 1)[1]
                    for old in list(old_blobs):
                        if old.endswith("/" + stable):
                            old_blobs[old] = self.store.staged[(self.location, r.storage_data)]
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut


class ReaderIgnoringOffsets(DictReader):
    """Copies the start of the stored chunk, ignoring ``storage_offsets``."""

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        shifted = [
            dataclasses.replace(i, storage_offsets=torch.Size([0] * len(i.storage_offsets)))
            for i in plan.items
        ]
        return super().read_data(dataclasses.replace(plan, items=shifted), planner)


@pytest.mark.spec("CONF-15", "CONF-30", "CONF-40")
def test_reader_ignoring_offsets_is_caught_by_partial_reads() -> None:
    @dataclasses.dataclass
    class Broken(DictBackend):
        def reader(self, location: Any) -> StorageReader:
            return ReaderIgnoringOffsets(self.store, location)

    results = _by_id(run_checks(Broken(), only={"CONF-10", "CONF-15", "CONF-30"}))
    assert results["CONF-10"].status == "pass"  # whole-tensor reads are unaffected
    assert results["CONF-15"].status == "fail" and "differs" in results["CONF-15"].reason
    assert results["CONF-30"].status == "fail"


def _broken(writer_cls: type[DictWriter]) -> DictBackend:
    @dataclasses.dataclass
    class Broken(DictBackend):
        name: str = f"broken: {writer_cls.__name__}"

        def writer(self, location: Any, *, rank: int, thread_count: int = 1) -> StorageWriter:
            return writer_cls(self.store, location)

    return Broken()


def _by_id(results: list[Result]) -> dict[str, Result]:
    return {r.id: r for r in results}


CASES = [
    (DropsItemWriter, "CONF-8", ("CONF-8",)),
    (LossyWriter, "CONF-10", ("CONF-10", "CONF-12")),
    (EarlyCommitWriter, "CONF-21", ("CONF-21", "CONF-23")),
    (SwallowingWriter, "CONF-22", ("CONF-22",)),
    (SwallowFinishWriter, "CONF-24", ("CONF-24",)),
    (InPlaceWriter, "CONF-29", ("CONF-25", "CONF-29")),
]


@pytest.mark.spec(
    "CONF-40", "CONF-8", "CONF-10", "CONF-21", "CONF-22", "CONF-24", "CONF-29", "CONF-42"
)
@pytest.mark.parametrize(
    ("writer_cls", "named", "checked"), CASES, ids=[c[0].__name__ for c in CASES]
)
def test_broken_backend_is_caught_by_its_requirement(
    writer_cls: type[DictWriter], named: str, checked: tuple[str, ...]
) -> None:
    results = _by_id(run_checks(_broken(writer_cls), only=checked, examples=3))
    assert results[named].status == "fail", results[named]
    assert named in results[named].reason
    assert any(r.id == named for r in failed_musts(results.values()))


@pytest.mark.spec("CONF-40", "CONF-8", "CONF-10", "CONF-21", "CONF-22", "CONF-29")
def test_the_unbroken_example_passes_the_same_checks() -> None:
    wanted = {rid for _, _, checked in CASES for rid in checked}
    results = run_checks(DictBackend(), only=wanted, examples=3)
    assert {r.id for r in results} == wanted
    assert all(r.status == "pass" for r in results), [r for r in results if r.status != "pass"]


@pytest.mark.spec("CONF-25", "CONF-42")
def test_a_failed_should_is_a_warning_not_a_failure() -> None:
    @dataclasses.dataclass
    class NotAtomic(DictBackend):
        name: str = "in-place, atomic_overwrite not declared"

        def writer(self, location: Any, *, rank: int, thread_count: int = 1) -> StorageWriter:
            return InPlaceWriter(self.store, location)

    backend = NotAtomic()
    backend.capabilities = dataclasses.replace(backend.capabilities, atomic_overwrite=False)
    results = _by_id(run_checks(backend, only={"CONF-25", "CONF-29"}, examples=3))
    assert results["CONF-25"].status == "fail" and results["CONF-25"].level == "SHOULD"
    assert results["CONF-29"].status == "n/a"
    assert "atomic_overwrite" in results["CONF-29"].reason
    assert not failed_musts(results.values())
