"""Choose storage from a ``checkpoint_id`` when the caller gives none (API-5).

Like torch: a local path gets the filesystem storage, a URL (``scheme://``)
gets the fsspec storage; an id neither accepts is a clear error. For a load,
a local directory holding ``.safetensors`` files and no ``.metadata`` (what
torch's ``HuggingFaceStorageWriter`` leaves) gets refdcp's subclass of torch's
``HuggingFaceStorageReader``, which opens every file through the opening rule
(API-25, STORE-64).
"""

from __future__ import annotations

import os
from typing import Any

from torch.distributed.checkpoint.storage import StorageReader, StorageWriter

from refdcp.storage.fs.paths import holds_safetensors_only

__all__ = ["huggingface_reader", "select_reader", "select_writer"]


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
    if isinstance(checkpoint_id, (str, os.PathLike)) and holds_safetensors_only(checkpoint_id):
        return huggingface_reader(checkpoint_id)
    reader: StorageReader = _select("Reader", checkpoint_id)
    return reader


def huggingface_reader(path: str | os.PathLike[str]) -> StorageReader:
    """A ``HuggingFaceStorageReader`` for ``path``: refdcp's subclass of torch's, opening
    every file through the opening rule (STORE-64); it needs the ``safetensors`` package,
    and without it the error names the package to install (API-25)."""
    try:
        import safetensors  # noqa: F401
    except ImportError as exc:
        raise RuntimeError(
            f"{os.fspath(path)} holds .safetensors files (torch's HuggingFaceStorageWriter "
            "layout); reading them needs the safetensors package: pip install safetensors "
            "(or refdcp[hf])"
        ) from exc
    from refdcp.storage.fs.safetensors_files import HuggingFaceStorageReader

    reader = HuggingFaceStorageReader(os.fspath(path))
    reader.reset(os.fspath(path))
    return reader
