"""FileSystemWriter / FileSystemReader: torch's on-disk layout with an atomic commit.

See spec/storage.md (STORE-*, INTEG-*) and spec/format.md (FMT-*).
"""

from __future__ import annotations

import dataclasses
import io
import math
import os
import warnings
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import FileSystem, _StorageInfo, _StoragePrefix
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from refdcp.errors import RefdcpError
from refdcp.storage import layout
from refdcp.storage.checked_read import read_checked_into
from refdcp.storage.errors import CheckpointExistsError, CorruptionError
from refdcp.storage.items import (
    ChunkIndex,
    Encoded,
    checksum_of,
    copy_into_destination,
    data_offset_of,
    encode_bytes,
    encode_tensor,
    load_tensor_from_blob,
    make_storage_info,
    narrow,
    raw_view,
    verify_blob,
    whole_chunk,
)
from refdcp.storage.safe_metadata import dump_metadata, load_metadata

__all__ = ["FileSystemReader", "FileSystemWriter", "split_into_buckets"]

_DCP_VERSION = "1.0.0"
_FLUSH_BYTES = 4 << 20
_MAX_IOV = 512


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _item_nbytes(item: WriteItem) -> int:
    assert item.tensor_data is not None
    return (
        item.tensor_data.size.numel()
        * torch.empty((), dtype=item.tensor_data.properties.dtype).element_size()
    )


def split_into_buckets(n: int, items: list[WriteItem]) -> list[list[WriteItem]]:
    """torch's bucketing: bytes items round-robin, tensors largest first into the lightest bucket (STORE-8)."""
    if n <= 1:
        return [list(items)]
    buckets: list[list[WriteItem]] = [[] for _ in range(n)]
    loads = [0] * n
    byte_items = [i for i in items if i.type == WriteItemType.BYTE_IO]
    tensor_items = sorted(
        (i for i in items if i.type != WriteItemType.BYTE_IO), key=_item_nbytes, reverse=True
    )
    for k, item in enumerate(byte_items):
        buckets[k % n].append(item)
    for item in tensor_items:
        k = loads.index(min(loads))
        buckets[k].append(item)
        loads[k] += _item_nbytes(item)
    return buckets


class _FileOut:
    """Gathers small buffers and writes them with ``os.writev``; large ones go straight out."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.pending: list[Any] = []
        self.keep: list[Any] = []
        self.pending_bytes = 0
        self.position = 0

    def write(self, parts: Iterable[Any], keepalive: Any = None) -> None:
        # ``keepalive`` owns the memory of ``parts``; it is recorded after the
        # loop because a flush inside it clears ``keep`` while later parts of
        # this very item may still be pending (they must not be freed first).
        for part in parts:
            n = len(part)
            if n == 0:
                continue
            if n >= _FLUSH_BYTES:
                self.flush()
                self._write_all([part])
            else:
                self.pending.append(part)
                self.pending_bytes += n
                if self.pending_bytes >= _FLUSH_BYTES or len(self.pending) >= _MAX_IOV:
                    self.flush()
            self.position += n
        if keepalive is not None:
            self.keep.append(keepalive)

    def flush(self) -> None:
        if self.pending:
            self._write_all(self.pending)
            self.pending = []
            self.pending_bytes = 0
        self.keep.clear()

    def _write_all(self, parts: list[Any]) -> None:
        views = [memoryview(p).cast("B") for p in parts]
        while views:
            written = os.writev(self.fd, views)
            while views and written >= len(views[0]):
                written -= len(views[0])
                views.pop(0)
            if views and written:
                views[0] = views[0][written:]


class _AtPath:
    """A checkpoint location on the local filesystem, accepted as torch's are (STORE-10)."""

    path: Path

    @property
    def checkpoint_id(self) -> str | os.PathLike[str]:
        return self.path

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """Same rule as torch's FileSystemWriter and FileSystemReader (STORE-10)."""
        return bool(FileSystem.validate_checkpoint_id(checkpoint_id))


