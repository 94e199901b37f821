"""In-memory storage with the filesystem's commit semantics (STORE-20..STORE-25).

``MemoryStorage`` holds committed checkpoints by id.  ``.writer(id)`` and
``.reader(id)`` give torch ``StorageWriter`` / ``StorageReader`` objects; a
save's data sits in a pending area until the coordinator's ``finish``
publishes metadata and data together under one lock, so readers see either
the old checkpoint or the new one, never a mix.  Blobs are byte-identical to
the filesystem storage's (same framing and checksums), and file names are
deterministic (``__{rank}_{n}.g{generation}.distcp``).
"""

from __future__ import annotations

import io
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
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

from refdcp.errors import RefdcpError
from refdcp.storage.errors import CheckpointExistsError, CorruptionError
from refdcp.storage.format import layout
from refdcp.storage.format.items import (
    ChunkIndex,
    checksum_of,
    encode_bytes,
    encode_tensor,
    load_tensor_from_blob,
    make_storage_info,
    verify_blob,
)
from refdcp.storage.format.records import write_result
from refdcp.storage.fs.filesystem import split_into_buckets
from refdcp.storage.metadata.safe import dump_metadata, finalize_metadata, load_metadata

__all__ = ["MemoryReader", "MemoryStorage", "MemoryWriter"]


@dataclass(frozen=True)
class _Committed:
    files: Mapping[str, bytes]  # includes ".metadata"
    generation: int


class MemoryStorage:
    """Committed checkpoints by id, thread-safe and deterministic (STORE-20)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._committed: dict[str, _Committed] = {}
        self._pending: dict[str, dict[str, bytes]] = {}
        self._generations: dict[str, int] = {}

    def writer(self, checkpoint_id: str = "default", *, overwrite: bool = True) -> MemoryWriter:
        return MemoryWriter(self, checkpoint_id, overwrite=overwrite)

    def reader(self, checkpoint_id: str = "default") -> MemoryReader:
        return MemoryReader(self, checkpoint_id)

    def ids(self) -> list[str]:
        """The committed checkpoint ids, sorted."""
        with self._lock:
            return sorted(self._committed)

    def exists(self, checkpoint_id: str) -> bool:
        with self._lock:
            return checkpoint_id in self._committed

    def files(self, checkpoint_id: str) -> dict[str, bytes]:
        """A copy of the committed checkpoint's files (name -> bytes)."""
        with self._lock:
            return dict(self._committed[checkpoint_id].files)

    def replace_file(self, checkpoint_id: str, name: str, data: bytes) -> None:
        """Overwrite one committed file's bytes: for corruption tests only."""
        with self._lock:
            old = self._committed[checkpoint_id]
            files = dict(old.files)
            files[name] = data
            self._committed[checkpoint_id] = _Committed(files, old.generation)

    def delete(self, checkpoint_id: str) -> None:
        with self._lock:
            self._committed.pop(checkpoint_id, None)
            self._pending.pop(checkpoint_id, None)

    def verify(self, checkpoint_id: str) -> Any:
        """Check every item's checksum; returns a ``VerifyReport`` (INTEG-6)."""
        from refdcp.storage.verify import verify_files

        files = self.files(checkpoint_id)
        return verify_files(files.get(layout.METADATA_NAME), files.get, str(checkpoint_id))

    # -- used by writers and readers ---------------------------------------------------------
    def _generation(self, checkpoint_id: str) -> int:
        with self._lock:
            return self._generations.get(checkpoint_id, 0) + 1

    def _stage(self, checkpoint_id: str, name: str, data: bytes) -> None:
        with self._lock:
            self._pending.setdefault(checkpoint_id, {})[name] = data

    def _commit(self, checkpoint_id: str, metadata_bytes: bytes, names: set[str]) -> None:
        with self._lock:
            pending = self._pending.get(checkpoint_id, {})
            missing = sorted(n for n in names if n not in pending)
            if missing:
                raise RefdcpError(
                    f"cannot commit {checkpoint_id!r}: data {missing} was never written"
                )
            files = {n: pending[n] for n in sorted(names)}
            files[layout.METADATA_NAME] = metadata_bytes
            generation = self._generations.get(checkpoint_id, 0) + 1
            self._generations[checkpoint_id] = generation
            self._committed[checkpoint_id] = _Committed(files, generation)
            self._pending.pop(checkpoint_id, None)

    def _snapshot(self, checkpoint_id: str) -> _Committed:
        with self._lock:
            snap = self._committed.get(checkpoint_id)
        if snap is None:
            raise FileNotFoundError(
                f"no committed checkpoint {checkpoint_id!r} in this MemoryStorage"
            )
        return snap


