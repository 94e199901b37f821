"""The fall-backs of storage/fs/paths.py (issue 28).

``open_regular`` closes what it opened when ``fstat`` fails and lets the error
through (STORE-56); ``boot_id`` is "" where the kernel's boot id cannot be
read, so the host identity a save compares is still a string (STORE-57);
``where_is`` names a directory by device and inode where ``/proc`` cannot
name it (STORE-57); ``holds_safetensors_only`` is False for a path that is
not a readable directory (API-25).
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
from pathlib import Path
from typing import Any

import pytest

import refdcp.storage.fs.paths as paths_module
from refdcp.storage.fs.paths import (
    boot_id,
    holds_safetensors_only,
    host_identity,
    open_regular,
    opened_dir,
    where_is,
)


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.spec("STORE-56")
def test_open_regular_closes_the_descriptor_when_fstat_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "f").write_bytes(b"x")
    before = _open_fds()

    def failing(fd: int) -> os.stat_result:
        raise OSError(errno.EIO, "I/O error")

    monkeypatch.setattr(os, "fstat", failing)
    with pytest.raises(OSError) as info:
        open_regular(tmp_path / "f", os.O_RDONLY)
    monkeypatch.undo()
    assert info.value.errno == errno.EIO
    assert _open_fds() == before


@pytest.mark.spec("STORE-57")
def test_an_unreadable_boot_id_is_empty_and_the_host_identity_still_a_string(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real = open

    def no_proc(file: Any, *args: Any, **kwargs: Any) -> Any:
        if str(file) == "/proc/sys/kernel/random/boot_id":
            raise PermissionError(errno.EACCES, "Permission denied", str(file))
        return real(file, *args, **kwargs)

    monkeypatch.setattr(paths_module, "open", no_proc, raising=False)
    assert boot_id() == ""
    assert host_identity() == f"{socket.gethostname()}/"


@pytest.mark.spec("STORE-57")
def test_where_is_names_the_directory_by_device_and_inode_without_proc(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dir_fd = opened_dir(tmp_path)
    try:
        assert where_is(dir_fd) == str(tmp_path)

        def no_proc(path: Any, *args: Any, **kwargs: Any) -> str:
            raise FileNotFoundError(errno.ENOENT, "No such file or directory", str(path))

        monkeypatch.setattr(os, "readlink", no_proc)
        st = tmp_path.stat()
        assert where_is(dir_fd) == f"the directory with device {st.st_dev} and inode {st.st_ino}"
    finally:
        os.close(dir_fd)


@pytest.mark.spec("API-25")
def test_holds_safetensors_only_is_false_for_what_is_not_a_readable_directory(
    tmp_path: Path,
) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"{}")
    assert holds_safetensors_only(tmp_path) is True
    assert holds_safetensors_only(tmp_path / "missing") is False
    assert holds_safetensors_only(tmp_path / "model.safetensors") is False  # a file
    (tmp_path / ".metadata").write_bytes(b"")
    assert holds_safetensors_only(tmp_path) is False


@pytest.mark.spec("STORE-57")
def test_opened_dir_opens_directories_only_and_close_on_exec(tmp_path: Path) -> None:
    (tmp_path / "f").write_bytes(b"x")
    before = _open_fds()
    with pytest.raises(NotADirectoryError):
        opened_dir(tmp_path / "f")
    assert _open_fds() == before
    dir_fd = opened_dir(tmp_path)
    try:
        assert fcntl.fcntl(dir_fd, fcntl.F_GETFD) & fcntl.FD_CLOEXEC
        assert os.listdir(dir_fd) == ["f"]
    finally:
        os.close(dir_fd)


@pytest.mark.spec("STORE-57")
def test_boot_id_is_the_kernels_and_part_of_the_host_identity() -> None:
    with open("/proc/sys/kernel/random/boot_id") as fh:
        kernel = fh.read().strip()
    assert kernel and boot_id() == kernel
    assert host_identity() == f"{socket.gethostname()}/{kernel}"


@pytest.mark.spec("STORE-59")
def test_open_regular_following_links_opens_for_reading_only_what_was_asked(
    tmp_path: Path,
) -> None:
    (tmp_path / "target").write_bytes(b"payload")
    os.symlink("target", tmp_path / "link")
    fd = open_regular(tmp_path / "link", os.O_RDONLY, follow_links=True)
    try:
        assert os.read(fd, 100) == b"payload"
        assert fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDONLY
    finally:
        os.close(fd)
