"""Data-file names and how readers open them (STORE-26, STORE-27, STORE-28; issue 13).

Only plain names pass ``check_data_name``; ``open_data_file`` opens regular
files only (a symbolic link, directory or FIFO is refused with
``UnsafePathError`` without blocking, a missing file is ``FileNotFoundError``);
``pread_exact`` / ``pread_into`` never return more than asked nor past the end.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from refdcp.storage.errors import UnsafePathError
from refdcp.storage.fs.paths import (
    MAX_NAME_BYTES,
    check_data_name,
    open_data_file,
    pread_exact,
    pread_into,
)


@pytest.mark.spec("STORE-26")
@pytest.mark.parametrize(
    "name", ["a", "__0_0.distcp", "...", ".hidden", "a b", "é" * 127, "n" * MAX_NAME_BYTES, "a..b"]
)
def test_plain_names_pass(name: str) -> None:
    assert check_data_name(name) == name


@pytest.mark.spec("STORE-26")
@pytest.mark.parametrize(
    "name",
    ["", ".", "..", "a/b", "/abs", "../x", "a\\b", "a\x00", "n" * 256, "é" * 128, "\udcff" * 128],
)
def test_other_names_are_refused_naming_file_and_item(name: str) -> None:
    with pytest.raises(
        UnsafePathError, match=r"^ckpt/\.metadata: data-file name .* \(item 'w'\) is not a plain"
    ):
        check_data_name(name, file="ckpt/.metadata", fqn="w")
    with pytest.raises(UnsafePathError) as err:
        check_data_name(name)
    assert "(item" not in str(err.value) and str(err.value).startswith(".metadata: ")


@pytest.mark.spec("STORE-26")
@pytest.mark.parametrize("name", [None, 3, b"x", Path("x")])
def test_a_name_that_is_not_a_str_is_refused(name: object) -> None:
    with pytest.raises(
        UnsafePathError,
        match=f"data-file name \\(item 'w'\\) is a {type(name).__name__}, not a str",
    ):
        check_data_name(name, fqn="w")


@pytest.mark.spec("STORE-27")
def test_a_regular_file_opens_read_only(tmp_path: Path) -> None:
    (tmp_path / "d.distcp").write_bytes(b"0123456789")
    fd = open_data_file(tmp_path, "d.distcp")
    try:
        assert os.pread(fd, 4, 2) == b"2345"
        with pytest.raises(OSError):
            os.write(fd, b"x")
    finally:
        os.close(fd)


@pytest.mark.spec("STORE-27")
def test_a_symbolic_link_is_refused_even_to_a_regular_file(tmp_path: Path) -> None:
    (tmp_path / "real").write_bytes(b"x")
    (tmp_path / "link.distcp").symlink_to(tmp_path / "real")
    with pytest.raises(UnsafePathError, match=r"link\.distcp: is a symbolic link"):
        open_data_file(tmp_path, "link.distcp")


@pytest.mark.spec("STORE-27")
def test_a_missing_file_is_file_not_found_not_unsafe(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError) as err:
        open_data_file(tmp_path, "missing.distcp")
    assert not isinstance(err.value, UnsafePathError)


@pytest.mark.spec("STORE-27")
def test_other_os_errors_propagate_as_they_are(tmp_path: Path) -> None:
    (tmp_path / "f").write_bytes(b"x")
    with pytest.raises(NotADirectoryError):
        open_data_file(tmp_path / "f", "x.distcp")


@pytest.mark.spec("STORE-27")
def test_a_directory_or_fifo_is_refused_without_blocking(tmp_path: Path) -> None:
    (tmp_path / "dir.distcp").mkdir()
    before = len(os.listdir("/proc/self/fd"))
    with pytest.raises(
        UnsafePathError, match=r"dir\.distcp: is not a regular file \(a directory\)"
    ):
        open_data_file(tmp_path, "dir.distcp")
    os.mkfifo(tmp_path / "fifo.distcp")
    with pytest.raises(UnsafePathError, match=r"is not a regular file \(a FIFO\)"):
        open_data_file(tmp_path, "fifo.distcp")
    assert len(os.listdir("/proc/self/fd")) == before  # a refused file is closed


@pytest.mark.spec("STORE-27")
def test_a_character_device_is_refused(tmp_path: Path) -> None:
    with pytest.raises(UnsafePathError, match=r"is not a regular file \(a character device\)"):
        open_data_file("/dev", "null")


@pytest.mark.spec("STORE-27", "STORE-26")
def test_open_checks_the_name_first(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "f").write_bytes(b"x")
    with pytest.raises(UnsafePathError, match=r"\(item 'k'\)"):
        open_data_file(tmp_path, "sub/f", fqn="k")


@pytest.mark.spec("STORE-28")
def test_pread_reads_exactly_what_is_there(tmp_path: Path) -> None:
    (tmp_path / "f").write_bytes(bytes(range(100)))
    fd = os.open(tmp_path / "f", os.O_RDONLY)
    try:
        assert pread_exact(fd, 10, 5) == bytes(range(5, 15))
        assert pread_exact(fd, 10, 95) == bytes(range(95, 100))
        assert pread_exact(fd, 10, 100) == b""
        assert pread_exact(fd, 0, 0) == b""
        buf = bytearray(b"\xff" * 20)
        assert pread_into(fd, memoryview(buf), 90) == 10
        assert bytes(buf[:10]) == bytes(range(90, 100)) and bytes(buf[10:]) == b"\xff" * 10
    finally:
        os.close(fd)
