"""A power-loss model for POSIX backends: record a save's file-system calls, then build
the states a power cut can leave on disk (CONF-58, CONF-59, CONF-60).

Recording. While a save runs, :class:`Recorder` replaces the Python-level entry points
of the file-system calls in ``os`` (``open``, ``write``, ``writev``, ``pwrite``,
``pwritev``, ``ftruncate``, ``truncate``, ``fsync``, ``fdatasync``, ``sync``, ``close``,
``rename``, ``replace``, ``unlink``, ``remove``, ``link``, ``mkdir``, ``rmdir``, ``dup``) and
``open`` in ``io`` and ``builtins`` (a file opened for writing gets a ``FileIO``
subclass under the usual buffered layers, so a write is recorded when it reaches the
operating system, not when it enters a Python buffer). Only calls on paths below the
location's scratch directory are recorded; the rest pass through. No ``LD_PRELOAD``,
no subprocess: it runs in the suite's process, one save at a time.

Completeness. Writes made by C code the shim cannot see (``mmap``, a C++ writer given a
path, ``copy_file_range``) would make the model wrong, so after the save the state the
model derives with every recorded call applied is compared with the disk: any difference
makes the check not applicable, naming the file, never a silent pass.

The model (weaker than ext4 ``data=ordered``; close to ext4 ``data=writeback``):

* file data: a write is durable once an ``fsync``/``fdatasync`` of its file returned
  after it; until then each 4 KiB page it touched is independently kept or lost, in
  any order, and a file grown by lost writes may keep its new size with zeros;
* directory entries (creations, renames, hard links, unlinks, ``mkdir``/``rmdir``):
  durable once an ``fsync`` of the directory holding the entry returned after them (a
  rename needs both directories); until then the operations of one directory reach the
  disk in the order they were made, as a journal gives them, so a crash keeps a prefix of
  each directory's operations, at least up to its last fsync; an ``fsync`` of a file
  does not make its name durable;
* ``os.sync()`` makes everything before it durable.

Limits: one directory's entries are never reordered (a file system that reorders them,
as POSIX allows, can lose more); renaming a directory, symbolic links and ``dir_fd``
calls relative to a directory descriptor the recorder did not see opened below the
root are not modelled (the check is then not applicable; ``dir_fd`` relative to a
recorded directory, and ``os.dup`` of it, are); writes through memory maps
or C code are not modelled (caught by the completeness comparison); the contents of
files that existed before the save are taken as durable.
"""

from __future__ import annotations

import builtins
import hashlib
import io
import os
import random
import shutil
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["PAGE", "CrashState", "Op", "Recorder", "Trace", "crash_state", "materialize"]

#: The granularity at which an un-fsynced write is torn.
PAGE = 4096

_DIR_OPS = frozenset({"create", "mkdir", "rename", "unlink", "rmdir", "link"})
_DATA_OPS = frozenset({"write", "truncate"})


@dataclass(frozen=True)
class Op:
    """One recorded call. ``dir``/``name`` (and ``dst_dir``/``dst_name`` of a rename)
    are relative to the recorded root; ``ino`` is the model's id of a file."""

    kind: str
    dir: str = ""
    name: str = ""
    ino: int = -1
    offset: int = 0
    data: bytes = b""
    dst_dir: str = ""
    dst_name: str = ""

    def dirs(self) -> tuple[str, ...]:
        if self.kind == "rename" and self.dst_dir != self.dir:
            return (self.dir, self.dst_dir)
        return (self.dir,)

    def text(self, names: dict[int, str]) -> str:
        """The call in words, for a reason (CONF-52)."""
        path = _join(self.dir, self.name)
        file = names.get(self.ino, f"file #{self.ino}")
        if self.kind == "write":
            return f"write of {len(self.data)} bytes at offset {self.offset} to {file}"
        if self.kind == "truncate":
            return f"truncate of {file} to {self.offset} bytes"
        if self.kind == "fsync":
            return f"fsync of {file}"
        if self.kind == "dirsync":
            return f"fsync of directory {self.dir or '.'}"
        if self.kind == "rename":
            return f"rename {path} -> {_join(self.dst_dir, self.dst_name)}"
        if self.kind == "sync":
            return "sync()"
        return f"{self.kind} {path}"


