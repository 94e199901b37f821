"""The save lock of a checkpoint directory (STORE-29, STORE-30).

A save's coordinator holds ``.metadata.lock`` (``__{rank}.metadata.lock`` for
a rank-local save) from set-up until its commit or failure. The lock file
appears atomically, already locked and filled in: it is written under a
private name, ``flock``-ed, then hard-linked to the lock name (``link`` fails
with ``EEXIST`` like ``O_CREAT|O_EXCL``; where hard links are unsupported,
``O_CREAT|O_EXCL`` is used directly). It records the holder's pid, host, boot
id, start time and save token.

Stale-lock rule (survives SIGKILL): the holder keeps an exclusive ``flock``
on the open file for the whole save, and the kernel drops it when the holder
dies. A lock file whose ``flock`` can be taken is stale and is taken over in
place, when it has exactly one link: a lock name that is a hard link to another
file is refused, never written through (STORE-63). Where ``flock`` is unsupported,
a lock is stale only when it names this host and boot and its pid is no longer
alive; anything else is refused.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import socket
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from refdcp.storage.errors import ConcurrentSaveError, UnsafePathError
from refdcp.storage.fs.paths import at, boot_id, open_regular

__all__ = ["SaveLock", "acquire_save_lock", "live_lock_tokens", "lock_name"]

LOCK_SUFFIX = ".lock"
_NO_FLOCK = {errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS}


def lock_name(metadata_name: str) -> str:
    """``.metadata.lock`` for ``.metadata``; ``__3.metadata.lock`` for ``__3.metadata``."""
    return metadata_name + LOCK_SUFFIX


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _describe(info: dict[str, Any]) -> str:
    if not info:
        return "holder unknown (lock file empty or unreadable)"
    return (
        f"pid {info.get('pid')} on host {info.get('host')!r}, save token {info.get('token')!r}, "
        f"started {time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime(float(info.get('start', 0))))} UTC"
    )


def _read_info(fd: int) -> dict[str, Any]:
    try:
        raw = os.pread(fd, 4096, 0)
        info = json.loads(raw.decode("utf-8")) if raw else {}
        return info if isinstance(info, dict) else {}
    except (OSError, ValueError):
        return {}


@dataclass
class SaveLock:
    """A held save lock; ``release()`` removes it (idempotent).

    ``dir_fd``: the lock's own duplicate of the directory descriptor the lock was
    taken in (STORE-57), closed on release; None when taken by path.
    """

    path: Path
    fd: int | None
    token: str
    dir_fd: int | None = None

    def release(self) -> None:
        if self.fd is None:
            return
        fd, self.fd = self.fd, None
        dir_fd, self.dir_fd = self.dir_fd, None
        name = at(self.path.parent, self.path.name, dir_fd)
        try:
            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            mine = os.fstat(fd)
            if (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino):
                os.unlink(name, dir_fd=dir_fd)
        except OSError:
            pass
        finally:
            os.close(fd)
            if dir_fd is not None:
                os.close(dir_fd)

    @property
    def held(self) -> bool:
        return self.fd is not None


def _payload(token: str) -> bytes:
    info = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "boot_id": boot_id(),
        "start": time.time(),
        "token": token,
    }
    return (json.dumps(info) + "\n").encode()


def _flock(fd: int) -> bool | None:
    """True: locked; False: held by someone else; None: flock unsupported here."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    except OSError as exc:
        if exc.errno in _NO_FLOCK:
            return None
        raise


def _create(path: Path, token: str, dir_fd: int | None) -> int | None:
    """Make ``path`` appear atomically, locked and filled; None when it already exists."""
    private = at(path.parent, f"{path.name}.{uuid.uuid4().hex[:12]}.new", dir_fd)
    name = at(path.parent, path.name, dir_fd)
    fd = open_regular(private, os.O_RDWR | os.O_CREAT | os.O_EXCL, dir_fd=dir_fd)
    try:
        _flock(fd)
        os.write(fd, _payload(token))
        try:
            if dir_fd is None:
                os.link(private, name)
            else:
                os.link(private, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except FileExistsError:
            os.close(fd)
            return None
        except OSError as exc:
            if exc.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EXDEV):
                raise
            os.close(fd)
            return _create_excl(name, token, dir_fd)
        return fd
    except BaseException:
        with contextlib.suppress(OSError):
            os.close(fd)
        raise
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(private, dir_fd=dir_fd)


def _drop_own_leftovers(path: Path, fd: int, dir_fd: int | None) -> None:
    """Unlink the private names :func:`_create` gives a lock file (``<lock>.<12 hex>.new``)
    that are other names of the open file ``fd``: a save killed before it removed its own
    (STORE-29, STORE-63). Names of any other form are never touched."""
    mine = os.fstat(fd)
    private = re.compile(re.escape(path.name) + r"\.[0-9a-f]{12}\.new")
    for entry in os.listdir(dir_fd if dir_fd is not None else path.parent):
        if not private.fullmatch(entry):
            continue
        where = at(path.parent, entry, dir_fd)
        with contextlib.suppress(FileNotFoundError):
            st = os.stat(where, dir_fd=dir_fd, follow_symlinks=False)
            if (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino):
                os.unlink(where, dir_fd=dir_fd)


