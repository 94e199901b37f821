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


def _select(kind: str, checkpoint_id: Any) -> Any:
    for cls in _candidates(kind):
        if cls.validate_checkpoint_id(checkpoint_id):
            storage = cls(checkpoint_id)
            storage.reset(checkpoint_id)
            return storage
    raise RuntimeError(
        f"cannot choose a storage {kind.lower()} for checkpoint_id={checkpoint_id!r} (API-5)"
    )


def select_writer(checkpoint_id: Any) -> StorageWriter:
    writer: StorageWriter = _select("Writer", checkpoint_id)
    return writer


def select_reader(checkpoint_id: Any) -> StorageReader:
    reader: StorageReader = _select("Reader", checkpoint_id)
    return reader
