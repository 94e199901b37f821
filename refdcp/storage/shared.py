"""Whether a storage reader reads from a storage whose bandwidth the ranks share (ONCE-9).

``read_once="auto"`` (the default) turns a read-once load on only there. The
rule, in order:

1. a reader that wraps another as ``inner`` (the wrappers of
   :mod:`refdcp.testing.storage_wrappers` do) is judged by the one it wraps;
2. a ``path`` that is a URL with a scheme other than ``file`` (``s3://``,
   ``gs://``, ``az://``, ...): shared;
3. an fsspec file system (``fs.fs.protocol``, as torch's ``FsspecReader`` holds
   it) whose protocol is not local: shared;
4. a local ``path`` (refdcp's and torch's ``FileSystemReader``): shared iff its
   file system is a network or parallel one (:data:`~refdcp.storage.fs.mounts.SHARED_FS_TYPES`);
5. anything else (in-memory storage, unknown readers): not shared.
"""

from __future__ import annotations

import os
import re
from typing import Any

from refdcp.storage.fs.mounts import shared_fs_type

__all__ = ["shared_storage"]

_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
_LOCAL_PROTOCOLS = frozenset({"file", "local"})


def _protocols(fs: Any) -> set[str]:
    proto = getattr(fs, "protocol", None)
    if isinstance(proto, str):
        return {proto}
    if isinstance(proto, (tuple, list)):
        return {p for p in proto if isinstance(p, str)}
    return set()


def shared_storage(reader: Any) -> str | None:
    """What makes ``reader``'s storage shared (a URL scheme, an fsspec protocol or a file-system
    type), or None when it is not (ONCE-9)."""
    for _ in range(8):  # wrappers of wrappers, boundedly
        inner = getattr(reader, "inner", None)
        if inner is None:
            break
        reader = inner
    path = getattr(reader, "path", None)
    if isinstance(path, str):
        m = _URL.match(path)
        if m is not None:
            scheme = m.group(1).lower()
            return None if scheme in _LOCAL_PROTOCOLS else scheme
    wrapped_fs = getattr(getattr(reader, "fs", None), "fs", None)
    remote = _protocols(wrapped_fs) - _LOCAL_PROTOCOLS
    if wrapped_fs is not None and remote:
        return sorted(remote)[0]
    if isinstance(path, (str, os.PathLike)):
        return shared_fs_type(path)
    return None
