"""The save lock through its public functions (STORE-29, STORE-30, STORE-31; issue 13).

``acquire_save_lock`` takes a free or stale lock and refuses a held one,
naming the holder; a lock is stale exactly when its ``flock`` is free, or,
on a filesystem without ``flock``, when it names this host and boot and a dead
pid. Filesystems without hard links or without ``flock`` are simulated by
making ``os.link`` / ``fcntl.flock`` fail with the errno such filesystems give.
"""

from __future__ import annotations

import errno
import fcntl
import json
import multiprocessing as mp
import os
import socket
from pathlib import Path
from typing import Any

import pytest

import refdcp.storage.fs.paths as paths_module
from refdcp.storage.errors import ConcurrentSaveError
from refdcp.storage.fs.lock import acquire_save_lock, live_lock_tokens, lock_name

_BOOT = Path("/proc/sys/kernel/random/boot_id")


def _boot_id() -> str:
    try:
        return _BOOT.read_text().strip()
    except OSError:
        return ""


def _dead_pid() -> int:
    p = mp.get_context("fork").Process(target=os._exit, args=(0,))
    p.start()
    p.join()
    assert p.pid is not None
    return p.pid


def _info(path: Path) -> dict[str, Any]:
    info = json.loads(path.read_text())
    assert isinstance(info, dict)
    return info


@pytest.mark.spec("STORE-29")
def test_lock_names() -> None:
    assert lock_name(".metadata") == ".metadata.lock"
    assert lock_name("__3.metadata") == "__3.metadata.lock"


@pytest.mark.spec("STORE-29")
def test_a_free_lock_is_taken_filled_in_and_released(tmp_path: Path) -> None:
    lock = acquire_save_lock(tmp_path, ".metadata", "0123456789ab")
    path = tmp_path / ".metadata.lock"
    assert lock.held and lock.path == path and lock.token == "0123456789ab"
    info = _info(path)
    assert info["pid"] == os.getpid() and info["host"] == socket.gethostname()
    assert info["token"] == "0123456789ab" and info["boot_id"] == _boot_id()
    assert isinstance(info["start"], float)
    assert sorted(os.listdir(tmp_path)) == [".metadata.lock"]  # no private file left over
    assert live_lock_tokens(tmp_path) == {"0123456789ab"}
    with pytest.raises(ConcurrentSaveError) as err:
        acquire_save_lock(tmp_path, ".metadata", "ffffffffffff")
    msg = str(err.value)
    assert f"pid {os.getpid()}" in msg and "'0123456789ab'" in msg and str(path) in msg
    assert "UTC" in msg and "before writing anything" in msg
    assert _info(path)["token"] == "0123456789ab"  # the refused save changed nothing
    lock.release()
    assert not lock.held and not path.exists()
    lock.release()  # idempotent
    assert live_lock_tokens(tmp_path) == set()
    again = acquire_save_lock(tmp_path, ".metadata", "ffffffffffff")
    assert _info(path)["token"] == "ffffffffffff"
    again.release()


@pytest.mark.spec("STORE-29")
def test_rank_local_locks_are_independent(tmp_path: Path) -> None:
    a = acquire_save_lock(tmp_path, "__0.metadata", "aaaaaaaaaaaa")
    b = acquire_save_lock(tmp_path, "__1.metadata", "bbbbbbbbbbbb")
    assert live_lock_tokens(tmp_path) == {"aaaaaaaaaaaa", "bbbbbbbbbbbb"}
    with pytest.raises(ConcurrentSaveError):
        acquire_save_lock(tmp_path, "__1.metadata", "cccccccccccc")
    a.release()
    assert live_lock_tokens(tmp_path) == {"bbbbbbbbbbbb"}
    b.release()


@pytest.mark.spec("STORE-30")
@pytest.mark.parametrize(
    "content",
    [b"", b"garbage", b"[1, 2]", json.dumps({"pid": os.getpid(), "token": "x"}).encode()],
    ids=["empty", "garbage", "a list", "a live pid"],
)
def test_a_lock_file_whose_flock_is_free_is_stale_and_taken_over_in_place(
    tmp_path: Path, content: bytes
) -> None:
    """Staleness is the flock, whatever the file says (even a live pid: it is not holding it)."""
    path = tmp_path / ".metadata.lock"
    path.write_bytes(content + b"x" * 5000)  # longer than any payload, not whitespace
    ino = path.stat().st_ino
    lock = acquire_save_lock(tmp_path, ".metadata", "0123456789ab")
    assert path.stat().st_ino == ino  # taken over in place
    assert _info(path)["token"] == "0123456789ab"  # old content truncated, not overlaid
    assert live_lock_tokens(tmp_path) == {"0123456789ab"}
    lock.release()
    assert not path.exists()


