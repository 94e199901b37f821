"""A complete, conforming example backend: checkpoints in a Python dict (conformance/README.md).

It shows the whole contract in ~150 lines: a writer that stages every save
under names unique to that save and commits by publishing the pickled
``Metadata`` in one locked assignment (so a failed save changes nothing), and
a reader that reads only through committed metadata.

Run it: ``refdcp conformance conformance.examples.dict_backend:backend``.
"""

from __future__ import annotations

import dataclasses
import io
import pickle
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from conformance.backend import Capabilities

__all__ = ["DictBackend", "DictReader", "DictStore", "DictWriter", "backend"]


class DictStore:
    """Committed checkpoints: location -> (pickled Metadata, {blob name: bytes})."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.staged: dict[tuple[str, str], bytes] = {}
        self.committed: dict[str, tuple[bytes, dict[str, bytes]]] = {}

    def stage(self, location: str, name: str, data: bytes) -> None:
        with self.lock:
            self.staged[(location, name)] = data

    def commit(self, location: str, metadata: bytes, names: set[str]) -> None:
        """Publish metadata and the blobs it names in one step (the commit point)."""
        with self.lock:
            blobs = {n: self.staged.pop((location, n)) for n in names}
            self.committed[location] = (metadata, blobs)

    def snapshot(self, location: str) -> tuple[bytes, dict[str, bytes]]:
        with self.lock:
            if location not in self.committed:
                raise FileNotFoundError(f"no committed checkpoint at {location!r}")
            return self.committed[location]


def _tensor_bytes(t: torch.Tensor) -> bytes:
    buf = io.BytesIO()
    torch.save(t.detach().cpu().contiguous().clone(), buf)
    return buf.getvalue()


class DictWriter(StorageWriter):
    """Writes one blob per item under ``{save id}/{rank prefix}{n}``; commits in ``finish``."""

    def __init__(self, store: DictStore, location: str, thread_count: int = 1) -> None:
        super().__init__()
        self.store = store
        self.location = location
        self.thread_count = thread_count
        self.save_id = uuid.uuid4().hex

    def reset(self, checkpoint_id: Any = None) -> None:
        if checkpoint_id is not None:
            self.location = str(checkpoint_id)
        self.save_id = uuid.uuid4().hex  # a fresh namespace for every save

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return [dataclasses.replace(p, storage_data=f"r{i}_") for i, p in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        def write_one(n: int, item: WriteItem) -> WriteResult:
            data = planner.resolve_data(item)
            if item.type == WriteItemType.BYTE_IO:
                assert isinstance(data, io.BytesIO)
                raw = data.getvalue()
            else:
                assert isinstance(data, torch.Tensor)
                raw = _tensor_bytes(data)
            name = f"{self.save_id}/{plan.storage_data}{n}"
            self.store.stage(self.location, name, raw)
            return WriteResult(index=item.index, size_in_bytes=len(raw), storage_data=name)

        with ThreadPoolExecutor(max_workers=self.thread_count) as pool:
            # .result() re-raises any error: never swallow it (CONF-22).
            jobs = [pool.submit(write_one, n, item) for n, item in enumerate(plan.items)]
            results = [job.result() for job in jobs]
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        storage: dict[MetadataIndex, str] = {r.index: r.storage_data for rs in results for r in rs}
        metadata.storage_data = storage
        blob = pickle.dumps(metadata)  # may raise: then nothing is committed
        self.store.commit(self.location, blob, set(storage.values()))

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.location, save_id=self.save_id)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return isinstance(checkpoint_id, str)


class DictReader(StorageReader):
    """Reads through the committed metadata only; keeps the snapshot it read."""

    def __init__(self, store: DictStore, location: str) -> None:
        super().__init__()
        self.store = store
        self.location = location
        self.blobs: dict[str, bytes] = {}
        self.storage_data: dict[MetadataIndex, str] = {}

    def reset(self, checkpoint_id: Any = None) -> None:
        if checkpoint_id is not None:
            self.location = str(checkpoint_id)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        raw, self.blobs = self.store.snapshot(self.location)
        metadata = pickle.loads(raw)
        assert isinstance(metadata, Metadata)
        return metadata

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        self.storage_data = dict(metadata.storage_data)

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        for item in plan.items:
            raw = self.blobs[self.storage_data[item.storage_index]]
            if item.type == LoadItemType.BYTE_IO:
                planner.load_bytes(item, io.BytesIO(raw))
                continue
            stored = torch.load(io.BytesIO(raw), weights_only=True)
            for dim, (start, length) in enumerate(
                zip(item.storage_offsets, item.lengths, strict=True)
            ):
                stored = stored.narrow(dim, start, length)
            target = planner.resolve_tensor(item).detach()
            if target.shape != stored.shape:
                raise ValueError(f"{item.storage_index.fqn}: box {stored.shape} != {target.shape}")
            target.copy_(stored)
            planner.commit_tensor(item, target)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return isinstance(checkpoint_id, str)


@dataclasses.dataclass
class DictBackend:
    """The Backend the suite receives: fresh locations, writers, readers, capabilities."""

    name: str = "example DictBackend"
    capabilities: Capabilities = dataclasses.field(
        default_factory=lambda: Capabilities(
            overwrite=True, atomic_overwrite=True, thread_count=True, process_async=False
        )
    )
    store: DictStore = dataclasses.field(default_factory=DictStore)
    _n: int = 0

    def new_location(self, scratch: Path) -> Any:
        self._n += 1
        return f"ckpt-{self._n}"

    def writer(self, location: Any, *, rank: int, thread_count: int = 1) -> StorageWriter:
        return DictWriter(self.store, location, thread_count)

    def reader(self, location: Any) -> StorageReader:
        return DictReader(self.store, location)


def backend() -> DictBackend:
    """The target of ``refdcp conformance conformance.examples.dict_backend:backend``."""
    return DictBackend()