class MemoryWriter(StorageWriter):
    """StorageWriter into a ``MemoryStorage`` (STORE-21, STORE-22)."""

    def __init__(
        self, storage: MemoryStorage, checkpoint_id: str, *, overwrite: bool = True
    ) -> None:
        super().__init__()
        self.storage = storage
        self.checkpoint_id = checkpoint_id
        self.overwrite = overwrite
        self.rank: int | None = None
        self._generation = 0

    def reset(self, checkpoint_id: Any = None) -> None:
        if checkpoint_id:
            self.checkpoint_id = str(checkpoint_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.rank = kwargs.get("rank")

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        if not self.overwrite and self.storage.exists(self.checkpoint_id):
            raise CheckpointExistsError(
                f"Checkpoint already exists and overwrite=False: {self.checkpoint_id!r}"
            )
        self._generation = self.storage._generation(self.checkpoint_id)
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return layout.assign_rank_prefixes(plans)

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        prefix = layout.plan_prefix(plan)
        name = layout.data_file_name(prefix, 0, f"g{self._generation}")
        results: list[WriteResult] = []
        parts: list[Any] = []
        position = 0
        for items in split_into_buckets(1, list(plan.items)):
            ordered = [i for i in items if i.type == WriteItemType.BYTE_IO] + [
                i for i in items if i.type != WriteItemType.BYTE_IO
            ]
            for item in ordered:
                data = planner.resolve_data(item)
                enc = encode_tensor(data) if isinstance(data, torch.Tensor) else encode_bytes(data)
                parts.extend(bytes(p) for p in enc.parts)
                info = make_storage_info(name, position, enc)
                position += enc.length
                results.append(write_result(item.index, enc.length, info, enc.value_crc))
        self.storage._stage(self.checkpoint_id, name, b"".join(parts))
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        storage_md = finalize_metadata(metadata, results, self.storage_meta())
        names = {i.relative_path for i in storage_md.values() if isinstance(i, _StorageInfo)}
        self.storage._commit(self.checkpoint_id, dump_metadata(metadata), names)

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(
            checkpoint_id=PurePosixPath(self.checkpoint_id), save_id=f"g{self._generation}"
        )

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False


class MemoryReader(StorageReader):
    """StorageReader from a ``MemoryStorage``; pins the snapshot it read metadata from (STORE-23)."""

    def __init__(self, storage: MemoryStorage, checkpoint_id: str) -> None:
        super().__init__()
        self.storage = storage
        self.checkpoint_id = checkpoint_id
        self.verify = False
        self.verify_available = True
        self._snapshot: _Committed | None = None
        self._storage_data: dict[Any, Any] = {}
        self._chunks: ChunkIndex | None = None

    def set_verify(self, verify: bool | None) -> None:
        """True: every item, checksums required (INTEG-4); None: items that carry one
        (LOAD-10); False: none."""
        self.verify = verify is True
        self.verify_available = verify is not False

    def reset(self, checkpoint_id: Any = None) -> None:
        if checkpoint_id:
            self.checkpoint_id = str(checkpoint_id)
        self._snapshot = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        self._snapshot = self.storage._snapshot(self.checkpoint_id)
        md = load_metadata(self._snapshot.files[layout.METADATA_NAME], file=layout.METADATA_NAME)
        if md.storage_meta is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = f"g{self._snapshot.generation}"
        return md

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        if metadata.storage_data is None:
            raise RefdcpError("metadata has no storage_data")
        if self._snapshot is None:
            self._snapshot = self.storage._snapshot(self.checkpoint_id)
        self._storage_data = metadata.storage_data
        self._chunks = ChunkIndex(metadata)

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        assert self._snapshot is not None and self._chunks is not None
        for req in plan.items:
            info = self._storage_data[req.storage_index]
            fqn = req.storage_index.fqn
            data = self._snapshot.files.get(info.relative_path)
            if data is None:
                raise CorruptionError(
                    "data file missing", fqn=fqn, file=info.relative_path, offset=0
                )
            blob = memoryview(data)[info.offset : info.offset + info.length]
            if self.verify or (self.verify_available and checksum_of(info) is not None):
                verify_blob(blob, info, fqn, info.relative_path)
            elif len(blob) != info.length:
                raise CorruptionError(
                    "data file truncated",
                    fqn=fqn,
                    file=info.relative_path,
                    offset=info.offset + len(blob),
                )
            if req.type == LoadItemType.BYTE_IO:
                planner.load_bytes(req, io.BytesIO(bytes(blob)))
            else:
                load_tensor_from_blob(
                    blob, info, self._chunks.lookup(req.storage_index), req, planner
                )
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False