@pytest.mark.spec("STORE-29")
def test_a_released_lock_does_not_remove_a_lock_file_that_replaced_it(tmp_path: Path) -> None:
    lock = acquire_save_lock(tmp_path, ".metadata", "aaaaaaaaaaaa")
    path = tmp_path / ".metadata.lock"
    path.unlink()
    path.write_text("someone else's")
    lock.release()
    assert path.read_text() == "someone else's"


@pytest.mark.spec("STORE-29")
def test_a_live_lock_with_an_unreadable_holder_is_refused_naming_it_unknown(
    tmp_path: Path,
) -> None:
    path = tmp_path / ".metadata.lock"
    path.write_bytes(b"not json")
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # another open file holds it
        with pytest.raises(ConcurrentSaveError, match="holder unknown"):
            acquire_save_lock(tmp_path, ".metadata", "0123456789ab")
        assert live_lock_tokens(tmp_path) is None  # held, but whose files cannot be told
    finally:
        os.close(fd)


# -- a filesystem without hard links ------------------------------------------------------


@pytest.mark.spec("STORE-29")
@pytest.mark.parametrize("code", [errno.EPERM, errno.EOPNOTSUPP, errno.EXDEV])
def test_without_hard_links_the_lock_is_created_exclusively(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int
) -> None:
    def no_link(src: Any, dst: Any) -> None:
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(os, "link", no_link)
    lock = acquire_save_lock(tmp_path, ".metadata", "0123456789ab")
    path = tmp_path / ".metadata.lock"
    assert lock.held and _info(path)["token"] == "0123456789ab"
    assert sorted(os.listdir(tmp_path)) == [".metadata.lock"]
    assert live_lock_tokens(tmp_path) == {"0123456789ab"}  # flock-ed as well
    with pytest.raises(ConcurrentSaveError, match="another save into"):
        acquire_save_lock(tmp_path, ".metadata", "ffffffffffff")
    lock.release()
    assert not path.exists()


@pytest.mark.spec("STORE-29")
def test_another_link_error_propagates_and_leaves_no_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(src: Any, dst: Any) -> None:
        raise OSError(errno.EIO, "I/O error")

    monkeypatch.setattr(os, "link", broken)
    with pytest.raises(OSError, match="I/O error"):
        acquire_save_lock(tmp_path, ".metadata", "0123456789ab")
    assert os.listdir(tmp_path) == []


