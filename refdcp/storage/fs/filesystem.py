"""FileSystemWriter / FileSystemReader: torch's on-disk layout with an atomic commit.

See spec/storage.md (STORE-*, INTEG-*) and spec/format.md (FMT-*).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import io
import math
import os
import weakref
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from operator import attrgetter
from pathlib import Path
from typing import IO, Any, cast

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

from refdcp.crc.kernel import crc32c
from refdcp.crc.pieces import write_checksummed
from refdcp.errors import RefdcpError
from refdcp.storage.errors import (
    CheckpointExistsError,
    CheckpointMovedError,
    CheckpointReplacedError,
    CorruptionError,
    MissingChecksumError,
)
from refdcp.storage.format import layout
from refdcp.storage.format.items import (
    DATA_OFFSET_ATTR,
    INPLACE_MIN_BYTES,
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
from refdcp.storage.format.records import small_write_result, write_result
from refdcp.storage.format.small_tensors import small_tensor_parts
from refdcp.storage.format.tensor_values import bytes_are_values
from refdcp.storage.fs.checked_read import read_checked_into
from refdcp.storage.fs.cleanup import (
    committed_references,
    reclaim_orphans,
    remove_files,
    token_of,
    wait_until_not_live,
)
from refdcp.storage.fs.commit_mark import mark as mark_commit
from refdcp.storage.fs.inplace import FileSlice, locate_tensor_data, verify_streaming
from refdcp.storage.fs.lock import SaveLock, acquire_save_lock
from refdcp.storage.fs.metadata_file import metadata_identity, read_metadata_file_stat
from refdcp.storage.fs.paths import (
    at,
    host_identity,
    open_data_file,
    open_regular,
    opened_dir,
)
from refdcp.storage.fs.paths import pread_into as _pread_into
from refdcp.storage.fs.paths import where_is as _where_is
from refdcp.storage.fs.small_reads import SmallItem, batches_items, read_small_items
from refdcp.storage.fs.transforms import (
    WriteTransforms,
    read_transformed_item,
    write_transformed_items,
)
from refdcp.storage.metadata.safe import (
    dump_metadata,
    finalize_metadata,
    has_checksum_trailer,
    load_metadata,
)
from refdcp.storage.metadata.stored_layout import check_records

__all__ = ["FileSystemReader", "FileSystemWriter", "split_into_buckets"]

_FLUSH_BYTES = 4 << 20
_relative_path = attrgetter("relative_path")
_MAX_IOV = 512
#: a large tensor item starts at a multiple of this many bytes in its file, after zero
#: bytes that belong to no item: its data is then as aligned in the file as in a tensor
#: (a page-cache copy between misaligned addresses costs ~26% more CPU here, STORE-50)
_ITEM_PAD = bytes(64)


def _fsync_dir(path: Path | int) -> None:
    """fsync a directory: by path, or its open descriptor (STORE-57)."""
    if isinstance(path, int):
        os.fsync(path)
        return
    fd = opened_dir(path)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _OpenedDir:
    """The checkpoint directory a save opened once: every file of the save is created,
    renamed and removed relative to ``fd`` (STORE-57); ``ident`` is its (device, inode)."""

    def __init__(self, path: Path) -> None:
        self.fd: int | None = opened_dir(path)
        st = os.fstat(self.fd)
        self.ident = (st.st_dev, st.st_ino)

    def close(self) -> None:
        fd, self.fd = self.fd, None
        if fd is not None:
            os.close(fd)

    def __getstate__(self) -> dict[str, Any]:
        # a descriptor means nothing in another process (a writer pickled to an async
        # save's worker): it arrives closed, and the next save opens the directory again
        return {"fd": None, "ident": self.ident}


def _make_dir(path: Path, sync: bool) -> None:
    """Create ``path`` and its missing parents; with ``sync``, fsync the parent of each
    directory it created, so the new names survive a power loss (STORE-4)."""
    created: list[Path] = []
    p = path
    while not p.exists() and p.parent != p:
        created.append(p)
        p = p.parent
    path.mkdir(parents=True, exist_ok=True)
    if sync:
        for d in created:
            _fsync_dir(d.parent)


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


def _libc_sync_file_range() -> Callable[[int, int, int, int], int] | None:
    """Linux's ``sync_file_range(2)`` from the C library, or None where there is none."""
    try:
        fn = ctypes.CDLL(None).sync_file_range  # errno unread: failing changes nothing, STORE-60
    except (AttributeError, OSError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return cast(Callable[[int, int, int, int], int], fn)


_SYNC_FILE_RANGE = _libc_sync_file_range()
_SYNC_FILE_RANGE_WRITE = 2  # start writeback of the range's dirty pages; wait for nothing


def start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Ask the kernel to start writing ``nbytes`` of ``fd`` from ``offset`` to the device now,
    without waiting (STORE-60). Only a hint: where the call is missing or fails nothing
    happens, and durability still comes from the ``fsync`` that follows."""
    if _SYNC_FILE_RANGE is not None and nbytes > 0:
        _SYNC_FILE_RANGE(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)


class _FileOut:
    """Gathers small buffers and writes them with ``os.writev``; large ones go straight out.

    With ``writeback`` (a save that fsyncs its files), each gathered batch it writes is
    handed to the kernel's writeback at once (STORE-60), so the disk writes while the
    next items are framed and the final ``fsync`` waits only for the last batches.
    """

    def __init__(self, fd: int, writeback: bool = False) -> None:
        self.fd = fd
        self.pending: list[Any] = []
        self.keep: list[Any] = []
        self.pending_bytes = 0
        self.position = 0
        self.writeback = writeback
        self.written = 0  # bytes written to the file so far
        self.handed = 0  # bytes of the file handed to writeback so far

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

    def write_small(self, head: bytes, data: Any, tail: bytes, length: int, owner: Any) -> None:
        """Queue one small item's three parts (``length`` bytes in all, under ``_FLUSH_BYTES``);
        ``owner`` owns the memory of ``data``."""
        self.pending += (head, data, tail)
        self.keep.append(owner)  # before a flush, which writes these parts, then drops it
        self.position += length
        self.pending_bytes += length
        if self.pending_bytes >= _FLUSH_BYTES or len(self.pending) >= _MAX_IOV:
            self.flush()

    def write_checksummed(self, enc: Encoded) -> None:
        """Write a large tensor item, its CRC-32C computed piece by piece as it goes (STORE-51)."""
        head, data, tail = enc.parts
        assert enc.head_crc is not None
        self.write([head])
        self.flush()
        crc = write_checksummed(lambda piece: self._write_all([piece]), data, enc.head_crc)
        self.position += len(data)
        enc.crc, enc.head_crc, enc.value_crc = crc32c(tail, crc), None, crc  # DEDUP-17
        self.write([tail])

    def flush(self) -> None:
        if self.pending:
            self._write_all(self.pending, self.pending_bytes)
            self.pending = []
            self.pending_bytes = 0
            if self.writeback and self.written - self.handed >= _FLUSH_BYTES:
                start_writeback(self.fd, self.handed, self.written - self.handed)
                self.handed = self.written
        self.keep.clear()

    def _write_all(self, parts: list[Any], total: int | None = None) -> None:
        if total is not None:
            written = os.writev(self.fd, parts)
            if written == total:
                self.written += total
                return
            self.written += total  # all of it, once the loop below has written the rest
            # a short write: go on from where it stopped, part by part
            views = [memoryview(p).cast("B") for p in parts]
            while views and written >= len(views[0]):
                written -= len(views[0])
                views.pop(0)
            if views and written:
                views[0] = views[0][written:]
        else:
            views = [memoryview(p).cast("B") for p in parts]
            self.written += sum(map(len, views))  # all of it, once the loop below has written it
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

    Each rank opens the checkpoint directory once, in ``prepare_local_plan``, and
    makes every file of the save relative to it (STORE-57, STORE-58).
    Data files get names unique to this save (``__{rank}_{n}.{token}.distcp``);
    ``.metadata`` is written to a temporary name, fsynced and atomically
    renamed over the old one; unreferenced files are removed after commit.
    The coordinator holds the directory's save lock from ``prepare_local_plan``
    to the end of the save (STORE-29); a failed save removes what it wrote
    (``abort_save``, STORE-31) and a save first reclaims orphans of earlier
    failed or killed saves (STORE-32).
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
        _refuse_torch_only_options(serialization_format)
        # torch's GPU copy-ahead and its writer-as-stager cache: refdcp's writer has
        # neither (stage with refdcp.CpuStager), so only the defaults are accepted (API-10)
        if per_thread_copy_ahead != 10_000_000:
            raise ValueError(
                "refdcp's FileSystemWriter does not implement per_thread_copy_ahead "
                f"(got {per_thread_copy_ahead!r}); leave it at its default, 10_000_000"
            )
        if cache_staged_state_dict:
            raise ValueError(
                "refdcp's FileSystemWriter is not a stager, so cache_staged_state_dict=True "
                "does nothing; pass refdcp.CpuStager(cache_staged_state_dict=True) to async_save"
            )
        #: torch's stream transforms (FMT-23), or None: every item as it is
        self._transforms = WriteTransforms(_extensions) if _extensions else None
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
        self._lock: SaveLock | None = None
        self._token = self.save_id
        self._written: list[str] = []
        self._committed = False
        self._dir: _OpenedDir | None = None  # opened in prepare_local_plan (STORE-57)

    def _dir_fd(self) -> int | None:
        return None if self._dir is None else self._dir.fd

    def _open_dir(self) -> None:
        self._close_dir()
        opened = _OpenedDir(self.path)
        self._dir = opened
        weakref.finalize(self, opened.close)  # a dropped writer closes its descriptor

    def _close_dir(self) -> None:
        if self._dir is not None:
            self._dir.close()
            self._dir = None

    def _fsync_dir(self) -> None:
        dfd = self._dir_fd()
        _fsync_dir(self.path if dfd is None else dfd)

    # -- locking and cleanup (STORE-29..STORE-33) ---------------------------------------------
    def _take_lock(self) -> None:
        self._release_lock()
        name = layout.rank_metadata_name(self._metadata_rank())
        lock = acquire_save_lock(self.path, name, self.save_id, dir_fd=self._dir_fd())
        self._lock = lock
        weakref.finalize(self, lock.release)  # a writer dropped after a failure frees its lock

    def _release_lock(self) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def _own_prefix(self) -> str | None:
        rank = self._metadata_rank()
        return None if rank is None else f"__{rank}_"

    def abort_save(self) -> None:
        """Remove what this save wrote and free its lock, after a failure on any rank (STORE-31).

        Best effort, and never a file a committed ``.metadata`` references. The
        coordinator removes every rank's files of this save (they share its
        token); another rank removes its own once the save's lock is free.
        """
        dfd = self._dir_fd()
        try:
            if self._lock is not None:
                names = self._token_files(self._token) if not self._committed else []
                if self._committed or names:
                    refs = committed_references(self.path, dir_fd=dfd)
                    if refs is not None:
                        remove_files(self.path, [n for n in names if n not in refs], dir_fd=dfd)
                remove_files(
                    self.path,
                    [
                        layout.metadata_temp_name(self._metadata_rank(), t)
                        for t in {self.save_id, self._token}
                    ],
                    dir_fd=dfd,
                )
            elif self._written and wait_until_not_live(self.path, self._token, 1.0, dir_fd=dfd):
                refs = committed_references(self.path, dir_fd=dfd)
                if refs is not None:
                    remove_files(self.path, [n for n in self._written if n not in refs], dir_fd=dfd)
        finally:
            self._written = []
            self._release_lock()

    def _token_files(self, token: str) -> list[str]:
        try:
            dfd = self._dir_fd()
            names = os.listdir(self.path if dfd is None else dfd)
        except OSError:
            return []
        prefix = self._own_prefix()
        return [
            n
            for n in names
            if layout.is_data_file(n)
            and token_of(n) == token
            and (prefix is None or n.startswith(prefix))
        ]

    # -- protocol ---------------------------------------------------------------------------
    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self._release_lock()
        self._close_dir()
        if checkpoint_id:
            self.path = Path(checkpoint_id)
        self.save_id = layout.new_save_token()

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self._release_lock()  # a reused writer: its previous save is over
        self.is_coordinator = is_coordinator
        self.rank = kwargs.get("rank")
        self.save_id = layout.new_save_token()  # fresh names for every save (STORE-2)
        self._token = self.save_id
        self._written = []
        self._committed = False
        self.use_collectives = bool(kwargs.get("use_collectives", True))

    def _metadata_rank(self) -> int | None:
        return None if self.use_collectives or self.rank is None else self.rank

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        _make_dir(self.path, self.sync_files)
        self._open_dir()  # resolved once: the save's files all go there (STORE-57)
        dfd = self._dir_fd()
        existing = layout.rank_metadata_name(self._metadata_rank())
        if _exists(at(self.path, existing, dfd), dfd) and not self.overwrite:
            raise CheckpointExistsError(
                f"Checkpoint already exists and overwrite=False: a committed checkpoint is at {self.path}"
            )
        if self.is_coordinator or not self.use_collectives:
            self._take_lock()  # STORE-29: before any rank writes a data file
            reclaim_orphans(
                self.path, own_token=self.save_id, rank_prefix=self._own_prefix(), dir_fd=dfd
            )
        if self.rank is not None and not self.use_collectives:
            plan = dataclasses.replace(plan, storage_data=_StoragePrefix(f"__{self.rank}_"))
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        directory = None if self._dir is None else (*self._dir.ident, host_identity())
        return layout.with_save_token(
            layout.assign_rank_prefixes(plans), self.save_id, directory=directory
        )

    def _check_same_directory(self, plan: SavePlan) -> None:
        """Refuse to write when this rank opened another directory than the coordinator
        did (on the same host): the path was re-pointed during the save (STORE-57)."""
        expected = layout.plan_directory(plan)
        if expected is None or self._dir is None:
            return
        dev, ino, host = expected
        if host == host_identity() and (dev, ino) != self._dir.ident:
            raise CheckpointMovedError(
                f"rank {self.rank}: {self.path} named another directory when this rank opened it "
                f"({_where_is(self._dir.fd) if self._dir.fd is not None else '?'}) than when "
                "the coordinator did: the path was re-pointed during the save; this rank "
                "wrote nothing and the save does not commit"
            )

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        try:
            return self._write_data(plan, planner)
        except BaseException:
            # this rank's files of this save are never committed data: remove them now
            # (STORE-31), e.g. after ENOSPC, so the space is free again
            remove_files(self.path, self._written, dir_fd=self._dir_fd())
            self._written = []
            if self._lock is not None:
                self._release_lock()  # the coordinator's write failed: this save cannot commit
            raise

    def _write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        self._check_same_directory(plan)
        prefix = layout.plan_prefix(plan)
        self._token = layout.plan_token(plan) or self.save_id
        if self.single_file_per_rank:
            groups = split_into_buckets(self.thread_count, list(plan.items))
        else:
            groups = [[item] for item in plan.items]
        jobs = [
            (layout.data_file_name(prefix, n, self._token), items) for n, items in enumerate(groups)
        ]
        if self.thread_count > 1 and len(jobs) > 1:
            with ThreadPoolExecutor(self.thread_count, thread_name_prefix="refdcp-write") as pool:
                per_file = list(
                    pool.map(lambda job: self._write_file(job[0], job[1], planner), jobs)
                )
        else:
            per_file = [self._write_file(name, items, planner) for name, items in jobs]
        if self.sync_files:
            self._fsync_dir()
        fut: Future[list[WriteResult]] = Future()
        fut.set_result([r for results in per_file for r in results])
        return fut

    def _write_file(
        self, name: str, items: list[WriteItem], planner: SavePlanner
    ) -> list[WriteResult]:
        results: list[WriteResult] = []
        dfd = self._dir_fd()
        fd = open_regular(
            at(self.path, name, dfd), os.O_WRONLY | os.O_CREAT | os.O_EXCL, dir_fd=dfd
        )
        self._written.append(name)
        try:
            out = _FileOut(fd, writeback=self.sync_files)
            ordered = [i for i in items if i.type == WriteItemType.BYTE_IO] + [
                i for i in items if i.type != WriteItemType.BYTE_IO
            ]
            resolve, append = planner.resolve_data, results.append
            if self._transforms is not None:  # every item through torch's extensions (FMT-23)
                results = write_transformed_items(out, name, ordered, planner, self._transforms)
                ordered = []
            # looked up once for the loop: it runs once per item
            byte_io, tensor, parts_of, write_small = (
                WriteItemType.BYTE_IO,
                torch.Tensor,
                small_tensor_parts,
                out.write_small,
            )
            for item in ordered:
                data = resolve(item)
                enc: Encoded
                if item.type == byte_io:
                    if not isinstance(data, io.BytesIO | bytes):
                        raise RefdcpError(f"{item.index.fqn}: BYTE_IO data must be io.BytesIO")
                    enc = encode_bytes(data)
                else:
                    if not isinstance(data, tensor):
                        raise RefdcpError(f"{item.index.fqn}: tensor item resolved to {type(data)}")
                    small = parts_of(data)
                    if small is not None:  # the same bytes as encode_tensor, fewer objects
                        head, raw, tail, length, _, _, _ = small
                        offset = out.position
                        write_small(head, raw, tail, length, data)
                        append(small_write_result(item.index, name, offset, small))
                        continue
                    enc = encode_tensor(data, by_writer=True)
                if enc.data_offset is not None and enc.length >= INPLACE_MIN_BYTES:
                    out.write([_ITEM_PAD[: -out.position % len(_ITEM_PAD)]])  # STORE-50
                offset = out.position
                if enc.head_crc is not None:
                    out.write_checksummed(enc)
                else:
                    out.write(enc.parts, enc)
                info = make_storage_info(name, offset, enc)
                append(write_result(item.index, enc.length, info, enc.value_crc))
            out.flush()
            if self.sync_files:
                os.fsync(fd)
        finally:
            os.close(fd)
        return results

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        try:
            storage_md = finalize_metadata(metadata, results, self.storage_meta())
            blob = dump_metadata(metadata)
        except BaseException as exc:
            mark_commit(exc, False)  # SAVE-16: before the rename
            raise
        rank = self._metadata_rank()
        dfd = self._dir_fd()  # STORE-57: the directory the data went to, whatever the path names
        tmp = at(self.path, layout.metadata_temp_name(rank, self.save_id), dfd)
        final = at(self.path, layout.rank_metadata_name(rank), dfd)
        try:
            fd = open_regular(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, dir_fd=dfd)
            try:
                out = _FileOut(fd)
                out.write([blob])
                out.flush()
                if self.sync_files:
                    os.fsync(fd)
            finally:
                os.close(fd)
            if self.sync_files:
                self._fsync_dir()
            os.replace(tmp, final, src_dir_fd=dfd, dst_dir_fd=dfd)  # the commit point (STORE-1)
            self._committed = True
        except BaseException as exc:
            if not self._committed:
                mark_commit(exc, False)  # SAVE-16: the rename did not happen
            try:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp, dir_fd=dfd)
                if not self._committed:
                    self.abort_save()  # nothing was committed: remove every rank's files (STORE-31)
            except BaseException as later:  # the clean-up failed too: still not committed
                mark_commit(later, self._committed)
                raise
            raise
        try:
            if self.sync_files:
                self._fsync_dir()
            self._clean_up(storage_md)
            self._check_still_named()
        except BaseException as exc:
            mark_commit(exc, True)  # renamed into place: committed and loadable (SAVE-16)
            raise
        finally:
            self._written = []
            self._release_lock()  # committed: the save is over even if the fsync failed

    def _check_still_named(self) -> None:
        """After the commit: raise, committed, when the path no longer names the directory
        the checkpoint was committed in, saying where it is (STORE-58)."""
        if self._dir is None or self._dir.fd is None:
            return
        try:
            st = os.stat(self.path)
            now = (st.st_dev, st.st_ino)
        except OSError:
            now = None
        if now == self._dir.ident:
            return
        named = "nothing" if now is None else "another directory, which this save left untouched"
        raise CheckpointMovedError(
            f"the checkpoint was committed in the directory this save opened as {self.path}, "
            f"which is now {_where_is(self._dir.fd)}; {self.path} was re-pointed or renamed "
            f"during the save and now names {named}: load the checkpoint from where it is"
        )

    def _clean_up(self, storage_md: dict[Any, Any]) -> None:
        """Remove data and temp files the committed metadata does not reference (STORE-5),
        sparing files of any live save (STORE-30)."""
        infos = storage_md.values()
        if set(map(type, infos)) <= {_StorageInfo}:  # the common case, in C
            keep = set(map(_relative_path, infos))
        else:
            keep = {info.relative_path for info in infos if isinstance(info, _StorageInfo)}
        reclaim_orphans(
            self.path,
            own_token="-",
            committed_name=layout.rank_metadata_name(self._metadata_rank()),
            rank_prefix=self._own_prefix(),
            referenced=keep,
            foreign_data=True,
            dir_fd=self._dir_fd(),
        )

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
        # torch's ``_extension_registry`` undoes stream transforms (FMT-24); None: torch's
        # default registry, made when the first transformed item is read
        super().__init__()
        self._extension_registry = _extension_registry
        self.path = Path(path)
        self.storage_data: dict[Any, Any] = {}
        self.load_id = layout.new_save_token()
        self.verify = False
        self.verify_available = True
        self.rank: int | None = None
        self.use_collectives = True
        self._chunks: ChunkIndex | None = None
        self._verified: set[tuple[str, int]] = set()
        self._delivered: list[str] = []  # fqns delivered by the read in progress (LOAD-20)
        #: the .metadata this load read, and its identity: what a missing data file is
        #: compared with to tell a concurrent commit from damage (LOAD-22)
        self._metadata_name = layout.METADATA_NAME
        self._metadata_ident: tuple[int, ...] | None = None
        self._metadata_stamp: layout.MetadataStamp | None = None

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
        # bounded, regular file only (FMT-10)
        data, st = read_metadata_file_stat(self.path / name)
        self._metadata_name, self._metadata_ident = name, metadata_identity(st)
        self._metadata_stamp = _stamp(data)
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
        check_records(metadata, file=str(self.path / layout.METADATA_NAME))  # FMT-29
        self.storage_data = metadata.storage_data
        self.rank = kwargs.get("rank")
        self.use_collectives = bool(kwargs.get("use_collectives", True))
        self._chunks = ChunkIndex(metadata)
        self._verified = set()

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        if self._metadata_stamp is None or plan.storage_data is not None:
            return plan
        return dataclasses.replace(plan, storage_data=self._metadata_stamp)  # LOAD-23

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """Refuse, before anything is read, a load whose ranks read different committed
        ``.metadata`` files: a save committed between their reads (LOAD-23)."""
        stamps = {p.storage_data for p in plans if isinstance(p.storage_data, layout.MetadataStamp)}
        if len(stamps) > 1:
            raise CheckpointReplacedError(
                f"{self.path}: the checkpoint was replaced while this load ran: its ranks read "
                f"{len(stamps)} different committed {self._metadata_name} files (a save "
                "committed between their reads); nothing was read, load again"
            )
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Read ``plan``'s items; a :class:`CorruptionError` names the keys whose destinations
        already hold checkpoint values, and the damaged item's destination is zero-filled
        (LOAD-20)."""
        self._delivered = []
        try:
            self._read_plan(plan, planner)
        except (CorruptionError, CheckpointReplacedError) as exc:
            exc.name_overwritten(self._delivered)
            raise
        finally:
            self._delivered = []
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _read_plan(self, plan: LoadPlan, planner: LoadPlanner) -> None:
        per_file: dict[str, list[tuple[int, ReadItem, Any]]] = {}
        transformed: dict[str, list[tuple[int, ReadItem, Any]]] = {}
        for req in plan.items:
            info = self.storage_data[req.storage_index]
            if getattr(info, "transform_descriptors", None):  # FMT-24: read apart
                transformed.setdefault(info.relative_path, []).append((info.offset, req, info))
                continue
            per_file.setdefault(info.relative_path, []).append((info.offset, req, info))
        if transformed:
            self._read_transformed(transformed, planner)
        for relative_path, reqs in per_file.items():
            reqs.sort(key=lambda r: r[0])  # STORE-47: items delivered in file order
            # STORE-26: open_data_file refuses a name that is not a plain file name
            fd = self._open_data(relative_path, reqs[0][1])  # STORE-27: regular files only
            try:
                size = os.fstat(fd).st_size
                prepared: list[tuple[ReadItem, Any, SmallItem | None]] = []
                for offset, req, info in reqs:
                    small = self._prepare(req, info, relative_path)
                    if offset + info.length > size:  # STORE-28: before allocating for it
                        raise CorruptionError(
                            f"data file truncated ({size} bytes, item needs {offset + info.length})",
                            fqn=req.storage_index.fqn,
                            file=relative_path,
                            offset=min(size, offset + info.length),
                        )
                    prepared.append((req, info, small))
                self._read_items(fd, relative_path, prepared, planner)
            finally:  # STORE-61: closed whether the reads return or raise
                os.close(fd)

    def _open_data(self, relative_path: str, req: ReadItem) -> int:
        """Open a data file; a missing one is a concurrent commit when ``.metadata`` is no
        longer the file this load read, else damage (LOAD-22)."""
        try:
            return open_data_file(self.path, relative_path)
        except FileNotFoundError:
            pass
        try:
            now: tuple[int, ...] | None = metadata_identity(
                os.stat(self.path / self._metadata_name)
            )
        except OSError:
            now = None
        if self._metadata_ident is not None and now != self._metadata_ident:
            raise CheckpointReplacedError(
                f"{self.path}: the checkpoint was replaced while this load ran: a save "
                f"committed a new {self._metadata_name} and removed the data file "
                f"{relative_path!r} of the one this load started from (item "
                f"{req.storage_index.fqn!r}); no value of the new checkpoint was read, "
                "load again to read it"
            ) from None
        raise CorruptionError(
            "data file missing", fqn=req.storage_index.fqn, file=relative_path, offset=0
        ) from None

    def _read_transformed(
        self, per_file: dict[str, list[tuple[int, ReadItem, Any]]], planner: LoadPlanner
    ) -> None:
        """Items stored with stream transforms, decoded one by one (FMT-24, INTEG-12)."""
        if self._extension_registry is None:
            from torch.distributed.checkpoint._extension import ExtensionRegistry

            self._extension_registry = ExtensionRegistry()
        for relative_path, reqs in per_file.items():
            reqs.sort(key=lambda r: r[0])
            # STORE-26: open_data_file refuses a name that is not a plain file name
            fd = self._open_data(relative_path, reqs[0][1])  # STORE-27: regular files only
            try:
                for _, req, info in reqs:
                    chunk = None
                    if req.type != LoadItemType.BYTE_IO and self._chunks is not None:
                        chunk = _lookup_checked(self._chunks, req, relative_path)
                    checked = self.verify or (
                        self.verify_available and checksum_of(info) is not None
                    )
                    read_transformed_item(
                        fd,
                        relative_path,
                        req,
                        info,
                        planner,
                        chunk,
                        self._extension_registry,
                        checked,
                    )
                    self._delivered.append(req.storage_index.fqn)
            finally:  # STORE-61: closed whether the reads return or raise
                os.close(fd)

    def _prepare(self, req: ReadItem, info: Any, relative_path: str) -> SmallItem | None:
        """Refuse a chunk whose stated shape needs more bytes than its stored length, before
        allocating anything for it (STORE-28); the item for the run reader when it is a
        small refdcp-framed whole-chunk read (STORE-47), else None."""
        if req.type == LoadItemType.BYTE_IO or self._chunks is None:
            return None
        chunk = _lookup_checked(self._chunks, req, relative_path)
        data_offset = getattr(info, DATA_OFFSET_ATTR, None)
        if chunk is None or not isinstance(data_offset, int):
            return None
        dtype, sizes = chunk
        length = info.length
        need = data_offset + math.prod(sizes) * dtype.itemsize
        if need > length:
            raise CorruptionError(
                f"chunk of shape {list(sizes)} needs {need} bytes but the item is {length}",
                fqn=req.storage_index.fqn,
                file=relative_path,
                offset=info.offset,
            )
        if (
            self.verify
            or length >= INPLACE_MIN_BYTES
            or req.lengths != sizes
            or any(req.storage_offsets)
        ):
            return None
        crc = checksum_of(info) if self.verify_available else None
        return SmallItem(req, int(info.offset), int(length), data_offset, dtype, sizes, crc)

    def _read_items(
        self,
        fd: int,
        relative_path: str,
        prepared: list[tuple[ReadItem, Any, SmallItem | None]],
        planner: LoadPlanner,
    ) -> None:
        """Deliver one file's items in offset order: small ones in runs (STORE-47), others
        one by one."""
        batch = any(small is not None for _, _, small in prepared) and batches_items(planner)
        run: list[SmallItem] = []
        for req, info, small in prepared:
            if small is not None:
                run.append(small)
                continue
            if run:
                read_small_items(fd, relative_path, run, planner, batch, self._delivered)
                run = []
            self._read_item(fd, relative_path, req, info, planner)
            self._delivered.append(req.storage_index.fqn)
        if run:
            read_small_items(fd, relative_path, run, planner, batch, self._delivered)

    def _read_item(
        self, fd: int, relative_path: str, req: ReadItem, info: Any, planner: LoadPlanner
    ) -> None:
        """Deliver one item, checked as the verify mode says (INTEG-4, LOAD-10, STORE-41).

        ``verify=True``: every item is checked before any of it is delivered
        (a large one in bounded memory, STORE-41). The default (checked when a
        checksum exists): a whole-chunk read is checked while it is read into
        place, and a damaged item's destination is zero-filled before the load
        raises (LOAD-20); a partial read checks its whole item first.
        """
        fqn = req.storage_index.fqn
        byte_io = req.type == LoadItemType.BYTE_IO
        if not byte_io and (self._chunks is None or self._chunks.lookup(req.storage_index) is None):
            raise RefdcpError(f"{fqn}: chunk {req.storage_index.offset} is not in the metadata")
        checked = self.verify or (self.verify_available and checksum_of(info) is not None)
        start = None if byte_io else self._data_start(fd, req, info)
        large = info.length >= INPLACE_MIN_BYTES and not byte_io
        if (
            large
            and checked
            and (self.verify or start is None or not self._whole_or_verified(req, info))
        ):
            self._verify_streaming(fd, relative_path, fqn, info)
            self._verified.add((relative_path, int(info.offset)))
            checked = False  # verified whole, before any byte reaches the destination
        if start is None and large:  # STORE-42: torch.load from the file, no copy first
            self._load_streaming(fd, relative_path, req, info, planner)
            return
        partial = checked and not self.verify and not self._whole_or_verified(req, info)
        if byte_io or start is None or (checked and (self.verify or partial)):
            blob = bytearray(info.length)
            got = _pread_into(fd, memoryview(blob), info.offset)
            if got != info.length:
                raise CorruptionError(
                    "data file truncated", fqn=fqn, file=relative_path, offset=info.offset + got
                )
            if checked:
                self._verified.add((relative_path, int(info.offset)))
                verify_blob(memoryview(blob), info, fqn, relative_path)
            if byte_io:
                planner.load_bytes(req, io.BytesIO(blob))
                return
            assert self._chunks is not None
            load_tensor_from_blob(
                memoryview(blob), info, self._chunks.lookup(req.storage_index), req, planner
            )
            return
        assert self._chunks is not None
        chunk = self._chunks.lookup(req.storage_index)
        assert chunk is not None  # a chunk missing from the metadata was refused above (LOAD-10)
        dtype, sizes = chunk
        if whole_chunk(req, sizes):
            target = planner.resolve_tensor(req).detach()
            if (
                target.device.type == "cpu"
                and target.dtype == dtype
                and tuple(target.shape) == tuple(sizes)
                and bytes_are_values(target)
            ):
                self._read_into(fd, raw_view(target), start, info, fqn, relative_path, checked)
                planner.commit_tensor(req, target)  # STORE-12
                return
            stored = torch.empty(sizes, dtype=dtype)
            self._read_into(fd, raw_view(stored), start, info, fqn, relative_path, checked)
            if target.size() != stored.size():
                raise RefdcpError(
                    f"read {fqn}: destination size {tuple(target.size())} != stored size {tuple(stored.size())}"
                )
            target.copy_(stored)
            planner.commit_tensor(req, target)  # STORE-12
            return
        # a resharded read: fetch only the rows of the saved chunk it overlaps (row-major
        # storage makes them one contiguous byte range), then narrow the other dims (STORE-16)
        first, count = int(req.storage_offsets[0]), int(req.lengths[0])
        row_bytes = math.prod(sizes[1:]) * dtype.itemsize
        rows = torch.empty((count, *sizes[1:]), dtype=dtype)
        _read_exact(fd, raw_view(rows), start + first * row_bytes, fqn, relative_path)
        offsets = torch.Size((0, *req.storage_offsets[1:]))
        copy_into_destination(planner, req, narrow(rows, offsets, req.lengths))

    def _data_start(self, fd: int, req: ReadItem, info: Any) -> int | None:
        """File offset of a tensor item's elements when they can be read in place (STORE-11, STORE-40)."""
        offset = data_offset_of(info)
        if offset is not None:
            return int(info.offset + offset)
        chunk = None if self._chunks is None else self._chunks.lookup(req.storage_index)
        if chunk is None or info.length < INPLACE_MIN_BYTES:
            return None
        found = locate_tensor_data(fd, info.offset, info.length, chunk[0], chunk[1])
        return None if found is None else int(info.offset + found)

    def _verify_streaming(self, fd: int, relative_path: str, fqn: str, info: Any) -> None:
        """Check a large item's CRC-32C in bounded memory before any of it is delivered (STORE-41)."""
        expected = checksum_of(info)
        if expected is None:
            raise MissingChecksumError(
                f"{fqn}: no checksum recorded in {relative_path} (not written by refdcp?)"
            )
        verify_streaming(fd, info.offset, info.length, expected, fqn, relative_path)

    def _load_streaming(
        self, fd: int, relative_path: str, req: ReadItem, info: Any, planner: LoadPlanner
    ) -> None:
        """A large item that cannot be read in place: torch.load of its byte range (STORE-42)."""
        loaded = torch.load(
            cast(IO[bytes], FileSlice(fd, info.offset, info.length)),
            map_location="cpu",
            weights_only=True,
        )
        if not isinstance(loaded, torch.Tensor):
            raise RefdcpError(
                f"{req.storage_index.fqn}: {relative_path} holds {type(loaded)}, not a tensor"
            )
        copy_into_destination(planner, req, narrow(loaded, req.storage_offsets, req.lengths))

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


