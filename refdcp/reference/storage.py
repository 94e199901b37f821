"""A filesystem writer and reader in torch's layout, written to be read (STORE-*, FMT-*).

A save writes one data file per rank, ``__{rank}_0.{token}.distcp``, under names no
earlier save used (STORE-2), then the coordinator commits by renaming a fully
written, fsynced metadata file onto ``.metadata`` (STORE-1, STORE-4): the
directory holds the old checkpoint or the new one at every instant, and a failed
save leaves the old one untouched (STORE-3). Unlike ``refdcp.FileSystemWriter``
it takes no lock and removes only its own files: old generations stay on disk.

A load reads each item's byte range, checks its CRC-32C (LOAD-10, INTEG-3) and
hands it to the planner (STORE-12); it opens only plain regular files inside the
checkpoint directory (STORE-26, STORE-27) and never reads past what it was told
(STORE-13, STORE-28).
"""

from __future__ import annotations

import errno
import io
import os
import secrets
import stat
from pathlib import Path
from typing import Any

import crc32c
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

from refdcp.storage import CorruptionError, MissingChecksumError, UnsafePathError

from .format import (
    DCP_VERSION,
    METADATA,
    data_file_name,
    decode_tensor,
    dump_metadata,
    encode_item,
    load_metadata,
    storage_info,
)

__all__ = ["ReferenceReader", "ReferenceWriter"]

ALIGN = 64  # tensor items start on a 64-byte boundary of their file (STORE-50)


def _done(value: Any) -> Future[Any]:
    fut: Future[Any] = Future()
    fut.set_result(value)
    return fut


class ReferenceWriter(StorageWriter):
    """Writes a checkpoint directory torch's ``FileSystemReader`` loads (STORE-7, API-7)."""

    def __init__(self, path: str | os.PathLike[str], *, sync_files: bool = True) -> None:
        self.sync_files = sync_files
        self.reset(path)

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """A fresh save: a new token names its files (STORE-2)."""
        if checkpoint_id is not None:
            self.path = Path(checkpoint_id)
        self.token = secrets.token_hex(4)
        self.written: list[Path] = []

    @property
    def save_id(self) -> str:
        """This save's id, recorded in the metadata's ``storage_meta`` (API-10)."""
        return self.token

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike)) and "://" not in str(checkpoint_id)

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=str(self.path), save_id=self.token)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.rank = kwargs.get("rank", 0)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        self.path.mkdir(parents=True, exist_ok=True)
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Each rank's data file name, under the coordinator's token (STORE-2, STORE-30)."""
        return [
            SavePlan(
                p.items, storage_data=data_file_name(r, self.token), planner_data=p.planner_data
            )
            for r, p in enumerate(plans)
        ]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Objects first, then tensors, each item's bytes and CRC-32C recorded (FMT-2, INTEG-1)."""
        name = plan.storage_data
        items = sorted(plan.items, key=lambda i: i.type != WriteItemType.BYTE_IO)
        file = self.path / name
        results = []
        self.written.append(file)
        try:
            with open(os.open(file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644), "wb") as out:
                for item in items:
                    blob, data_offset = encode_item(_resolved(item, planner))
                    if item.type != WriteItemType.BYTE_IO:
                        out.write(b"\0" * (-out.tell() % ALIGN))
                    info = storage_info(name, out.tell(), blob, data_offset)
                    out.write(blob)
                    results.append(WriteResult(item.index, len(blob), info))
                if self.sync_files:
                    out.flush()
                    os.fsync(out.fileno())
        except BaseException:
            self.abort_save()  # what this rank wrote is removed at once (STORE-31)
            raise
        return _done(results)

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """The commit: a fully written metadata file renamed onto ``.metadata`` (STORE-1, STORE-4)."""
        metadata.storage_data = {r.index: r.storage_data for rank in results for r in rank}
        metadata.storage_meta = self.storage_meta()
        metadata.version = DCP_VERSION
        tmp = self.path / f"{METADATA}.{self.token}.tmp"
        self.written.append(tmp)
        with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644), "wb") as out:
            out.write(dump_metadata(metadata))
            if self.sync_files:
                out.flush()
                os.fsync(out.fileno())
        os.replace(tmp, self.path / METADATA)
        self.written = []  # committed: the files are the checkpoint's now, never removed (STORE-33)
        if self.sync_files:
            _fsync_dir(self.path)

    def abort_save(self) -> None:
        """A failed save removes the files this rank created (STORE-31), but never one the
        committed ``.metadata`` names: a peer cannot tell whether the commit happened (STORE-33)."""
        committed = _committed_files(self.path)
        for file in self.written:
            if committed is not None and file.name not in committed:
                file.unlink(missing_ok=True)
        self.written = []


