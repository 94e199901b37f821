"""Removing what failed saves wrote, through ``cleanup``'s public functions (STORE-31..33, STORE-5).

Tokens in file names round-trip; orphans are exactly the refdcp files whose
token is neither this save's nor a live lock's and that no committed
``.metadata`` references; when that cannot be established nothing is removed.
"""

from __future__ import annotations

import os
import threading
import warnings
from pathlib import Path

import pytest
import torch

import refdcp
from refdcp.storage.format import layout
from refdcp.storage.fs.cleanup import (
    abort_writer,
    committed_references,
    reclaim_orphans,
    remove_files,
    token_of,
    wait_until_not_live,
)
from refdcp.storage.fs.lock import acquire_save_lock

SINGLE_PATH = "mutation-kill tests pinning one module of the default path (tests/MUTATION.md); the behaviour runs on both in the shared suites"

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

A, B, C, OWN = "aaaaaaaaaaaa", "bbbbbbbbbbbb", "0123456789cd", "ffffffffffff"


@pytest.mark.spec("STORE-30")
@pytest.mark.parametrize("rank", [0, 3, 17])
@pytest.mark.parametrize("n", [0, 12])
def test_the_token_of_every_name_a_save_writes_round_trips(rank: int, n: int) -> None:
    token = layout.new_save_token()
    assert token_of(layout.data_file_name(f"__{rank}_", n, token)) == token
    assert token_of(layout.metadata_temp_name(None, token)) == token
    assert token_of(layout.metadata_temp_name(rank, token)) == token


@pytest.mark.spec("STORE-30")
@pytest.mark.parametrize(
    "name",
    [
        "__0_0.distcp",  # torch's naming: no token
        ".metadata",
        "__0.metadata",
        "__0_0.ABCDEF123456.distcp",  # not lower-case hex
        "__0_0.0123456789a.distcp",  # 11 digits
        "__0_0.0123456789abc.distcp",
        "x__0_0.0123456789ab.distcp",
        "__0_0.0123456789ab.distcpx",
        ".metadata.tmp",
        ".metadata.0123.tmpx",
        "a.metadata.0123.tmp",
        ".metadata.lock",
    ],
)
def test_names_without_a_token(name: str) -> None:
    assert token_of(name) is None


def _touch(root: Path, *names: str) -> None:
    for n in names:
        (root / n).write_bytes(b"x")


def _commit(root: Path, step: int = 1) -> set[str]:
    refdcp.save({"w": torch.full((8,), float(step)), "step": step}, checkpoint_id=root)
    return set(os.listdir(root))


@pytest.mark.spec("STORE-32")
def test_orphans_without_a_committed_metadata_are_removed(tmp_path: Path) -> None:
    _touch(
        tmp_path,
        f"__0_0.{A}.distcp",
        f"__1_3.{B}.distcp",
        f".metadata.{A}.tmp",
        f"__0_0.{OWN}.distcp",
        f".metadata.{OWN}.tmp",
        "__0_0.distcp",  # torch's naming: kept unless foreign_data
        "notes.txt",
    )
    removed = reclaim_orphans(tmp_path, own_token=OWN)
    assert sorted(removed) == sorted(
        [f"__0_0.{A}.distcp", f"__1_3.{B}.distcp", f".metadata.{A}.tmp"]
    )
    assert sorted(os.listdir(tmp_path)) == sorted(
        [f"__0_0.{OWN}.distcp", f".metadata.{OWN}.tmp", "__0_0.distcp", "notes.txt"]
    )
    assert reclaim_orphans(tmp_path, own_token=OWN, foreign_data=True) == ["__0_0.distcp"]


