"""A problem of ``.metadata`` itself is reported at offset 0 of ``.metadata`` (issue 28).

``verify_checkpoint`` names every problem with fqn, file and offset (INTEG-6);
for what is wrong with the metadata as a whole (refused by the safe unpickler, a
format it does not know, chunks that do not tile a tensor, FMT-28, or two
records sharing bytes, FMT-29) the file is ``.metadata`` and the offset 0. An
item is read in pieces of at most 8 MiB (INTEG-10), one data file open at a time
(STORE-28).
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import pytest
import torch

import refdcp
from refdcp.storage.fs.metadata_file import metadata_identity
from refdcp.storage.metadata.safe import dump_metadata, load_metadata
from refdcp.storage.verify import (
    Problem,
    _FileRanges,
    _identity_now,
    verify_checkpoint,
    verify_ranges,
)

SINGLE_PATH = "mutation-kill tests pinning one module of the default path (tests/MUTATION.md); the behaviour runs on both in the shared suites"

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _saved(path: Path) -> Any:
    refdcp.save({"a": torch.arange(16.0), "b": torch.arange(8)}, checkpoint_id=path)
    return load_metadata((path / ".metadata").read_bytes())


def _future_version(md: Any) -> bytes:
    md.version = "9.9"
    return dump_metadata(md)


def _chunk_listed_twice(md: Any) -> bytes:
    chunks = md.state_dict_metadata["a"].chunks
    chunks.append(copy.deepcopy(chunks[0]))
    return dump_metadata(md)


def _records_sharing_bytes(md: Any) -> bytes:
    by_fqn = {k.fqn: (k, info) for k, info in md.storage_data.items()}
    (_, a), (_, b) = by_fqn["a"], by_fqn["b"]
    b.relative_path, b.offset = a.relative_path, a.offset
    return dump_metadata(md)


_CASES = {
    "a global the unpickler refuses": (lambda md: b"\x80\x04cos\nsystem\n.", None, "os"),
    "a format version it does not know": (_future_version, None, "not supported"),
    "chunks that do not tile a tensor": (_chunk_listed_twice, "a", "do not tile"),
    "two records sharing bytes": (_records_sharing_bytes, None, "share"),
}


@pytest.mark.spec("INTEG-6", "FMT-28", "FMT-29")
@pytest.mark.parametrize("case", sorted(_CASES))
def test_a_problem_of_the_metadata_is_reported_at_its_offset_0(tmp_path: Path, case: str) -> None:
    make, fqn, words = _CASES[case]
    (tmp_path / ".metadata").write_bytes(make(_saved(tmp_path)))
    report = verify_checkpoint(tmp_path)
    assert not report.ok
    ours = [p for p in report.problems if words in p.message]
    assert ours, report.problems
    for p in ours:
        assert p == Problem(fqn, ".metadata", 0, p.message)


@pytest.mark.spec("INTEG-10")
def test_an_item_over_8_mib_is_read_in_pieces_of_at_most_8_mib(tmp_path: Path) -> None:
    big = torch.arange((9 << 20) // 4, dtype=torch.float32)  # a 9 MiB item
    refdcp.save({"big": big, "small": torch.ones(3)}, checkpoint_id=tmp_path)
    asked: list[int] = []

    def read_range(name: str, offset: int, length: int) -> bytes | None:
        asked.append(length)
        with open(tmp_path / name, "rb") as fh:
            fh.seek(offset)
            return fh.read(length)

    report = verify_ranges((tmp_path / ".metadata").read_bytes(), read_range, str(tmp_path))
    assert report.ok and report.items_checked == 2
    assert max(asked) <= 8 << 20 and sum(asked) > 9 << 20


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.spec("STORE-28")
def test_verify_reads_one_open_file_at_a_time(tmp_path: Path) -> None:
    names = ["__0_0.distcp", "__1_0.distcp", "__2_0.distcp"]
    for i, name in enumerate(names):
        (tmp_path / name).write_bytes(bytes([i]) * 10)
    before = _open_fds()
    ranges = _FileRanges(tmp_path)
    try:
        for _ in range(2):
            for i, name in enumerate(names):
                assert ranges(name, 2, 5) == bytes([i]) * 5
                assert ranges(name, 8, 5) == bytes([i]) * 2  # never past the file's end
                assert ranges(name, 10, 5) == b""
                assert _open_fds() == before + 1
        # a file that grows once opened is read to the end it had when opened
        assert ranges(names[0], 0, 1) == b"\x00"
        with open(tmp_path / names[0], "ab") as fh:
            fh.write(b"\xff" * 10)
        assert ranges(names[0], 8, 5) == b"\x00" * 2
        assert ranges(names[0], 10, 5) == b""
        assert ranges("__9_0.distcp", 0, 5) is None  # a missing file
        assert _open_fds() == before
    finally:
        ranges.close()
    assert _open_fds() == before


@pytest.mark.spec("INTEG-14")
def test_a_metadata_name_turned_into_a_link_is_never_the_file_that_was_read(
    tmp_path: Path,
) -> None:
    """What verify compares after checking is the identity of the name itself: a link to
    the very file it read is another file (verify would check again, and refuse the link)."""
    _saved(tmp_path)
    meta = tmp_path / ".metadata"
    read = metadata_identity(os.stat(meta))
    assert _identity_now(meta) == read
    os.rename(meta, tmp_path / "moved")
    moved = metadata_identity(os.stat(tmp_path / "moved"))
    os.symlink("moved", meta)
    assert _identity_now(meta) == metadata_identity(os.lstat(meta)) != moved
    os.unlink(meta)
    assert _identity_now(meta) is None
