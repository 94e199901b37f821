"""The one rule by which refdcp opens a file of a checkpoint directory (STORE-26..STORE-28,
STORE-56, STORE-59), and the data-file names taken from ``.metadata``.

A checkpoint's ``.metadata`` is untrusted input: a crafted one may name
``../../etc/passwd``, ``/abs/x``, a FIFO or ``/dev/zero``. Readers accept only
a plain file name (no separator, not ``.``/``..``, not absolute), open it
relative to the checkpoint directory without following a symbolic link and
without blocking, and refuse anything but a regular file. Every read is then
bounded by the length the metadata states (the callers check it against the
file's size before allocating).

Every file refdcp opens in a checkpoint directory (data, ``.metadata``, lock and
temporary files, in save, load, verify, inspect, convert, clean-up and the lock
scan) is opened by :func:`open_regular` and every directory by
:func:`opened_dir`; ``tests/test_one_opening_rule.py`` fails on any other
``open`` in the package that is not listed there with its reason (STORE-59).
"""

from __future__ import annotations

import errno
import os
import socket
import stat
from pathlib import Path

from refdcp.storage.errors import UnsafePathError
from refdcp.storage.format.layout import MAX_NAME_BYTES, METADATA_NAME, check_data_name

__all__ = [
    "MAX_NAME_BYTES",
    "at",
    "boot_id",
    "check_data_name",
    "holds_safetensors_only",
    "host_identity",
    "open_data_file",
    "open_regular",
    "opened_dir",
    "pread_exact",
    "pread_into",
    "where_is",
]


def open_data_file(root: str | os.PathLike[str], name: str, *, fqn: str | None = None) -> int:
    """Open ``root/name`` read-only; refuse links and anything but a regular file (STORE-27).

    ``O_NOFOLLOW`` refuses a symbolic link and ``O_NONBLOCK`` keeps a FIFO from
    blocking the open; ``fstat`` on the opened descriptor then checks the type,
    so nothing can be swapped in between. ``FileNotFoundError`` and other
    ``OSError``s (permission denied) propagate for the caller to report.
    """
    check_data_name(name, fqn=fqn)
    return open_regular(Path(root) / name, os.O_RDONLY)


def open_regular(
    path: str | os.PathLike[str],
    flags: int,
    mode: int = 0o644,
    *,
    dir_fd: int | None = None,
    follow_links: bool = False,
) -> int:
    """Open ``path`` with ``flags`` plus ``O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC``; refuse a
    symbolic link or anything but a regular file with ``UnsafePathError`` (STORE-27,
    STORE-56, STORE-59).

    The type is checked with ``fstat`` on the opened descriptor, so nothing can be
    swapped in between; a FIFO never blocks the open. With ``dir_fd``, ``path`` must be
    a plain name in that opened directory (STORE-57). ``follow_links=True`` is only for
    files a user names outside any checkpoint directory (``refdcp convert``'s
    safetensors and torch.save files, which Hugging Face caches link to): the link is
    followed, the other checks stay.
    """
    if dir_fd is not None:
        check_data_name(os.fspath(path))
    flags |= os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow_links else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags, mode, dir_fd=dir_fd)
    except OSError as exc:
        what = _REFUSED_BY_OPEN.get(exc.errno or 0)
        if what is not None:
            raise UnsafePathError(
                f"{path}: is {what}; refdcp opens only regular files of the checkpoint"
            ) from exc
        raise
    try:
        st_mode = os.fstat(fd).st_mode
    except BaseException:
        os.close(fd)
        raise
    if not stat.S_ISREG(st_mode):
        os.close(fd)
        raise UnsafePathError(
            f"{path}: is not a regular file ({_kind(st_mode)}); refusing to open it"
        )
    return fd


#: what an ``open`` refusal says about the file (the kernel refuses before ``fstat`` can)
_REFUSED_BY_OPEN = {
    errno.ELOOP: "a symbolic link",
    errno.ENXIO: "a socket, or a FIFO with no reader",
    errno.EISDIR: "a directory",
}


def opened_dir(path: str | os.PathLike[str]) -> int:
    """A descriptor of the directory ``path`` names now (``O_DIRECTORY``), which a save
    keeps and creates, renames and removes every file relative to (STORE-57)."""
    return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)


def boot_id() -> str:
    """This boot of this host, from the kernel; "" where it cannot be read (a system
    file, not in a checkpoint directory)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as fh:
            return fh.read().strip()
    except OSError:
        return ""


def host_identity() -> str:
    """This host and boot: device and inode numbers compare only within one (STORE-57)."""
    return f"{socket.gethostname()}/{boot_id()}"


def where_is(dir_fd: int) -> str:
    """Where the opened directory is now, as the kernel names it (Linux), else a
    description by device and inode."""
    try:
        return os.readlink(f"/proc/self/fd/{dir_fd}")
    except OSError:
        st = os.fstat(dir_fd)
        return f"the directory with device {st.st_dev} and inode {st.st_ino}"


def at(root: Path, name: str, dir_fd: int | None) -> str | Path:
    """``name`` relative to ``dir_fd`` when given, else ``root / name``."""
    return name if dir_fd is not None else root / name


def pread_into(fd: int, view: memoryview, offset: int) -> int:
    """Fill ``view`` from ``offset``; the bytes read (fewer only at end of file), never more."""
    total = 0
    while total < len(view):
        n = os.preadv(fd, [view[total:]], offset + total)
        if n == 0:
            break
        total += n
    return total


def pread_exact(fd: int, length: int, offset: int) -> bytes:
    """Up to ``length`` bytes at ``offset`` (fewer only at end of file); never more."""
    out = bytearray(length)
    got = pread_into(fd, memoryview(out), offset)
    return bytes(out[:got])


def _kind(mode: int) -> str:
    for test, label in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISLNK, "a symbolic link"),
    ):
        if test(mode):
            return label
    return "not a regular file"


def holds_safetensors_only(path: str | os.PathLike[str]) -> bool:
    """True when ``path`` is a directory with a ``.safetensors`` file and no ``.metadata``:
    the layout torch's ``HuggingFaceStorageWriter`` leaves (API-25)."""
    try:
        names = os.listdir(path)
    except OSError:
        return False
    return METADATA_NAME not in names and any(n.endswith(".safetensors") for n in names)