@pytest.mark.spec("STORE-29")
def test_a_lock_released_between_create_and_open_is_created_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The holder released it just after our link failed: try again, do not give up."""
    real = os.link
    calls = [0]

    def exists_once(src: Any, dst: Any) -> None:
        calls[0] += 1
        if calls[0] == 1:
            raise FileExistsError(errno.EEXIST, "File exists")
        real(src, dst)

    monkeypatch.setattr(os, "link", exists_once)
    lock = acquire_save_lock(tmp_path, ".metadata", "0123456789ab")
    assert calls[0] == 2 and lock.held
    assert _info(tmp_path / ".metadata.lock")["token"] == "0123456789ab"
    lock.release()


@pytest.mark.spec("STORE-29")
def test_a_lock_that_keeps_changing_hands_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def always_exists(src: Any, dst: Any) -> None:
        raise FileExistsError(errno.EEXIST, "File exists")

    monkeypatch.setattr(os, "link", always_exists)
    with pytest.raises(ConcurrentSaveError, match="kept changing hands"):
        acquire_save_lock(tmp_path, ".metadata", "0123456789ab")
    assert os.listdir(tmp_path) == []


# -- a filesystem without flock ---------------------------------------------------------


@pytest.fixture
def no_flock(monkeypatch: pytest.MonkeyPatch) -> None:
    def unsupported(fd: int, op: int) -> None:
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", unsupported)


def _write_lock(path: Path, **info: Any) -> None:
    path.write_text(json.dumps({"boot_id": _boot_id(), "host": socket.gethostname(), **info}))


@pytest.mark.spec("STORE-30")
@pytest.mark.usefixtures("no_flock")
def test_without_flock_a_free_directory_is_locked_and_a_second_save_refused(
    tmp_path: Path,
) -> None:
    lock = acquire_save_lock(tmp_path, ".metadata", "0123456789ab")
    assert _info(tmp_path / ".metadata.lock")["pid"] == os.getpid()
    with pytest.raises(ConcurrentSaveError, match="no flock to tell whether the holder is alive"):
        acquire_save_lock(tmp_path, ".metadata", "ffffffffffff")
    assert live_lock_tokens(tmp_path) is None  # liveness cannot be told
    lock.release()
    assert not (tmp_path / ".metadata.lock").exists()


@pytest.mark.spec("STORE-30")
@pytest.mark.usefixtures("no_flock")
@pytest.mark.parametrize(
    "case", ["dead pid", "live pid", "other host", "other boot", "pid a str", "no pid"]
)
def test_without_flock_only_a_dead_pid_of_this_host_and_boot_is_stale(
    tmp_path: Path, case: str
) -> None:
    path = tmp_path / ".metadata.lock"
    dead = _dead_pid()
    fields: dict[str, Any] = {
        "dead pid": {"pid": dead},
        "live pid": {"pid": os.getpid()},
        "other host": {"pid": dead, "host": socket.gethostname() + "-other"},
        "other boot": {"pid": dead, "boot_id": "not-this-boot"},
        "pid a str": {"pid": str(dead)},
        "no pid": {},
    }[case]
    _write_lock(path, token="aaaaaaaaaaaa", start=0, **fields)
    if case == "dead pid":
        lock = acquire_save_lock(tmp_path, ".metadata", "0123456789ab")
        assert _info(path)["token"] == "0123456789ab"
        lock.release()
        return
    with pytest.raises(ConcurrentSaveError, match="is held"):
        acquire_save_lock(tmp_path, ".metadata", "0123456789ab")
    assert _info(path)["token"] == "aaaaaaaaaaaa"


@pytest.mark.spec("STORE-30")
@pytest.mark.usefixtures("no_flock")
def test_without_flock_a_pid_of_another_user_counts_as_alive(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``kill(pid, 0)`` failing with EPERM means the process exists (another user's)."""
    dead = _dead_pid()
    real_kill = os.kill

    def eperm(pid: int, sig: int) -> None:
        if pid == dead and sig == 0:
            raise PermissionError(errno.EPERM, "Operation not permitted")
        real_kill(pid, sig)

    monkeypatch.setattr(os, "kill", eperm)
    _write_lock(tmp_path / ".metadata.lock", pid=dead, token="aaaaaaaaaaaa", start=0)
    with pytest.raises(ConcurrentSaveError, match="is held"):
        acquire_save_lock(tmp_path, ".metadata", "0123456789ab")