class FileSystemWriter(_AtPath, StorageWriter):
    """A torch ``StorageWriter`` writing torch's layout with refdcp's commit (STORE-1..STORE-9).

    Data files get names unique to this save (``__{rank}_{n}.{token}.distcp``);
    ``.metadata`` is written to a temporary name, fsynced and atomically
    renamed over the old one; unreferenced files are removed after commit.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        single_file_per_rank: bool = True,
        sync_files: bool = True,
        thread_count: int = 1,
        per_thread_copy_ahead: int = 10_000_000,
        cache_staged_state_dict: bool = False,
        overwrite: bool = True,
        _extensions: Any = None,
        serialization_format: Any = None,
    ) -> None:
        super().__init__()
        _refuse_torch_only_options(_extensions, serialization_format)
        if thread_count < 1:
            raise ValueError(f"thread_count must be >= 1, got {thread_count}")
        self.path = Path(path)
        self.single_file_per_rank = single_file_per_rank
        self.sync_files = sync_files
        self.thread_count = thread_count
        self.per_thread_copy_ahead = per_thread_copy_ahead
        self.cache_staged_state_dict = cache_staged_state_dict
        self.overwrite = overwrite
        self.save_id = layout.new_save_token()
        self.rank: int | None = None
        self.use_collectives = True
        self.is_coordinator = False

    # -- protocol ---------------------------------------------------------------------------
    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id:
            self.path = Path(checkpoint_id)
        self.save_id = layout.new_save_token()

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        self.rank = kwargs.get("rank")
        self.save_id = layout.new_save_token()  # fresh names for every save (STORE-2)
        self.use_collectives = bool(kwargs.get("use_collectives", True))

    def _metadata_rank(self) -> int | None:
        return None if self.use_collectives or self.rank is None else self.rank

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        self.path.mkdir(parents=True, exist_ok=True)
        existing = self.path / layout.rank_metadata_name(
            None if self.use_collectives or self.rank is None else 0
        )
        if existing.exists() and not self.overwrite:
            raise CheckpointExistsError(
                f"a committed checkpoint already exists at {self.path} and overwrite=False"
            )
        if self.rank is not None and not self.use_collectives:
            plan = dataclasses.replace(plan, storage_data=_StoragePrefix(f"__{self.rank}_"))
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return layout.assign_rank_prefixes(plans)

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        prefix = layout.plan_prefix(plan)
        if self.single_file_per_rank:
            groups = split_into_buckets(self.thread_count, list(plan.items))
        else:
            groups = [[item] for item in plan.items]
        jobs = [
            (layout.data_file_name(prefix, n, self.save_id), items)
            for n, items in enumerate(groups)
        ]
        if self.thread_count > 1 and len(jobs) > 1:
            with ThreadPoolExecutor(self.thread_count, thread_name_prefix="refdcp-write") as pool:
                per_file = list(
                    pool.map(lambda job: self._write_file(job[0], job[1], planner), jobs)
                )
        else:
            per_file = [self._write_file(name, items, planner) for name, items in jobs]
        if self.sync_files:
            _fsync_dir(self.path)
        fut: Future[list[WriteResult]] = Future()
        fut.set_result([r for results in per_file for r in results])
        return fut

    def _write_file(
        self, name: str, items: list[WriteItem], planner: SavePlanner
    ) -> list[WriteResult]:
        results: list[WriteResult] = []
        fd = os.open(self.path / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            out = _FileOut(fd)
            ordered = [i for i in items if i.type == WriteItemType.BYTE_IO] + [
                i for i in items if i.type != WriteItemType.BYTE_IO
            ]
            for item in ordered:
                data = planner.resolve_data(item)
                enc: Encoded
                if item.type == WriteItemType.BYTE_IO:
                    if not isinstance(data, io.BytesIO | bytes):
                        raise RefdcpError(f"{item.index.fqn}: BYTE_IO data must be io.BytesIO")
                    enc = encode_bytes(data)
                else:
                    if not isinstance(data, torch.Tensor):
                        raise RefdcpError(f"{item.index.fqn}: tensor item resolved to {type(data)}")
                    enc = encode_tensor(data)
                offset = out.position
                out.write(enc.parts, enc)
                info = make_storage_info(name, offset, enc)
                results.append(
                    WriteResult(index=item.index, size_in_bytes=enc.length, storage_data=info)
                )
            out.flush()
            if self.sync_files:
                os.fsync(fd)
        finally:
            os.close(fd)
        return results

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        metadata.version = _DCP_VERSION
        storage_md: dict[Any, Any] = {}
        for rank_results in results:
            for wr in rank_results:
                storage_md[wr.index] = wr.storage_data
        metadata.storage_data = storage_md
        metadata.storage_meta = self.storage_meta()
        blob = dump_metadata(metadata)
        rank = self._metadata_rank()
        tmp = self.path / layout.metadata_temp_name(rank, self.save_id)
        final = self.path / layout.rank_metadata_name(rank)
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                out = _FileOut(fd)
                out.write([blob])
                out.flush()
                if self.sync_files:
                    os.fsync(fd)
            finally:
                os.close(fd)
            if self.sync_files:
                _fsync_dir(self.path)
            os.replace(tmp, final)  # the commit point (STORE-1)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        if self.sync_files:
            _fsync_dir(self.path)
        self._clean_up(storage_md, rank)

    def _clean_up(self, storage_md: dict[Any, Any], rank: int | None) -> None:
        """Remove data and temp files the committed metadata does not reference (STORE-5)."""
        keep = {
            info.relative_path for info in storage_md.values() if isinstance(info, _StorageInfo)
        }
        own_prefix = None if rank is None else f"__{rank}_"
        try:
            names = os.listdir(self.path)
        except OSError:
            return
        for name in names:
            stale_data = layout.is_data_file(name) and name not in keep
            if own_prefix is not None and not name.startswith(own_prefix):
                stale_data = False
            stale_tmp = rank is None and layout.is_metadata_temp(name)
            if stale_data or stale_tmp:
                try:
                    os.unlink(self.path / name)
                except OSError as exc:
                    warnings.warn(f"could not remove stale file {name}: {exc}", stacklevel=2)

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.path, save_id=self.save_id)


class FileSystemReader(_AtPath, StorageReader):
    """A torch ``StorageReader`` for torch's layout, with safe metadata and fast reads.

    Reads refdcp and torch checkpoints (FMT-5); by default every item that
    carries a CRC-32C is checked as it is read (LOAD-10); ``set_verify(True)``
    checks every item before it is delivered and requires checksums (INTEG-4);
    ``set_verify(False)`` checks nothing.
    """

    def __init__(self, path: str | os.PathLike[str], _extension_registry: Any = None) -> None:
        # torch's ``_extension_registry`` decodes stream transforms; refdcp's reader
        # refuses transformed items by name when it meets one, so it is accepted and unused
        super().__init__()
        self.path = Path(path)
        self.storage_data: dict[Any, Any] = {}
        self.load_id = layout.new_save_token()
        self.verify = False
        self.verify_available = True
        self.rank: int | None = None
        self.use_collectives = True
        self._chunks: ChunkIndex | None = None
        self._verified: set[tuple[str, int]] = set()

    def set_verify(self, verify: bool | None) -> None:
        """True: check every item before delivering it, requiring checksums (INTEG-4);
        None: check the items that carry a checksum (LOAD-10); False: check nothing."""
        self.verify = verify is True
        self.verify_available = verify is not False

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self.storage_data = {}
        if checkpoint_id:
            self.path = Path(checkpoint_id)
        self.load_id = layout.new_save_token()

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        name = layout.rank_metadata_name(kwargs.get("rank"))
        with open(self.path / name, "rb") as f:
            data = f.read()
        metadata = load_metadata(data, file=str(self.path / name))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        assert metadata.storage_meta is not None
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        if metadata.storage_data is None:
            raise RefdcpError("metadata has no storage_data: not a filesystem checkpoint")
        self.storage_data = metadata.storage_data
        self.rank = kwargs.get("rank")
        self.use_collectives = bool(kwargs.get("use_collectives", True))
        self._chunks = ChunkIndex(metadata)
        self._verified = set()

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        per_file: dict[str, list[tuple[int, ReadItem, Any]]] = {}
        for req in plan.items:
            info = self.storage_data[req.storage_index]
            if getattr(info, "transform_descriptors", None):
                raise RefdcpError(
                    f"{req.storage_index.fqn}: stream transforms {info.transform_descriptors} "
                    "are not supported by refdcp's FileSystemReader"
                )
            per_file.setdefault(info.relative_path, []).append((info.offset, req, info))
        for relative_path, reqs in per_file.items():
            reqs.sort(key=lambda r: r[0])
            fd = os.open(self.path / relative_path, os.O_RDONLY)
            try:
                size = os.fstat(fd).st_size
                for offset, req, info in reqs:
                    if offset + info.length > size:
                        raise CorruptionError(
                            f"data file truncated ({size} bytes, item needs {offset + info.length})",
                            fqn=req.storage_index.fqn,
                            file=relative_path,
                            offset=min(size, offset + info.length),
                        )
                for _, req, info in reqs:
                    self._read_item(fd, relative_path, req, info, planner)
            finally:
                os.close(fd)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _read_item(
        self, fd: int, relative_path: str, req: ReadItem, info: Any, planner: LoadPlanner
    ) -> None:
        fqn = req.storage_index.fqn
        checked = self.verify or (self.verify_available and checksum_of(info) is not None)
        partial = checked and not self.verify and not self._whole_or_verified(req, info)
        if (
            req.type == LoadItemType.BYTE_IO
            or self.verify
            or partial
            or data_offset_of(info) is None
        ):
            blob = bytearray(info.length)
            got = _pread_into(fd, memoryview(blob), info.offset)
            if checked:
                self._verified.add((relative_path, int(info.offset)))
                verify_blob(memoryview(blob)[:got], info, fqn, relative_path)
            if got != info.length:
                raise CorruptionError(
                    "data file truncated", fqn=fqn, file=relative_path, offset=info.offset + got
                )
            if req.type == LoadItemType.BYTE_IO:
                planner.load_bytes(req, io.BytesIO(blob))
                return
            assert self._chunks is not None
            load_tensor_from_blob(
                memoryview(blob), info, self._chunks.lookup(req.storage_index), req, planner
            )
            return
        assert self._chunks is not None
        chunk = self._chunks.lookup(req.storage_index)
        if chunk is None:
            raise RefdcpError(f"{fqn}: chunk {req.storage_index.offset} is not in the metadata")
        dtype, sizes = chunk
        start = info.offset + (data_offset_of(info) or 0)
        if whole_chunk(req, sizes):
            target = planner.resolve_tensor(req).detach()
            if (
                target.device.type == "cpu"
                and target.dtype == dtype
                and tuple(target.shape) == tuple(sizes)
                and target.is_contiguous()
            ):
                self._read_into(fd, raw_view(target), start, info, fqn, relative_path, checked)
                planner.commit_tensor(req, target)
                return
            stored = torch.empty(sizes, dtype=dtype)
            self._read_into(fd, raw_view(stored), start, info, fqn, relative_path, checked)
            if target.size() != stored.size():
                raise RefdcpError(
                    f"read {fqn}: destination size {tuple(target.size())} != stored size {tuple(stored.size())}"
                )
            target.copy_(stored)
            planner.commit_tensor(req, target)
            return
        # a resharded read: fetch only the rows of the saved chunk it overlaps (row-major
        # storage makes them one contiguous byte range), then narrow the other dims (STORE-16)
        first, count = int(req.storage_offsets[0]), int(req.lengths[0])
        row_bytes = math.prod(sizes[1:]) * dtype.itemsize
        rows = torch.empty((count, *sizes[1:]), dtype=dtype)
        _read_exact(fd, raw_view(rows), start + first * row_bytes, fqn, relative_path)
        offsets = torch.Size((0, *req.storage_offsets[1:]))
        copy_into_destination(planner, req, narrow(rows, offsets, req.lengths))

    def _whole_or_verified(self, req: ReadItem, info: Any) -> bool:
        """A read of a whole chunk, or of a chunk already checked during this load (LOAD-10)."""
        if (info.relative_path, int(info.offset)) in self._verified:
            return True
        chunk = self._chunks.lookup(req.storage_index) if self._chunks is not None else None
        return chunk is not None and whole_chunk(req, chunk[1])

    @staticmethod
    def _read_into(
        fd: int, view: memoryview, start: int, info: Any, fqn: str, file: str, checked: bool
    ) -> None:
        if checked:
            read_checked_into(fd, view, info, fqn, file)
        else:
            _read_exact(fd, view, start, fqn, file)


def _refuse_torch_only_options(extensions: Any, serialization_format: Any) -> None:
    """torch's stream transforms and safetensors format are not implemented: say so (API-10)."""
    if extensions:
        raise ValueError(
            "refdcp's FileSystemWriter does not apply stream transforms (_extensions); "
            "use torch's FileSystemWriter for them"
        )
    fmt = getattr(serialization_format, "value", serialization_format)
    if fmt not in (None, "torch_save"):
        raise ValueError(
            f"refdcp's FileSystemWriter writes SerializationFormat.TORCH_SAVE only, not {fmt!r}"
        )


def _pread_into(fd: int, view: memoryview, offset: int) -> int:
    total = 0
    while total < len(view):
        n = os.preadv(fd, [view[total:]], offset + total)
        if n == 0:
            break
        total += n
    return total


def _read_exact(fd: int, view: memoryview, offset: int, fqn: str, file: str) -> None:
    got = _pread_into(fd, view, offset)
    if got != len(view):
        raise CorruptionError("data file truncated", fqn=fqn, file=file, offset=offset + got)