def _stamp(data: bytes) -> layout.MetadataStamp:
    """The size and CRC-32C of ``.metadata`` bytes: refdcp's trailer when it has one (its
    checked CRC, INTEG-2), else computed (LOAD-23)."""
    if has_checksum_trailer(data):
        return layout.MetadataStamp(len(data), int(data[-9:-1], 16))
    return layout.MetadataStamp(len(data), crc32c(data))


def _check_box(req: ReadItem, sizes: tuple[int, ...], relative_path: str) -> None:
    """Refuse a read whose box is not inside the saved chunk it names (STORE-62)."""
    offsets, lengths = tuple(req.storage_offsets), tuple(req.lengths)
    if len(offsets) == len(lengths) == len(sizes) and all(
        o >= 0 and n >= 0 and o + n <= s for o, n, s in zip(offsets, lengths, sizes)
    ):
        return
    raise RefdcpError(
        f"{req.storage_index.fqn}: a read of offsets {list(offsets)} and lengths "
        f"{list(lengths)} is not inside its saved chunk of shape {list(sizes)} "
        f"(data file {relative_path})"
    )


def _exists(name: str | Path, dir_fd: int | None) -> bool:
    try:
        os.stat(name, dir_fd=dir_fd)
    except FileNotFoundError:
        return False
    return True


def _refuse_torch_only_options(serialization_format: Any) -> None:
    """torch's safetensors format is not implemented: say so (API-10)."""
    fmt = getattr(serialization_format, "value", serialization_format)
    if fmt not in (None, "torch_save"):
        raise ValueError(
            f"refdcp's FileSystemWriter writes SerializationFormat.TORCH_SAVE only, not {fmt!r}"
        )


def _read_exact(fd: int, view: memoryview, offset: int, fqn: str, file: str) -> None:
    got = _pread_into(fd, view, offset)
    if got != len(view):
        raise CorruptionError("data file truncated", fqn=fqn, file=file, offset=offset + got)


def _lookup_checked(chunks: Any, req: ReadItem, relative_path: str) -> tuple[Any, ...] | None:
    """The saved chunk a tensor read names, its box checked inside it (STORE-62)."""
    chunk: tuple[Any, ...] | None = chunks.lookup(req.storage_index)
    if chunk is not None:
        _check_box(req, chunk[1], relative_path)
    return chunk