@pytest.mark.spec("STORE-32")
def test_rank_local_reclaim_touches_only_that_ranks_files(tmp_path: Path) -> None:
    _touch(
        tmp_path,
        f"__0_0.{A}.distcp",
        f"__1_0.{A}.distcp",
        f"__1.metadata.{A}.tmp",
        f"__0.metadata.{A}.tmp",
        f".metadata.{A}.tmp",
        "__1_0.distcp",
        "__0_0.distcp",
    )
    removed = reclaim_orphans(tmp_path, own_token=OWN, rank_prefix="__1_", foreign_data=True)
    assert sorted(removed) == sorted([f"__1_0.{A}.distcp", f"__1.metadata.{A}.tmp", "__1_0.distcp"])
    removed = reclaim_orphans(tmp_path, own_token=OWN)
    assert sorted(removed) == sorted([f"__0_0.{A}.distcp", f".metadata.{A}.tmp"])


@pytest.mark.spec("STORE-33")
def test_files_of_a_live_save_are_kept(tmp_path: Path) -> None:
    _touch(tmp_path, f"__0_0.{A}.distcp", f".metadata.{A}.tmp", f"__0_0.{B}.distcp")
    live = acquire_save_lock(tmp_path, "__4.metadata", A)
    try:
        assert reclaim_orphans(tmp_path, own_token=OWN) == [f"__0_0.{B}.distcp"]
    finally:
        live.release()
    assert sorted(reclaim_orphans(tmp_path, own_token=OWN)) == sorted(
        [f"__0_0.{A}.distcp", f".metadata.{A}.tmp"]
    )