def _create_excl(name: str | Path, token: str, dir_fd: int | None) -> int | None:
    try:
        fd = open_regular(name, os.O_RDWR | os.O_CREAT | os.O_EXCL, dir_fd=dir_fd)
    except FileExistsError:
        return None
    _flock(fd)
    os.write(fd, _payload(token))
    return fd


def _same_file(fd: int, name: str | Path, dir_fd: int | None) -> bool:
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)


def acquire_save_lock(
    root: Path, metadata_name: str, token: str, *, dir_fd: int | None = None
) -> SaveLock:
    """Take the save lock of ``root`` or raise ``ConcurrentSaveError`` naming the holder
    (STORE-29); with ``dir_fd``, in that opened directory whatever ``root`` names now
    (STORE-57)."""
    path = root / lock_name(metadata_name)
    name = at(root, lock_name(metadata_name), dir_fd)
    for _ in range(100):
        fd = _create(path, token, dir_fd)
        if fd is not None:
            return _held(path, fd, token, dir_fd)
        try:
            # a planted link or FIFO is refused (STORE-56)
            fd = open_regular(name, os.O_RDWR, dir_fd=dir_fd)
        except FileNotFoundError:
            continue  # released meanwhile: try to create it again
        try:
            got = _flock(fd)
            if got is False:
                raise ConcurrentSaveError(
                    f"another save into {root} is in progress ({_describe(_read_info(fd))}); "
                    f"this save was refused before writing anything (lock file {path})"
                )
            if not _same_file(fd, name, dir_fd):
                os.close(fd)
                continue  # the holder released it between our open and flock: start over
            if got is None and not _stale_without_flock(_read_info(fd)):
                raise ConcurrentSaveError(
                    f"{path} is held ({_describe(_read_info(fd))}) and this filesystem has no "
                    "flock to tell whether the holder is alive; remove the lock file if no save "
                    "is running"
                )
            # stale: the holder died (its flock went with it); take the lock over in place,
            # only when the file has no other name: never write through a hard link (STORE-63)
            links = os.fstat(fd).st_nlink
            if links != 1:  # a save killed between link and unlink in _create leaves its
                _drop_own_leftovers(path, fd, dir_fd)  # private name: refdcp's own, removed
                links = os.fstat(fd).st_nlink
            if links != 1:
                raise UnsafePathError(
                    f"{path}: the lock file has {links} links (a hard link to another file); "
                    "refdcp writes only files of the checkpoint that have one name, and "
                    "wrote nothing: remove the lock file if no save is running"
                )
            os.ftruncate(fd, 0)
            os.pwrite(fd, _payload(token), 0)
            return _held(path, fd, token, dir_fd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.close(fd)
            raise
    raise ConcurrentSaveError(f"could not take {path}: it kept changing hands")


def _held(path: Path, fd: int, token: str, dir_fd: int | None) -> SaveLock:
    try:
        own_dir = None if dir_fd is None else os.dup(dir_fd)
    except BaseException:
        os.close(fd)
        raise
    return SaveLock(path, fd, token, own_dir)


def _stale_without_flock(info: dict[str, Any]) -> bool:
    pid = info.get("pid")
    return (
        isinstance(pid, int)
        and info.get("host") == socket.gethostname()
        and info.get("boot_id") == boot_id()
        and not _pid_alive(pid)
    )


def live_lock_tokens(root: Path, *, dir_fd: int | None = None) -> set[str] | None:
    """Tokens of the saves holding a lock in ``root`` (or the opened directory ``dir_fd``)
    now; None when that cannot be told.

    A lock is live when its ``flock`` is held; it is probed with a shared
    ``flock``, so probing never blocks or steals a lock (STORE-31).
    """
    tokens: set[str] = set()
    try:
        names = [
            n for n in os.listdir(root if dir_fd is None else dir_fd) if n.endswith(LOCK_SUFFIX)
        ]
    except OSError:
        return None
    for name in names:
        try:
            fd = open_regular(at(root, name, dir_fd), os.O_RDONLY, dir_fd=dir_fd)
        except (FileNotFoundError, UnsafePathError):
            continue  # gone, or a link or FIFO: never a save's lock (STORE-56)
        except OSError:
            return None
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                fcntl.flock(fd, fcntl.LOCK_UN)
            except BlockingIOError:
                token = _read_info(fd).get("token")
                if not isinstance(token, str):
                    return None  # a live save whose files we cannot tell apart
                tokens.add(token)
            except OSError:
                return None
        finally:
            os.close(fd)
    return tokens
