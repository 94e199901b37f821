"""Which file system a path lives on, from the kernel's mount table (ONCE-9).

A read-once load pays where the ranks share a storage whose bandwidth bounds
the load. For a path, that is decided by the type of the file system mounted
at the path's longest mount point: :data:`SHARED_FS_TYPES` are the network and
parallel file systems (and the FUSE mounts of object stores) whose bandwidth
all ranks share; a local disk or ``tmpfs`` is not among them.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from pathlib import Path

__all__ = ["SHARED_FS_TYPES", "fs_type_of", "mount_table", "parse_mountinfo", "shared_fs_type"]

#: File-system types (as ``/proc/self/mountinfo`` names them) whose bandwidth the ranks
#: of a job share: network file systems, parallel file systems, object-store FUSE mounts.
SHARED_FS_TYPES = frozenset(
    {
        "nfs",
        "nfs4",
        "cifs",
        "smb3",
        "smbfs",
        "lustre",
        "gpfs",
        "ceph",
        "fuse.ceph",
        "fuse.ceph-fuse",
        "glusterfs",
        "fuse.glusterfs",
        "beegfs",
        "panfs",
        "wekafs",
        "orangefs",
        "pvfs2",
        "afs",
        "fuse.sshfs",
        "fuse.s3fs",
        "fuse.goofys",
        "fuse.gcsfuse",
        "fuse.mountpoint-s3",
        "fuse.blobfuse2",
        "fuse.juicefs",
        "fuse.rclone",
    }
)

_ESCAPE = re.compile(r"\\([0-7]{3})")


def _unescape(field: str) -> str:
    """The kernel writes a space, tab, newline or backslash in a path as ``\\ooo``."""
    return _ESCAPE.sub(lambda m: chr(int(m.group(1), 8)), field)


def parse_mountinfo(text: str) -> list[tuple[str, str]]:
    """``(mount point, file-system type)`` of each line of a ``/proc/<pid>/mountinfo`` text.

    A line is ``id parent major:minor root mount-point options [optional...] - type source
    super-options``; lines that do not have that form are skipped.
    """
    out: list[tuple[str, str]] = []
    for line in text.splitlines():
        fields = line.split(" ")
        if "-" not in fields:
            continue
        sep = fields.index("-")
        if sep < 6 or sep + 1 >= len(fields):
            continue
        out.append((_unescape(fields[4]), fields[sep + 1]))
    return out


def _within(path: str, mount_point: str) -> bool:
    if mount_point == "/":
        return path.startswith("/")
    return path == mount_point or path.startswith(mount_point.rstrip("/") + "/")


def fs_type_of(path: str | os.PathLike[str], mounts: Iterable[tuple[str, str]]) -> str | None:
    """The type of the file system mounted at ``path``'s longest mount point (the last one
    mounted there wins, as the kernel's later mount hides the earlier); None if none holds it.

    ``path`` is made absolute and its symbolic links resolved first.
    """
    where = os.path.realpath(os.fspath(path))
    best: tuple[int, str] | None = None
    for point, kind in mounts:
        if _within(where, point) and (best is None or len(point) >= best[0]):
            best = (len(point), kind)
    return None if best is None else best[1]


def mount_table() -> list[tuple[str, str]]:
    """This process's mounts, from ``/proc/self/mountinfo`` (empty where it cannot be read)."""
    try:
        text = Path("/proc/self/mountinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return []
    return parse_mountinfo(text)


def shared_fs_type(path: str | os.PathLike[str]) -> str | None:
    """The type of ``path``'s file system if it is one of :data:`SHARED_FS_TYPES`, else None
    (also when the mount table cannot be read)."""
    kind = fs_type_of(path, mount_table())
    return kind if kind in SHARED_FS_TYPES else None