def _join(d: str, name: str) -> str:
    return f"{d}/{name}" if d else name


def _split(rel: str) -> tuple[str, str]:
    d, _, name = rel.rpartition("/")
    return d, name


@dataclass
class Trace:
    """What a recorded save did: the tree before it, its calls, and what the model could not follow."""

    dirs: set[str] = field(default_factory=set)
    files: dict[str, int] = field(default_factory=dict)  # path -> ino, before the save
    contents: dict[int, bytes] = field(default_factory=dict)  # ino -> content before the save
    ops: list[Op] = field(default_factory=list)
    unsupported: list[str] = field(default_factory=list)
    finish_from: int = -1  # index of the first call made inside the coordinator's finish
    names: dict[int, str] = field(default_factory=dict)  # ino -> last name, for reasons


@dataclass(frozen=True)
class CrashState:
    """A tree a power cut can leave: directories and files (path -> bytes), and what was lost."""

    dirs: frozenset[str]
    files: tuple[tuple[str, bytes], ...]
    lost: tuple[str, ...]

    def digest(self) -> str:
        h = hashlib.sha256()
        for d in sorted(self.dirs):
            h.update(b"d" + d.encode() + b"\0")
        for path, data in self.files:
            h.update(b"f" + path.encode() + b"\0" + hashlib.sha256(data).digest())
        return h.hexdigest()


def snapshot(root: Path) -> tuple[set[str], dict[str, bytes], list[str]]:
    """Directories and file contents below ``root`` (relative paths), and what is neither."""
    dirs: set[str] = set()
    files: dict[str, bytes] = {}
    odd: list[str] = []
    for base, dnames, fnames in os.walk(root):
        rel_base = os.path.relpath(base, root)
        rel_base = "" if rel_base == "." else rel_base.replace(os.sep, "/")
        for d in dnames:
            full = os.path.join(base, d)
            if os.path.islink(full):
                odd.append(f"symbolic link {_join(rel_base, d)}")
            else:
                dirs.add(_join(rel_base, d))
        for f in fnames:
            full = os.path.join(base, f)
            if os.path.islink(full) or not os.path.isfile(full):
                odd.append(f"{_join(rel_base, f)} is not a regular file")
            else:
                with _ORIG["io.open"](full, "rb") as fh:
                    files[_join(rel_base, f)] = fh.read()
    return dirs, files, odd


# --- recording ---------------------------------------------------------------------------

_ORIG: dict[str, Any] = {
    "io.open": io.open,
    "builtins.open": builtins.open,
    **{
        name: getattr(os, name)
        for name in (
            "open", "write", "writev", "pwrite", "pwritev", "ftruncate", "truncate", "fsync",
            "fdatasync", "sync", "close", "rename", "replace", "unlink", "remove", "link",
            "mkdir", "rmdir", "dup",
        )
        if hasattr(os, name)
    },
}  # fmt: skip
_ACTIVE: Recorder | None = None
_INSTALL = threading.Lock()