@pytest.mark.spec("STORE-30")
def test_an_unexpected_flock_error_propagates(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(fd: int, op: int) -> None:
        raise OSError(errno.EIO, "I/O error")

    monkeypatch.setattr(fcntl, "flock", broken)
    with pytest.raises(OSError, match="I/O error"):
        acquire_save_lock(tmp_path, ".metadata", "0123456789ab")
    assert os.listdir(tmp_path) == []


# -- live_lock_tokens (STORE-31) -------------------------------------------------------


@pytest.mark.spec("STORE-31")
def test_live_lock_tokens_ignores_other_files_and_stale_locks(tmp_path: Path) -> None:
    (tmp_path / "x.distcp").write_bytes(b"")
    (tmp_path / "__2.metadata.lock").write_text(json.dumps({"token": "dddddddddddd"}))  # stale
    (tmp_path / "lockfile").write_text("x")
    assert live_lock_tokens(tmp_path) == set()
    lock = acquire_save_lock(tmp_path, ".metadata", "0123456789ab")
    assert live_lock_tokens(tmp_path) == {"0123456789ab"}
    other = acquire_save_lock(tmp_path, "__2.metadata", "eeeeeeeeeeee")  # stale: taken
    assert live_lock_tokens(tmp_path) == {"0123456789ab", "eeeeeeeeeeee"}
    lock.release()
    other.release()


@pytest.mark.spec("STORE-31")
def test_live_lock_tokens_of_a_missing_directory_cannot_be_told(tmp_path: Path) -> None:
    assert live_lock_tokens(tmp_path / "missing") is None


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.spec("STORE-29")
def test_taking_refusing_and_releasing_locks_leaks_no_descriptor(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    before = _open_fds()
    for _ in range(3):
        lock = acquire_save_lock(tmp_path, ".metadata", "0123456789ab")
        with pytest.raises(ConcurrentSaveError):
            acquire_save_lock(tmp_path, ".metadata", "ffffffffffff")
        lock.release()
    assert _open_fds() == before

    real_link = os.link

    def no_link(src: Any, dst: Any) -> None:
        raise OSError(errno.EXDEV, "cross-device link")

    monkeypatch.setattr(os, "link", no_link)
    lock = acquire_save_lock(tmp_path, ".metadata", "0123456789ab")
    lock.release()
    assert _open_fds() == before

    def broken(src: Any, dst: Any) -> None:
        raise OSError(errno.EIO, "I/O error")

    monkeypatch.setattr(os, "link", broken)
    with pytest.raises(OSError):
        acquire_save_lock(tmp_path, ".metadata", "0123456789ab")
    assert _open_fds() == before
    monkeypatch.setattr(os, "link", real_link)


@pytest.mark.spec("STORE-29")
@pytest.mark.parametrize("hard_links", [True, False])
def test_the_lock_file_is_a_plain_file_others_can_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, hard_links: bool
) -> None:
    """Mode 0o644 (less the umask): other users' saves can read who holds it."""
    if not hard_links:

        def no_link(src: Any, dst: Any) -> None:
            raise OSError(errno.EPERM, "Operation not permitted")

        monkeypatch.setattr(os, "link", no_link)
    umask = os.umask(0o022)
    try:
        lock = acquire_save_lock(tmp_path, ".metadata", "0123456789ab")
    finally:
        os.umask(umask)
    assert (tmp_path / ".metadata.lock").stat().st_mode & 0o777 == 0o644
    lock.release()


@pytest.mark.spec("STORE-29")
def test_a_lock_released_between_open_and_flock_is_created_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The holder removes the lock file just before our flock: start over, never take a
    file that is no longer the lock."""
    path = tmp_path / ".metadata.lock"
    path.write_text(json.dumps({"token": "aaaaaaaaaaaa"}))  # stale: nobody holds its flock
    real = fcntl.flock
    removed = [0]

    def releasing_holder(fd: int, op: int) -> None:
        target = os.readlink(f"/proc/self/fd/{fd}")
        if target == str(path) and not removed[0]:
            removed[0] = 1
            path.unlink()  # the holder released it in between
        real(fd, op)

    monkeypatch.setattr(fcntl, "flock", releasing_holder)
    before = len(os.listdir("/proc/self/fd"))
    lock = acquire_save_lock(tmp_path, ".metadata", "0123456789ab")
    assert removed[0] == 1
    assert path.exists() and _info(path)["token"] == "0123456789ab"
    assert path.stat().st_ino == os.fstat(lock.fd).st_ino  # type: ignore[arg-type]
    lock.release()
    assert not path.exists() and len(os.listdir("/proc/self/fd")) == before


@pytest.mark.spec("STORE-31")
def test_a_lock_file_gone_between_listing_and_probing_is_skipped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    lock = acquire_save_lock(tmp_path, ".metadata", "0123456789ab")
    real = os.listdir
    monkeypatch.setattr(os, "listdir", lambda p: ["__1.metadata.lock", *real(p)])
    before = len(real("/proc/self/fd"))
    assert live_lock_tokens(tmp_path) == {"0123456789ab"}
    assert len(real("/proc/self/fd")) == before  # the probe closes what it opened
    lock.release()


@pytest.mark.spec("STORE-29")
def test_without_a_readable_boot_id_the_lock_records_an_empty_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = open

    def no_proc(file: Any, *args: Any, **kwargs: Any) -> Any:
        if str(file) == str(_BOOT):
            raise FileNotFoundError(str(file))
        return real(file, *args, **kwargs)

    monkeypatch.setattr(paths_module, "open", no_proc, raising=False)
    lock = acquire_save_lock(tmp_path, ".metadata", "0123456789ab")
    assert _info(tmp_path / ".metadata.lock")["boot_id"] == ""
    lock.release()