@pytest.mark.spec("STORE-33")
def test_a_live_lock_whose_token_cannot_be_read_keeps_everything(tmp_path: Path) -> None:
    import fcntl

    _touch(tmp_path, f"__0_0.{A}.distcp", f".metadata.{A}.tmp")
    (tmp_path / "__9.metadata.lock").write_text("no json")
    fd = os.open(tmp_path / "__9.metadata.lock", os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        assert reclaim_orphans(tmp_path, own_token=OWN) == []
    finally:
        os.close(fd)
    assert len(reclaim_orphans(tmp_path, own_token=OWN)) == 2


@pytest.mark.spec("STORE-33")
def test_committed_files_are_never_removed(tmp_path: Path) -> None:
    committed = _commit(tmp_path)
    data = sorted(n for n in committed if n.endswith(".distcp"))
    assert data and committed_references(tmp_path) == set(data)
    # orphans of two other saves: the metadata is parsed, only unreferenced files go
    _touch(tmp_path, f"__0_0.{A}.distcp", f"__0_1.{B}.distcp", f".metadata.{A}.tmp")
    removed = reclaim_orphans(tmp_path, own_token=OWN)
    assert sorted(removed) == sorted(
        [f"__0_0.{A}.distcp", f"__0_1.{B}.distcp", f".metadata.{A}.tmp"]
    )
    assert set(os.listdir(tmp_path)) == committed
    out = {"w": torch.zeros(8), "step": 0}
    refdcp.load(out, checkpoint_id=tmp_path, verify=True)
    assert out["step"] == 1


@pytest.mark.spec("STORE-33")
def test_a_single_foreign_token_beside_a_committed_metadata_is_kept_unparsed(
    tmp_path: Path,
) -> None:
    """Every candidate shares one token: almost surely the committed save's; nothing removed."""
    committed = _commit(tmp_path)
    (tmp_path / ".metadata").write_bytes(b"unparsable")  # proves the metadata is not read
    assert reclaim_orphans(tmp_path, own_token=OWN) == []
    assert set(os.listdir(tmp_path)) == committed


@pytest.mark.spec("STORE-33")
def test_an_unreadable_committed_metadata_keeps_every_data_file(tmp_path: Path) -> None:
    _touch(tmp_path, f"__0_0.{A}.distcp", f"__0_0.{B}.distcp", f".metadata.{A}.tmp")
    (tmp_path / ".metadata").write_bytes(b"garbage")
    assert committed_references(tmp_path) is None
    # temps are never committed data: they still go
    assert reclaim_orphans(tmp_path, own_token=OWN) == [f".metadata.{A}.tmp"]
    assert sorted(os.listdir(tmp_path)) == sorted(
        [".metadata", f"__0_0.{A}.distcp", f"__0_0.{B}.distcp"]
    )


@pytest.mark.spec("STORE-5")
def test_a_caller_that_knows_the_references_skips_parsing(tmp_path: Path) -> None:
    _touch(tmp_path, f"__0_0.{A}.distcp", f"__0_0.{B}.distcp", "__0_0.distcp", "__1_0.distcp")
    (tmp_path / ".metadata").write_bytes(b"garbage")
    removed = reclaim_orphans(
        tmp_path,
        own_token=OWN,
        referenced={f"__0_0.{A}.distcp", "__1_0.distcp"},
        committed_name=".metadata",  # the references of .metadata: it is not parsed
        foreign_data=True,
    )
    assert sorted(removed) == sorted([f"__0_0.{B}.distcp", "__0_0.distcp"])


@pytest.mark.spec("STORE-33")
def test_known_references_still_honour_another_committed_metadata(tmp_path: Path) -> None:
    _touch(tmp_path, f"__0_0.{A}.distcp", f"__0_0.{B}.distcp")
    (tmp_path / ".metadata").write_bytes(b"garbage")  # known below: not parsed
    (tmp_path / "__0.metadata").write_bytes(b"garbage")  # another checkpoint, unreadable
    removed = reclaim_orphans(
        tmp_path,
        own_token=OWN,
        referenced={f"__0_0.{A}.distcp"},
        committed_name=".metadata",
        foreign_data=True,
    )
    assert removed == []  # __0.metadata might reference B: nothing is removed


@pytest.mark.spec("STORE-33")
def test_committed_references_of_rank_metadata_and_missing_files(tmp_path: Path) -> None:
    committed = _commit(tmp_path)
    data = {n for n in committed if n.endswith(".distcp")}
    md = (tmp_path / ".metadata").read_bytes()
    (tmp_path / "__3.metadata").write_bytes(md)
    assert committed_references(tmp_path) == data
    # a name that vanished meanwhile is skipped, other names are ignored
    assert committed_references(tmp_path, ["__7.metadata", ".metadata", "x.metadata"]) == data
    assert committed_references(tmp_path, []) == set()
    assert committed_references(tmp_path / "missing") is None


@pytest.mark.spec("STORE-31")
def test_remove_files_reports_what_it_removed_and_warns_on_failure(tmp_path: Path) -> None:
    _touch(tmp_path, "a", "b")
    (tmp_path / "d").mkdir()
    with pytest.warns(UserWarning, match="could not remove") as caught:
        removed = remove_files(tmp_path, ["a", "missing", "d", "b"])
    assert caught[0].filename == __file__  # blames the caller of remove_files
    assert removed == ["a", "b"]
    assert os.listdir(tmp_path) == ["d"]


@pytest.mark.spec("STORE-31")
def test_reclaim_in_a_missing_directory_removes_nothing(tmp_path: Path) -> None:
    assert reclaim_orphans(tmp_path / "missing", own_token=OWN) == []


@pytest.mark.spec("STORE-31")
def test_wait_until_not_live(tmp_path: Path) -> None:
    assert wait_until_not_live(tmp_path, A, 0.0) is True  # no lock at all
    lock = acquire_save_lock(tmp_path, ".metadata", A)
    assert wait_until_not_live(tmp_path, B, 5.0) is True  # another token
    assert wait_until_not_live(tmp_path, A, 0.05) is False  # still held after the timeout
    release = threading.Timer(0.2, lock.release)
    release.start()
    try:
        assert wait_until_not_live(tmp_path, A, 60.0) is True
    finally:
        release.join()


class _Writer:
    def __init__(self, fail: bool) -> None:
        self.fail, self.calls = fail, 0

    def abort_save(self) -> None:
        self.calls += 1
        if self.fail:
            raise RuntimeError("disk gone")


@pytest.mark.spec("STORE-31")
def test_abort_writer_calls_abort_save_and_never_raises() -> None:
    ok, bad = _Writer(False), _Writer(True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        abort_writer(ok)
        abort_writer(object())  # a writer without abort_save: nothing to do
    assert ok.calls == 1
    with pytest.warns(UserWarning, match="cleaning up after a failed save failed: disk gone") as w:
        abort_writer(bad)
    assert w[0].filename == __file__  # blames the caller of abort_writer
    assert bad.calls == 1
