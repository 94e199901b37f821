"""Choose storage from a ``checkpoint_id`` when the caller gives none (API-5).

Like torch: a local path gets the filesystem storage, a URL (``scheme://``)
gets the fsspec storage; an id neither accepts is a clear error.
"""

from __future__ import annotations

from typing import Any

from torch.distributed.checkpoint.storage import StorageReader, StorageWriter

__all__ = ["select_reader", "select_writer"]


def _candidates(kind: str) -> list[type[Any]]:
    from refdcp import storage

    out: list[type[Any]] = [getattr(storage, f"FileSystem{kind}")]
    try:
        from torch.distributed.checkpoint import _fsspec_filesystem as fs

        out.append(getattr(fs, f"Fsspec{kind}"))
    except ImportError:
        pass
    return out


def select_writer(checkpoint_id: Any) -> StorageWriter:
    for cls in _candidates("Writer"):
        if cls.validate_checkpoint_id(checkpoint_id):
            writer: StorageWriter = cls(checkpoint_id)
            writer.reset(checkpoint_id)
            return writer
    raise RuntimeError(
        f"cannot choose a storage writer for checkpoint_id={checkpoint_id!r} (API-5)"
    )


def select_reader(checkpoint_id: Any) -> StorageReader:
    for cls in _candidates("Reader"):
        if cls.validate_checkpoint_id(checkpoint_id):
            reader: StorageReader = cls(checkpoint_id)
            reader.reset(checkpoint_id)
            return reader
    raise RuntimeError(
        f"cannot choose a storage reader for checkpoint_id={checkpoint_id!r} (API-5)"
    )
