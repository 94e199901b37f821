"""Round 2 of the conformance suite: broken backends it used to pass, each now failing the
requirement that names its defect with exit status 1, and nothing else (no cascades)."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import pickle
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from conformance.backend import Capabilities
from conformance.examples.dict_backend import DictBackend, DictReader, DictWriter, _tensor_bytes
from conformance.registry import Result
from conformance.runner import failed_musts, run_checks

pytestmark = [
    pytest.mark.timeout(240),
    pytest.mark.filterwarnings("ignore:Detected an existing checkpoint"),
]


def by_id(results: list[Result]) -> dict[str, Result]:
    return {r.id: r for r in results}


def failing(results: list[Result]) -> set[str]:
    return {r.id for r in results if r.status == "fail"}


def with_writer(cls: type[DictWriter], **caps: bool) -> DictBackend:
    backend = DictBackend(name=f"broken: {cls.__name__}")
    backend.writer = lambda location, *, rank, thread_count=1: cls(  # type: ignore[method-assign]
        backend.store, location, thread_count
    )
    backend.capabilities = dataclasses.replace(backend.capabilities, **caps)
    return backend


def with_reader(cls: type[DictReader]) -> DictBackend:
    backend = DictBackend(name=f"broken: {cls.__name__}")
    backend.reader = lambda location: cls(backend.store, location)  # type: ignore[method-assign]
    return backend


class _Transforming(DictWriter):
    """Stores what ``transform`` makes of each tensor; its own reader agrees, the truth not."""

    def transform(self, t: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        outer = self

        class Wrapped:
            def resolve_data(self, item: Any) -> Any:
                data = planner.resolve_data(item)
                return outer.transform(data) if isinstance(data, torch.Tensor) else data

        return super().write_data(plan, Wrapped())  # type: ignore[arg-type]


# --- sizes (CONF-46) -------------------------------------------------------------------------


class DropsPartWriter(_Transforming):
    """A chunked upload that loses its second 5 MiB part: only tensors over 5 MiB suffer."""

    def transform(self, t: torch.Tensor) -> torch.Tensor:
        raw = t.detach().contiguous().reshape(-1).view(torch.uint8).clone()
        part = 5 * 2**20
        raw[part : 2 * part] = 0
        return raw.view(t.dtype).reshape(t.shape)


class BoundaryOffByOneWriter(_Transforming):
    """A buffered writer that drops the byte after each 4 KiB buffer (copies 4095 of 4096)."""

    def transform(self, t: torch.Tensor) -> torch.Tensor:
        raw = t.detach().contiguous().reshape(-1).view(torch.uint8).clone()
        if raw.numel() > 4096:
            raw[4096::4096] = 0
        return raw.view(t.dtype).reshape(t.shape)


@pytest.mark.spec("CONF-46", "CONF-42")
@pytest.mark.slow  # long; make test-thorough runs it
def test_a_writer_damaging_only_large_tensors_fails_conf_46_and_the_crossed_cases() -> None:
    results = run_checks(with_writer(DropsPartWriter), examples=2)
    # CONF-61 crosses the 6 MiB size with the other dimensions, so it sees the defect too
    assert failing(results) == {"CONF-46", "CONF-61"}, [r for r in results if r.status == "fail"]
    reason = by_id(results)["CONF-46"].reason
    assert "bytes_6MiB_plus_4" in reason and "first at byte 5242880" in reason
    assert [r.id for r in failed_musts(results)] == ["CONF-46", "CONF-61"]
    # the defect needs a whole 6 MiB item: chunks of it stay below the damaged offset
    assert "every failing case has chunks=1 and size=6MiB+4" in by_id(results)["CONF-61"].reason


@pytest.mark.spec("CONF-46")
def test_a_writer_damaging_buffer_boundaries_fails_conf_46() -> None:
    results = by_id(run_checks(with_writer(BoundaryOffByOneWriter), only={"CONF-46", "CONF-10"}))
    assert results["CONF-46"].status == "fail" and "bytes_4097" in results["CONF-46"].reason
    assert results["CONF-10"].status == "pass"  # every CONF-10 tensor is under 4 KiB


# --- special values under CONF-10 ------------------------------------------------------------


class HalfThroughFloatWriter(_Transforming):
    """Stores float16 and bfloat16 through float32: NaN payloads (and bf16 NaN signs) normalised."""

    def transform(self, t: torch.Tensor) -> torch.Tensor:
        if t.dtype in (torch.float16, torch.bfloat16):
            return t.float().to(t.dtype)
        return t


class BFloat16ThroughFloatWriter(_Transforming):
    def transform(self, t: torch.Tensor) -> torch.Tensor:
        return t.float().to(t.dtype) if t.dtype == torch.bfloat16 else t


@pytest.mark.spec("CONF-10", "CONF-52", "CONF-42")
@pytest.mark.slow  # long; make test-thorough runs it
def test_nan_payload_normalisation_fails_conf_10_alone() -> None:
    results = run_checks(with_writer(HalfThroughFloatWriter), examples=2)
    assert failing(results) == {"CONF-10"}, [r for r in results if r.status == "fail"]
    assert "float16.special" in by_id(results)["CONF-10"].reason


@pytest.mark.spec("CONF-10")
def test_bfloat16_through_float32_fails_conf_10() -> None:
    results = by_id(run_checks(with_writer(BFloat16ThroughFloatWriter), only={"CONF-10"}))
    assert results["CONF-10"].status == "fail"
    assert "bfloat16.special" in results["CONF-10"].reason


# --- stale data after overwrite (CONF-47) ----------------------------------------------------


class MergingFinishWriter(DictWriter):
    """finish merges the new metadata into the committed one, as an append-only index would:
    keys of the earlier checkpoint stay listed and are served from its blobs."""

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        storage = {r.index: r.storage_data for rs in results for r in rs}
        old_blobs: dict[str, bytes] = {}
        with self.store.lock:
            if self.location in self.store.committed:
                raw, old_blobs = self.store.committed[self.location]
                old: Metadata = pickle.loads(raw)
                for key, md in old.state_dict_metadata.items():
                    metadata.state_dict_metadata.setdefault(key, md)
                for index, name in dict(old.storage_data).items():
                    if index.fqn not in {i.fqn for i in storage}:
                        storage[index] = name
        metadata.storage_data = storage
        blob = pickle.dumps(metadata)
        with self.store.lock:
            blobs = {
                n: self.store.staged.pop((self.location, n))
                for n in set(storage.values())
                if (self.location, n) in self.store.staged
            }
            blobs.update({n: b for n, b in old_blobs.items() if n in set(storage.values())})
            self.store.committed[self.location] = (blob, blobs)


@pytest.mark.spec("CONF-47", "CONF-26", "CONF-42")
def test_an_overwrite_serving_stale_keys_fails_conf_47() -> None:
    results = by_id(
        run_checks(with_writer(MergingFinishWriter), only={"CONF-26", "CONF-47"}, examples=2)
    )
    assert results["CONF-26"].status == "pass"  # every key of the new save is right
    assert results["CONF-47"].status == "fail"
    assert "layer1.weight" in results["CONF-47"].reason  # a key only the old save wrote


# --- reset() that does nothing (CONF-1) ------------------------------------------------------


class IgnoresResetWriter(DictWriter):
    def reset(self, checkpoint_id: Any = None) -> None:
        self.save_id = uuid.uuid4().hex  # keeps the construction location


class IgnoresResetReader(DictReader):
    def reset(self, checkpoint_id: Any = None) -> None:
        return None


@pytest.mark.spec("CONF-1", "CONF-42")
def test_writer_and_reader_ignoring_reset_fail_conf_1() -> None:
    backend = with_writer(IgnoresResetWriter)
    backend.reader = lambda location: IgnoresResetReader(  # type: ignore[method-assign]
        backend.store, location
    )
    result = by_id(run_checks(backend, only={"CONF-1"}))["CONF-1"]
    assert result.status == "fail" and "reset" in result.reason


@pytest.mark.spec("CONF-1")
def test_a_reader_ignoring_reset_fails_conf_1() -> None:
    result = by_id(run_checks(with_reader(IgnoresResetReader), only={"CONF-1"}))["CONF-1"]
    assert result.status == "fail"
    assert "reader built for another location" in result.reason


# --- commit_tensor (CONF-49) -----------------------------------------------------------------


class NoCommitReader(DictReader):
    """Fills the tensors resolve_tensor returns and never calls planner.commit_tensor."""

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        class NoCommit:
            def __getattr__(self, name: str) -> Any:
                return getattr(planner, name)

            def commit_tensor(self, read_item: Any, tensor: torch.Tensor) -> None:
                return None

        return super().read_data(plan, NoCommit())  # type: ignore[arg-type]


@pytest.mark.spec("CONF-49", "CONF-42")
def test_a_reader_skipping_commit_tensor_fails_conf_49_alone() -> None:
    results = by_id(run_checks(with_reader(NoCommitReader), examples=2))
    assert {r for r, res in results.items() if res.status == "fail"} == {"CONF-49"}
    assert "never called planner.commit_tensor" in results["CONF-49"].reason


@pytest.mark.spec("CONF-49")
def test_the_example_reader_calls_commit_tensor() -> None:
    assert run_checks(DictBackend(), only={"CONF-49"})[0].status == "pass"


# --- torn commit under a crash (CONF-48) -----------------------------------------------------


class FileWriter(StorageWriter):
    """A file-backed store shared between processes: blobs named per save, the metadata
    published by ``os.replace`` (atomic) or, with ``torn``, rewritten in place."""

    torn = False

    def __init__(self, location: str) -> None:
        super().__init__()
        self.location = location
        self.save_id = uuid.uuid4().hex

    def reset(self, checkpoint_id: Any = None) -> None:
        if checkpoint_id is not None:
            self.location = str(checkpoint_id)
        self.save_id = uuid.uuid4().hex

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        Path(self.location, "blobs").mkdir(parents=True, exist_ok=True)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return [dataclasses.replace(p, storage_data=f"r{i}_") for i, p in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        results = []
        for n, item in enumerate(plan.items):
            data = planner.resolve_data(item)
            raw = (
                data.getvalue() if item.type == WriteItemType.BYTE_IO else _tensor_bytes(data)  # type: ignore[arg-type]
            )
            name = f"{self.save_id}_{plan.storage_data}{n}"
            Path(self.location, "blobs", name).write_bytes(raw)
            results.append(WriteResult(index=item.index, size_in_bytes=len(raw), storage_data=name))
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        metadata.storage_data = {r.index: r.storage_data for rs in results for r in rs}
        blob = pickle.dumps(metadata)
        final = Path(self.location, ".metadata")
        if self.torn:  # the defect: rewrite in place, in two writes
            with open(final, "wb") as f:
                f.write(blob[: len(blob) // 2])
                f.flush()
                f.write(blob[len(blob) // 2 :])
            return
        tmp = final.with_name(f".metadata.{self.save_id}")
        tmp.write_bytes(blob)
        os.replace(tmp, final)

    def storage_meta(self) -> Any:
        return None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return True


class TornFileWriter(FileWriter):
    torn = True


class FileReader(StorageReader):
    def __init__(self, location: str) -> None:
        super().__init__()
        self.location = location
        self.names: dict[MetadataIndex, str] = {}

    def reset(self, checkpoint_id: Any = None) -> None:
        if checkpoint_id is not None:
            self.location = str(checkpoint_id)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        md = pickle.loads(Path(self.location, ".metadata").read_bytes())
        assert isinstance(md, Metadata)
        return md

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *a: Any, **k: Any
    ) -> None:
        self.names = dict(metadata.storage_data)

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        for item in plan.items:
            raw = Path(self.location, "blobs", self.names[item.storage_index]).read_bytes()
            if item.type == LoadItemType.BYTE_IO:
                planner.load_bytes(item, io.BytesIO(raw))
                continue
            stored = torch.load(io.BytesIO(raw), weights_only=True)
            for dim, (start, length) in enumerate(zip(item.storage_offsets, item.lengths)):
                stored = stored.narrow(dim, start, length)
            target = planner.resolve_tensor(item).detach()
            target.copy_(stored)
            planner.commit_tensor(item, target)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return True


@dataclasses.dataclass
class FileBackend:
    writer_cls: type[FileWriter] = FileWriter
    name: str = "test FileBackend"
    capabilities: Capabilities = dataclasses.field(
        default_factory=lambda: Capabilities(atomic_overwrite=True)
    )

    def new_location(self, scratch: Path) -> Any:
        return str(scratch / "ckpt")

    def writer(self, location: Any, *, rank: int, thread_count: int = 1) -> StorageWriter:
        return self.writer_cls(location)

    def reader(self, location: Any) -> StorageReader:
        return FileReader(location)


@pytest.mark.spec("CONF-48", "CONF-42")
def test_a_metadata_rewrite_in_place_is_torn_by_a_kill_and_fails_conf_48() -> None:
    results = by_id(
        run_checks(FileBackend(TornFileWriter), only={"CONF-25", "CONF-29", "CONF-48"}, examples=2)
    )
    assert results["CONF-29"].status == "pass"  # no injected exception finds the defect
    assert results["CONF-48"].status == "fail", results["CONF-48"]
    reason = results["CONF-48"].reason
    assert "SIGKILL" in reason and "inside finish" in reason and "read_metadata raised" in reason


@pytest.mark.spec("CONF-48", "CONF-57")
def test_an_atomic_file_backend_passes_conf_48_and_memory_is_not_applicable() -> None:
    assert run_checks(FileBackend(), only={"CONF-48"})[0].status == "pass"
    result = run_checks(DictBackend(), only={"CONF-48"})[0]
    assert result.status == "n/a" and "not shared between processes" in result.reason


# --- bytes items belong to CONF-13 alone -----------------------------------------------------


class TensorOnlyWriter(DictWriter):
    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        if any(i.type == WriteItemType.BYTE_IO for i in plan.items):
            raise TypeError("this storage holds tensors only")
        return super().write_data(plan, planner)


@pytest.mark.spec("CONF-13", "CONF-52", "CONF-42")
@pytest.mark.slow  # long; make test-thorough runs it
def test_a_tensor_only_backend_fails_conf_13_alone_or_declares_it() -> None:
    results = run_checks(with_writer(TensorOnlyWriter), examples=2)
    assert failing(results) == {"CONF-13"}, [r for r in results if r.status == "fail"]
    assert "tensors only" in by_id(results)["CONF-13"].reason
    declared = by_id(run_checks(with_writer(TensorOnlyWriter, bytes_items=False), examples=2))
    assert declared["CONF-13"].status == "n/a" and "bytes_items" in declared["CONF-13"].reason
    assert not failed_musts(declared.values())


# --- each broken backend makes the command exit 1, naming its requirement --------------------


def broken_large_tensors() -> DictBackend:
    return with_writer(DropsPartWriter)


def broken_nan_payloads() -> DictBackend:
    return with_writer(HalfThroughFloatWriter)


def broken_stale_keys() -> DictBackend:
    return with_writer(MergingFinishWriter)


def broken_reset() -> DictBackend:
    return with_writer(IgnoresResetWriter)


def broken_commit_tensor() -> DictBackend:
    return with_reader(NoCommitReader)


def broken_torn_finish() -> FileBackend:
    return FileBackend(TornFileWriter)


def broken_tensor_only() -> DictBackend:
    return with_writer(TensorOnlyWriter)


EXIT_CASES = [
    ("broken_large_tensors", "CONF-46"),
    ("broken_nan_payloads", "CONF-10"),
    ("broken_stale_keys", "CONF-47"),
    ("broken_reset", "CONF-1"),
    ("broken_commit_tensor", "CONF-49"),
    ("broken_torn_finish", "CONF-48"),
    ("broken_tensor_only", "CONF-13"),
]


@pytest.mark.spec("CONF-1", "CONF-10", "CONF-13", "CONF-46", "CONF-47", "CONF-48", "CONF-49")
@pytest.mark.parametrize(("factory", "requirement"), EXIT_CASES, ids=[c[0] for c in EXIT_CASES])
def test_each_broken_backend_exits_1_on_its_requirement(
    factory: str, requirement: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from conformance.cli import conformance_command

    out = tmp_path / "r.json"
    target = f"tests.test_conformance_blind_spots:{factory}"
    rc = conformance_command(target, json_path=str(out), examples=2, only=[requirement])
    assert rc == 1, capsys.readouterr().out
    (result,) = json.loads(out.read_text())["results"]
    assert result["id"] == requirement and result["status"] == "fail"
    assert result["reason"].startswith(requirement)