class Recorder:
    """Records the file-system calls below ``root`` while :meth:`recording` is active."""

    def __init__(self, root: Path) -> None:
        self.root = os.path.realpath(root)
        self.trace = Trace()
        self._lock = threading.RLock()
        self._names: dict[str, int] = {}  # the live namespace: path -> ino
        self._dirs: set[str] = set()
        self._fds: dict[int, tuple[str, Any]] = {}  # fd -> ("file", ino) | ("dir", path)
        self._append: set[int] = set()
        self._next = 0

    # -- bookkeeping
    def rel(self, path: Any, dir_fd: Any = None) -> str | None:
        """``path`` relative to the root, "" for the root, None outside it."""
        if isinstance(path, int):
            return None
        p = os.fsdecode(os.fspath(path))
        if dir_fd is not None and not os.path.isabs(p):
            known = self._fds.get(dir_fd)
            if known is None or known[0] != "dir" or "/" in p or p in (".", ".."):
                self.unsupported(f"a call with dir_fd on {p}")
                return None
            return _join(known[1], p)
        a = os.path.abspath(p)
        full = os.path.join(os.path.realpath(os.path.dirname(a)), os.path.basename(a))
        if full == self.root:
            return ""
        if full.startswith(self.root + os.sep):
            return full[len(self.root) + 1 :].replace(os.sep, "/")
        return None

    def unsupported(self, what: str) -> None:
        with self._lock:
            if what not in self.trace.unsupported:
                self.trace.unsupported.append(what)

    def _add(self, op: Op) -> None:
        self.trace.ops.append(op)

    def _new_ino(self, rel: str, content: bytes = b"") -> int:
        self._next += 1
        self.trace.contents.setdefault(self._next, content)
        self.trace.names[self._next] = rel
        return self._next

    def start(self) -> None:
        dirs, files, odd = snapshot(Path(self.root))
        for what in odd:
            self.unsupported(what)
        self._dirs = set(dirs)
        self.trace.dirs = set(dirs)
        for rel, content in files.items():
            ino = self._new_ino(rel, content)
            self._names[rel] = ino
            self.trace.files[rel] = ino

    def mark_finish(self) -> None:
        with self._lock:
            self.trace.finish_from = len(self.trace.ops)

    def opened(self, rel: str, fd: int, existed: bool, flags: int) -> None:
        with self._lock:
            if rel in self._dirs or rel == "":
                self._fds[fd] = ("dir", rel)
                return
            ino = self._names.get(rel)
            if ino is None:
                if existed:
                    self.unsupported(f"{rel} appeared without a recorded call")
                ino = self._new_ino(rel)
                self._names[rel] = ino
                self._add(Op("create", *_split(rel), ino=ino))
            elif flags & os.O_TRUNC:
                self._add(Op("truncate", ino=ino, offset=0))
            self._fds[fd] = ("file", ino)
            if flags & os.O_APPEND:
                self._append.add(fd)

    def duplicated(self, fd: int, new: int) -> None:
        with self._lock:
            kind = self._fds.get(fd)
            if kind is not None:
                self._fds[new] = kind

    def closed(self, fd: int) -> None:
        with self._lock:
            self._fds.pop(fd, None)
            self._append.discard(fd)

    def file_of(self, fd: int) -> int | None:
        kind = self._fds.get(fd)
        return kind[1] if kind is not None and kind[0] == "file" else None

    def position(self, fd: int) -> int:
        if fd in self._append:
            return os.fstat(fd).st_size
        return os.lseek(fd, 0, os.SEEK_CUR)

    def wrote(self, fd: int, offset: int, data: bytes) -> None:
        with self._lock:
            ino = self.file_of(fd)
            if ino is not None and data:
                self._add(Op("write", ino=ino, offset=offset, data=data))

    def truncated(self, ino: int, size: int) -> None:
        with self._lock:
            self._add(Op("truncate", ino=ino, offset=size))

    def synced(self, fd: int) -> None:
        with self._lock:
            kind = self._fds.get(fd)
            if kind is None:
                return
            if kind[0] == "dir":
                self._add(Op("dirsync", dir=kind[1]))
            else:
                self._add(Op("fsync", ino=kind[1]))

    def renamed(self, src: str, dst: str) -> None:
        with self._lock:
            if src in self._dirs:
                self.unsupported(f"rename of directory {src}")
                return
            ino = self._names.pop(src, None)
            if ino is None:
                self.unsupported(f"rename of {src}, which the model does not know")
                return
            self._names[dst] = ino
            self.trace.names[ino] = dst
            (sd, sn), (dd, dn) = _split(src), _split(dst)
            self._add(Op("rename", dir=sd, name=sn, ino=ino, dst_dir=dd, dst_name=dn))

    def linked(self, src: str | None, dst: str) -> None:
        with self._lock:
            ino = self._names.get(src) if src is not None else None
            if ino is None:
                self.unsupported(f"hard link {dst} to a file the model does not know")
                return
            self._names[dst] = ino
            self._add(Op("link", *_split(dst), ino=ino))

    def unlinked(self, rel: str) -> None:
        with self._lock:
            self._names.pop(rel, None)
            self._add(Op("unlink", *_split(rel)))

    def made_dir(self, rel: str) -> None:
        with self._lock:
            self._dirs.add(rel)
            self._add(Op("mkdir", *_split(rel)))

    def removed_dir(self, rel: str) -> None:
        with self._lock:
            self._dirs.discard(rel)
            self._add(Op("rmdir", *_split(rel)))

    @contextmanager
    def recording(self) -> Iterator[Recorder]:
        """Install the shim for the duration of the block (one recorder at a time)."""
        global _ACTIVE
        with _INSTALL:
            self.start()
            _ACTIVE = self
            _install()
            try:
                yield self
            finally:
                _uninstall()
                _ACTIVE = None


