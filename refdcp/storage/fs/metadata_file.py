"""Reading a ``.metadata`` file: through the opening rule, capped before and while it is
read (FMT-10, STORE-59); :mod:`refdcp.storage.metadata.safe` then decodes the bytes."""

from __future__ import annotations

import os

from refdcp.storage.errors import UnsafeMetadataError
from refdcp.storage.fs.paths import open_regular
from refdcp.storage.metadata.limits import MetadataLimits, get_metadata_limits

__all__ = ["metadata_identity", "read_metadata_file", "read_metadata_file_stat"]


def read_metadata_file(
    path: str | os.PathLike[str],
    limits: MetadataLimits | None = None,
    *,
    dir_fd: int | None = None,
) -> bytes:
    """The bytes of a ``.metadata`` file, refusing one larger than the cap unread (FMT-10).

    Opens without following a symbolic link or blocking, refuses anything but
    a regular file, checks the size with ``fstat`` before reading and never
    reads more than the cap (a file growing meanwhile is refused too). With
    ``dir_fd``, ``path`` is a name in that opened directory.
    """
    return read_metadata_file_stat(path, limits, dir_fd=dir_fd)[0]


def read_metadata_file_stat(
    path: str | os.PathLike[str],
    limits: MetadataLimits | None = None,
    *,
    dir_fd: int | None = None,
) -> tuple[bytes, os.stat_result]:
    """:func:`read_metadata_file` (capped as it is, FMT-10), with the ``fstat`` of the file
    it read: what a load compares the path with later to tell whether the checkpoint was
    replaced (LOAD-22)."""
    limits = limits or get_metadata_limits()
    fd = open_regular(path, os.O_RDONLY, dir_fd=dir_fd)
    try:
        st = os.fstat(fd)
        if st.st_size > limits.max_file_bytes:
            raise UnsafeMetadataError(
                f"{path}: {st.st_size} bytes is over the metadata size limit of "
                f"{limits.max_file_bytes} (raise it with REFDCP_MAX_METADATA_BYTES or "
                "refdcp.storage.metadata.limits.set_metadata_limits); not reading it"
            )
        chunks: list[bytes] = []
        total = 0
        while True:
            chunk = os.read(fd, min(1 << 24, limits.max_file_bytes + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
            if total > limits.max_file_bytes:
                raise UnsafeMetadataError(
                    f"{path}: grew past the metadata size limit of {limits.max_file_bytes} bytes"
                )
        return b"".join(chunks), st
    finally:
        os.close(fd)


def metadata_identity(st: os.stat_result) -> tuple[int, ...]:
    """What tells one committed ``.metadata`` from the next: a commit renames a new file
    over the old one (a new inode and change time); load and verify compare it (LOAD-22,
    INTEG-14)."""
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