def _untransformed(blob: bytes, descriptors: list[str]) -> bytes:
    """An item torch stored through stream transforms (``zstd``), decoded: the transforms are
    undone in the order the descriptors name them, the first reading the stored bytes (FMT-24)."""
    from torch.distributed.checkpoint._extension import ExtensionRegistry

    stream: Any = io.BytesIO(blob)
    for extension in ExtensionRegistry().from_descriptor_list(descriptors):
        undo: Any = extension  # a StreamTransformExtension, torch's ZStandard among them
        stream = undo.transform_from(stream)
    return bytes(stream.read())


def _committed_files(path: Path) -> set[str] | None:
    """The data files the committed ``.metadata`` at ``path`` names (none when there is no
    checkpoint); None when it cannot be read, so nothing is removed (STORE-33)."""
    if not (path / METADATA).exists():
        return set()
    try:
        metadata = ReferenceReader(path).read_metadata()
    except Exception:
        return None
    return {info.relative_path for info in (metadata.storage_data or {}).values()}


def _resolved(item: WriteItem, planner: SavePlanner) -> Any:
    """The planner's value for ``item``, of the kind the item says, else an error naming its key
    (STORE-12): a BYTE_IO item's ``io.BytesIO``, a tensor item's tensor."""
    data = planner.resolve_data(item)
    fqn = item.index.fqn
    if item.type == WriteItemType.BYTE_IO and not isinstance(data, io.BytesIO):
        raise TypeError(f"{fqn}: BYTE_IO data must be io.BytesIO, not {type(data).__name__}")
    if item.type != WriteItemType.BYTE_IO and not isinstance(data, torch.Tensor):
        raise TypeError(f"{fqn}: tensor item resolved to {type(data).__name__}, not a tensor")
    return data


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class ReferenceReader(StorageReader):
    """Reads refdcp and torch checkpoints in torch's layout (FMT-5, STORE-12)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.verify: bool | None = None
        self.reset(path)

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """A fresh load: a new ``load_id`` names it in the metadata it reads (API-10)."""
        if checkpoint_id is not None:
            self.path = Path(checkpoint_id)
        self.load_id = secrets.token_hex(4)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return ReferenceWriter.validate_checkpoint_id(checkpoint_id)

    def set_verify(self, verify: bool | None) -> None:
        """None: check items that carry a checksum; True: every item must; False: none (LOAD-10)."""
        self.verify = verify

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """``.metadata``, read with the restricted unpickler (FMT-6, FMT-7, INTEG-2)."""
        with self._open(METADATA) as f:
            self.metadata = load_metadata(f.read(), str(self.path / METADATA))
        if self.metadata.storage_meta is not None:
            self.metadata.storage_meta.load_id = self.load_id  # as torch's reader does (API-10)
        return self.metadata

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *a: Any, **k: Any
    ) -> None:
        self.metadata = metadata

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Each item's bytes, checked, then delivered to the planner (STORE-12, LOAD-10)."""
        for item in plan.items:
            blob = self._read_item(item.storage_index)
            if item.type == LoadItemType.BYTE_IO:
                planner.load_bytes(item, io.BytesIO(blob))
                continue
            saved = decode_tensor(blob)
            for dim, (start, length) in enumerate(zip(item.storage_offsets, item.lengths)):
                saved = saved.narrow(dim, start, length)
            target = planner.resolve_tensor(item).detach()
            if target.size() != saved.size():
                raise ValueError(
                    f"{item.dest_index.fqn!r}: destination {list(target.size())} "
                    f"does not match the read {list(saved.size())} (STORE-12)"
                )
            target.copy_(saved)
            planner.commit_tensor(item, target)
        return _done(None)

    def _read_item(self, index: MetadataIndex) -> bytes:
        """One item's stored bytes, whole and checked (STORE-13, INTEG-3..5)."""
        info = self.metadata.storage_data[index]
        name = info.relative_path
        try:
            with self._open(name) as f:
                f.seek(info.offset)
                blob = f.read(info.length)
        except FileNotFoundError:
            raise CorruptionError("data file missing", fqn=index.fqn, file=name, offset=0) from None
        if len(blob) != info.length:
            raise CorruptionError(
                f"item truncated ({len(blob)} of {info.length} bytes)",
                fqn=index.fqn,
                file=name,
                offset=info.offset,
            )
        expected = getattr(info, "refdcp_crc32c", None)
        if expected is None and self.verify:
            raise MissingChecksumError(f"{index.fqn!r} in {name} has no checksum (verify=True)")
        if expected is not None and self.verify is not False and crc32c.crc32c(blob) != expected:
            raise CorruptionError("checksum mismatch", fqn=index.fqn, file=name, offset=info.offset)
        descriptors = getattr(info, "transform_descriptors", None)
        return _untransformed(blob, descriptors) if descriptors else blob

    def _open(self, name: str) -> io.BufferedReader:
        """A plain regular file of the checkpoint directory, never a link or a FIFO (STORE-27)."""
        try:
            fd = os.open(self.path / name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise UnsafePathError(f"{self.path / name} is a symbolic link") from None
            raise
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise UnsafePathError(f"{self.path / name} is not a regular file")
        return open(fd, "rb")