def _fd_of(fd: Any) -> int:
    return fd if isinstance(fd, int) else int(fd.fileno())


def _raw(buffers: Any) -> bytes:
    return b"".join(bytes(memoryview(b).cast("B")) for b in buffers)


def _w_open(path: Any, flags: int, mode: int = 0o777, *, dir_fd: Any = None) -> int:
    rec = _ACTIVE
    rel = rec.rel(path, dir_fd) if rec is not None else None
    if rec is None or rel is None:
        return int(_ORIG["open"](path, flags, mode, dir_fd=dir_fd))
    existed = _lexists(path, dir_fd)
    fd = int(_ORIG["open"](path, flags, mode, dir_fd=dir_fd))
    rec.opened(rel, fd, existed, flags)
    return fd


def _lexists(path: Any, dir_fd: Any) -> bool:
    try:
        os.stat(path, dir_fd=dir_fd, follow_symlinks=False)
    except OSError:
        return False
    return True


def _w_dup(fd: int) -> int:
    new = int(_ORIG["dup"](fd))
    if _ACTIVE is not None:
        _ACTIVE.duplicated(fd, new)
    return new


def _w_write(fd: int, data: Any) -> int:
    rec = _ACTIVE
    if rec is None or rec.file_of(fd) is None:
        return int(_ORIG["write"](fd, data))
    at = rec.position(fd)
    n = int(_ORIG["write"](fd, data))
    rec.wrote(fd, at, bytes(memoryview(data).cast("B")[:n]))
    return n


def _w_writev(fd: int, buffers: Any) -> int:
    rec = _ACTIVE
    if rec is None or rec.file_of(fd) is None:
        return int(_ORIG["writev"](fd, buffers))
    buffers = list(buffers)
    at = rec.position(fd)
    n = int(_ORIG["writev"](fd, buffers))
    rec.wrote(fd, at, _raw(buffers)[:n])
    return n


def _w_pwrite(fd: int, data: Any, offset: int) -> int:
    n = int(_ORIG["pwrite"](fd, data, offset))
    rec = _ACTIVE
    if rec is not None:
        rec.wrote(fd, offset, bytes(memoryview(data).cast("B")[:n]))
    return n


def _w_pwritev(fd: int, buffers: Any, offset: int, *flags: int) -> int:
    buffers = list(buffers)
    n = int(_ORIG["pwritev"](fd, buffers, offset, *flags))
    rec = _ACTIVE
    if rec is not None:
        rec.wrote(fd, offset, _raw(buffers)[:n])
    return n


def _w_ftruncate(fd: int, length: int) -> None:
    _ORIG["ftruncate"](fd, length)
    rec = _ACTIVE
    ino = rec.file_of(fd) if rec is not None else None
    if rec is not None and ino is not None:
        rec.truncated(ino, length)


def _w_truncate(path: Any, length: int) -> None:
    _ORIG["truncate"](path, length)
    rec = _ACTIVE
    if rec is None:
        return
    if isinstance(path, int):
        ino = rec.file_of(path)
    else:
        rel = rec.rel(path)
        ino = rec._names.get(rel) if rel is not None else None
    if ino is not None:
        rec.truncated(ino, length)


def _w_fsync(fd: Any) -> None:
    _ORIG["fsync"](fd)
    if _ACTIVE is not None:
        _ACTIVE.synced(_fd_of(fd))


def _w_fdatasync(fd: Any) -> None:
    _ORIG["fdatasync"](fd)
    if _ACTIVE is not None:
        _ACTIVE.synced(_fd_of(fd))


