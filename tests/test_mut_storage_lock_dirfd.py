"""The save lock taken in an opened directory, and a lock name swapped for a link (issue 28).

``acquire_save_lock(..., dir_fd=...)`` keeps its own duplicate of the directory
descriptor and closes it on release (STORE-57); when that duplicate cannot be made
the error propagates and nothing leaks. A lock file replaced by a symbolic link to
itself between the open and the ``flock`` is never taken over through the link
(STORE-56).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
from pathlib import Path

import pytest

from refdcp.storage.errors import UnsafePathError
from refdcp.storage.fs.lock import acquire_save_lock
from refdcp.storage.fs.paths import opened_dir


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.spec("STORE-57")
@pytest.mark.parametrize("stale", [False, True], ids=["free", "stale"])
def test_a_lock_taken_in_an_opened_directory_closes_its_descriptors_on_release(
    tmp_path: Path, stale: bool
) -> None:
    if stale:  # a lock file nobody holds the flock of: taken over in place
        (tmp_path / ".metadata.lock").write_text(json.dumps({"token": "aaaaaaaaaaaa"}))
    dir_fd = opened_dir(tmp_path)
    try:
        before = _open_fds()
        lock = acquire_save_lock(tmp_path, ".metadata", "0123456789ab", dir_fd=dir_fd)
        assert lock.dir_fd is not None and lock.dir_fd != dir_fd
        assert _open_fds() == before + 2  # the lock file and the lock's own directory
        lock.release()
        lock.release()  # idempotent
        assert _open_fds() == before
        assert not (tmp_path / ".metadata.lock").exists()
    finally:
        os.close(dir_fd)


@pytest.mark.spec("STORE-57")
def test_a_directory_descriptor_that_cannot_be_duplicated_fails_the_lock_leaking_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dir_fd = opened_dir(tmp_path)
    try:
        before = _open_fds()

        def no_more_fds(fd: int) -> int:
            raise OSError(errno.EMFILE, "Too many open files")

        monkeypatch.setattr(os, "dup", no_more_fds)
        with pytest.raises(OSError) as info:
            acquire_save_lock(tmp_path, ".metadata", "0123456789ab", dir_fd=dir_fd)
        assert info.value.errno == errno.EMFILE
        monkeypatch.undo()
        assert _open_fds() == before
        # the lock file left behind has no holder: the next save takes it over
        lock = acquire_save_lock(tmp_path, ".metadata", "ffffffffffff", dir_fd=dir_fd)
        assert json.loads((tmp_path / ".metadata.lock").read_text())["token"] == "ffffffffffff"
        lock.release()
    finally:
        os.close(dir_fd)


@pytest.mark.spec("STORE-56")
@pytest.mark.parametrize("by_dir_fd", [False, True], ids=["path", "dir_fd"])
def test_a_lock_name_turned_into_a_link_to_the_opened_file_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, by_dir_fd: bool
) -> None:
    """Between our open of a stale lock and its flock, the name becomes a symbolic link to
    the very file we opened: the link is never taken as the lock, and its target is not
    written to."""
    path = tmp_path / ".metadata.lock"
    moved = tmp_path / "elsewhere"
    stale = json.dumps({"token": "aaaaaaaaaaaa"})
    path.write_text(stale)
    real = fcntl.flock
    swapped = [0]

    def swapping(fd: int, op: int) -> None:
        if not swapped[0] and os.readlink(f"/proc/self/fd/{fd}") == str(path):
            swapped[0] = 1
            os.rename(path, moved)
            os.symlink(moved.name, path)
        real(fd, op)

    monkeypatch.setattr(fcntl, "flock", swapping)
    dir_fd = opened_dir(tmp_path) if by_dir_fd else None
    try:
        before = _open_fds()
        with pytest.raises(UnsafePathError, match="symbolic link"):
            acquire_save_lock(tmp_path, ".metadata", "0123456789ab", dir_fd=dir_fd)
        assert swapped[0] == 1
        assert _open_fds() == before
    finally:
        if dir_fd is not None:
            os.close(dir_fd)
    assert moved.read_text() == stale
    assert path.is_symlink()


@pytest.mark.spec("STORE-57")
@pytest.mark.parametrize("by_dir_fd", [False, True], ids=["path", "dir_fd"])
def test_release_leaves_a_link_that_replaced_the_lock_name(tmp_path: Path, by_dir_fd: bool) -> None:
    """The lock name now a symbolic link to the held lock file (moved away): it is not the
    lock any more, and release does not remove it."""
    dir_fd = opened_dir(tmp_path) if by_dir_fd else None
    try:
        lock = acquire_save_lock(tmp_path, ".metadata", "0123456789ab", dir_fd=dir_fd)
        path = tmp_path / ".metadata.lock"
        os.rename(path, tmp_path / "moved")
        os.symlink("moved", path)
        lock.release()
        assert path.is_symlink() and (tmp_path / "moved").exists()
    finally:
        if dir_fd is not None:
            os.close(dir_fd)