def _w_sync() -> None:
    _ORIG["sync"]()
    if _ACTIVE is not None:
        with _ACTIVE._lock:
            _ACTIVE._add(Op("sync"))


def _w_close(fd: int) -> None:
    _ORIG["close"](fd)
    if _ACTIVE is not None:
        _ACTIVE.closed(fd)


def _two_paths(name: str) -> Any:
    def call(src: Any, dst: Any, *, src_dir_fd: Any = None, dst_dir_fd: Any = None) -> None:
        rec = _ACTIVE
        s = rec.rel(src, src_dir_fd) if rec is not None else None
        d = rec.rel(dst, dst_dir_fd) if rec is not None else None
        _ORIG[name](src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd)
        if rec is None or (s is None and d is None):
            return
        if d is None or (s is None and name != "link"):
            rec.unsupported(f"{name} across the location's boundary: {src} -> {dst}")
        elif name == "link":
            rec.linked(s, d)
        elif s is not None:
            rec.renamed(s, d)

    return call


def _w_unlink(path: Any, *, dir_fd: Any = None) -> None:
    rec = _ACTIVE
    rel = rec.rel(path, dir_fd) if rec is not None else None
    _ORIG["unlink"](path, dir_fd=dir_fd)
    if rec is not None and rel is not None:
        rec.unlinked(rel)


def _w_mkdir(path: Any, mode: int = 0o777, *, dir_fd: Any = None) -> None:
    rec = _ACTIVE
    rel = rec.rel(path, dir_fd) if rec is not None else None
    _ORIG["mkdir"](path, mode, dir_fd=dir_fd)
    if rec is not None and rel:
        rec.made_dir(rel)


def _w_rmdir(path: Any, *, dir_fd: Any = None) -> None:
    rec = _ACTIVE
    rel = rec.rel(path, dir_fd) if rec is not None else None
    _ORIG["rmdir"](path, dir_fd=dir_fd)
    if rec is not None and rel:
        rec.removed_dir(rel)


class _RecordingFileIO(io.FileIO):
    """``FileIO`` whose writes, truncations and close are recorded."""

    def __init__(self, file: Any, mode: str, closefd: bool = True, opener: Any = None) -> None:
        rec = _ACTIVE
        rel = rec.rel(file) if rec is not None else None
        existed = os.path.lexists(file)
        super().__init__(file, mode, closefd, opener)
        self._rec = rec
        if rec is not None and rel is not None:
            flags = (os.O_TRUNC if "w" in mode else 0) | (os.O_APPEND if "a" in mode else 0)
            rec.opened(rel, self.fileno(), existed, flags)

    def write(self, b: Any) -> int:
        rec = self._rec
        at = rec.position(self.fileno()) if rec is not None else 0
        n = super().write(b)
        if rec is not None and n:
            rec.wrote(self.fileno(), at, bytes(memoryview(b).cast("B")[:n]))
        return n if n is not None else 0

    def truncate(self, size: int | None = None) -> int:
        n = super().truncate(size)
        ino = self._rec.file_of(self.fileno()) if self._rec is not None else None
        if self._rec is not None and ino is not None:
            self._rec.truncated(ino, n)
        return n

    def close(self) -> None:
        if not self.closed and self._rec is not None:
            self._rec.closed(self.fileno())
        super().close()


def _w_open_file(
    file: Any,
    mode: str = "r",
    buffering: int = -1,
    encoding: str | None = None,
    errors: str | None = None,
    newline: str | None = None,
    closefd: bool = True,
    opener: Any = None,
) -> Any:
    rec = _ACTIVE
    writes = bool(set(mode) & set("wax+"))
    if rec is None or not writes or isinstance(file, int) or rec.rel(file) is None:
        return _ORIG["io.open"](file, mode, buffering, encoding, errors, newline, closefd, opener)
    raw = _RecordingFileIO(file, "".join(c for c in mode if c in "rwax+"), closefd, opener)
    binary = "b" in mode
    if buffering == 0:
        if not binary:
            raw.close()
            raise ValueError("can't have unbuffered text I/O")
        return raw
    size = buffering if buffering > 1 else io.DEFAULT_BUFFER_SIZE
    buf: Any = io.BufferedRandom(raw, size) if "+" in mode else io.BufferedWriter(raw, size)
    if binary:
        return buf
    text = io.TextIOWrapper(buf, encoding, errors, newline, line_buffering=buffering == 1)
    text.mode = mode  # type: ignore[misc]
    return text


_PATCHES: dict[str, Any] = {
    "open": _w_open,
    "write": _w_write,
    "writev": _w_writev,
    "pwrite": _w_pwrite,
    "pwritev": _w_pwritev,
    "ftruncate": _w_ftruncate,
    "truncate": _w_truncate,
    "fsync": _w_fsync,
    "fdatasync": _w_fdatasync,
    "sync": _w_sync,
    "close": _w_close,
    "rename": _two_paths("rename"),
    "replace": _two_paths("replace"),
    "link": _two_paths("link"),
    "unlink": _w_unlink,
    "remove": _w_unlink,
    "mkdir": _w_mkdir,
    "rmdir": _w_rmdir,
    "dup": _w_dup,
}


def _install() -> None:
    for name, fn in _PATCHES.items():
        if name in _ORIG:
            setattr(os, name, fn)
    io.open = _w_open_file
    builtins.open = _w_open_file


def _uninstall() -> None:
    for name in _PATCHES:
        if name in _ORIG:
            setattr(os, name, _ORIG[name])
    io.open = _ORIG["io.open"]
    builtins.open = _ORIG["builtins.open"]


# --- crash states --------------------------------------------------------------------------


@dataclass(frozen=True)
class Policy:
    """How a crash state treats what was not yet durable.

    ``names``: "min" (every directory keeps only its durable prefix), "max" (all), or
    "random"; ``data``: the same for un-fsynced pages, or "last" (kept only in the
    file written last, as a commit record often is); ``sizes``: whether a file grown
    by lost writes keeps its new size (zeros) — "no", "yes" or "random".
    """

    label: str
    names: str
    data: str
    sizes: str


POLICIES = (
    Policy("nothing un-durable kept", "min", "min", "no"),
    Policy("everything kept (as after a kill)", "max", "max", "no"),
    Policy("names kept, un-fsynced data lost", "max", "min", "no"),
    Policy("names kept, un-fsynced data lost, sizes kept as zeros", "max", "min", "yes"),
    Policy("un-fsynced data kept, un-durable names lost", "min", "max", "no"),
    Policy("names kept, un-fsynced data kept only in the file written last", "max", "last", "no"),
)


def _pick(how: str, low: int, high: int, rng: random.Random) -> int:
    if how == "min":
        return low
    if how == "max":
        return high
    return rng.randint(low, high)


def _keep(how: str, rng: random.Random, last: bool = False) -> bool:
    return how == "max" or (how == "last" and last) or (how == "random" and rng.random() < 0.5)


def crash_state(trace: Trace, done: int, policy: Policy, rng: random.Random) -> CrashState:
    """The tree left by a power cut after the first ``done`` calls of ``trace``."""
    ops = trace.ops[:done]
    names = trace.names
    last_sync = max((i for i, op in enumerate(ops) if op.kind == "sync"), default=-1)
    # directory operations: a prefix of each directory's own, at least to its last fsync
    by_dir: dict[str, list[int]] = {}
    for i, op in enumerate(ops):
        if op.kind in _DIR_OPS:
            for d in op.dirs():
                by_dir.setdefault(d, []).append(i)
    cut: dict[str, int] = {}
    for d, idx in by_dir.items():
        synced = max(
            (i for i, op in enumerate(ops) if op.kind == "dirsync" and op.dir == d), default=-1
        )
        durable = max(synced, last_sync)
        low = sum(1 for i in idx if i < durable)
        cut[d] = _pick(policy.names, low, len(idx), rng)
    changed = True
    while changed:  # a rename between two directories is kept in both or in neither
        changed = False
        for d, idx in by_dir.items():
            for i in idx[: cut[d]]:
                for other in ops[i].dirs():
                    if i not in by_dir[other][: cut[other]]:
                        cut[other] = by_dir[other].index(i) + 1
                        changed = True
    kept_dir_ops = sorted({i for d, idx in by_dir.items() for i in idx[: cut[d]]})
    lost = [ops[i].text(names) for i in sorted(set(i for idx in by_dir.values() for i in idx))
            if i not in set(kept_dir_ops)]  # fmt: skip
    dirs = set(trace.dirs)
    files = dict(trace.files)
    for i in kept_dir_ops:
        op = ops[i]
        path = _join(op.dir, op.name)
        if op.kind in ("create", "link"):
            files[path] = op.ino
        elif op.kind == "mkdir":
            dirs.add(path)
        elif op.kind == "rmdir":
            dirs.discard(path)
        elif op.kind == "unlink":
            files.pop(path, None)
        elif op.kind == "rename":
            ino = files.pop(path, op.ino)
            files[_join(op.dst_dir, op.dst_name)] = ino
    # file data: durable to the file's last fsync; after it, page by page
    contents: dict[int, bytes] = {}
    last = max((i for i, op in enumerate(ops) if op.kind == "write"), default=-1)
    last_ino = ops[last].ino if last >= 0 else -2
    for ino in set(files.values()):
        data = bytearray(trace.contents.get(ino, b""))
        mine = [(i, op) for i, op in enumerate(ops) if op.ino == ino and op.kind in _DATA_OPS]
        synced = max(
            (i for i, op in enumerate(ops) if op.kind == "fsync" and op.ino == ino), default=-1
        )
        durable = max(synced, last_sync)
        grown = len(data)
        for i, op in mine:
            if op.kind == "truncate":
                grown = op.offset
                if i < durable or _keep(policy.data, rng, ino == last_ino):
                    del data[op.offset :]
                    data.extend(bytes(max(0, op.offset - len(data))))
                else:
                    lost.append(op.text(names) + " (never fsynced)")
                continue
            end = op.offset + len(op.data)
            grown = max(grown, end)
            pieces = range(op.offset - op.offset % PAGE, end, PAGE)
            for page in pieces:
                lo, hi = max(page, op.offset), min(page + PAGE, end)
                if i < durable or _keep(policy.data, rng, ino == last_ino):
                    if len(data) < lo:
                        data.extend(bytes(lo - len(data)))
                    data[lo:hi] = op.data[lo - op.offset : hi - op.offset]
                else:
                    lost.append(
                        f"bytes {lo}..{hi} of {names.get(ino, ino)} (written, never fsynced)"
                    )
        if len(data) < grown and (
            policy.sizes == "yes" or (policy.sizes == "random" and rng.random() < 0.5)
        ):
            data.extend(bytes(grown - len(data)))
        contents[ino] = bytes(data)
    live = {d for d in dirs if _reachable(d, dirs)}
    kept = tuple(
        sorted((p, contents[ino]) for p, ino in files.items() if _reachable(_split(p)[0], live))
    )
    return CrashState(frozenset(live), kept, tuple(lost))


def _reachable(d: str, dirs: set[str]) -> bool:
    while d:
        if d not in dirs:
            return False
        d = _split(d)[0]
    return True


def materialize(root: Path, state: CrashState) -> None:
    """Make ``root`` hold exactly ``state``."""
    for entry in os.listdir(root):
        full = root / entry
        if full.is_dir() and not full.is_symlink():
            shutil.rmtree(full)
        else:
            full.unlink()
    for d in sorted(state.dirs, key=len):
        (root / d).mkdir()
    for path, data in state.files:
        (root / path).write_bytes(data)


def differences(root: Path, state: CrashState) -> list[str]:
    """Where the disk under ``root`` differs from ``state`` (the completeness comparison)."""
    dirs, files, odd = snapshot(root)
    out = list(odd)
    want = dict(state.files)
    for path in sorted(set(files) | set(want)):
        if path not in want:
            out.append(f"{path} is on disk, made by a call the recorder did not see")
        elif path not in files:
            out.append(f"{path} was removed by a call the recorder did not see")
        elif files[path] != want[path]:
            out.append(f"{path} was written by a call the recorder did not see")
    for d in sorted(dirs ^ set(state.dirs)):
        out.append(f"directory {d} differs from the recorded calls")
    return out
