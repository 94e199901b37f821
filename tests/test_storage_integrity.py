"""Checksums, corruption detection, safe metadata, format versions (INTEG-*, FMT-*)."""

from __future__ import annotations

import io
import json
import os
import pickle
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import given
from hypothesis import strategies as st
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata

from refdcp.storage import (
    CorruptionError,
    FileSystemReader,
    FileSystemWriter,
    FormatVersionError,
    MissingChecksumError,
    UnsafeMetadataError,
    verify_checkpoint,
)
from refdcp.storage.format.items import CRC_ATTR, DATA_OFFSET_ATTR
from refdcp.storage.metadata.safe import dump_metadata, load_metadata
from refdcp.tools.verify import verify_command

SINGLE_PATH = "the fast FileSystemReader's checksum checks under torch's driver"

warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def _sd() -> dict[str, Any]:
    g = torch.Generator().manual_seed(7)
    return {
        "a": torch.randn(16, 4, generator=g),
        "b": torch.randn(33, generator=g).half(),
        "obj": {"k": [1, 2, 3]},
        "step": 11,
    }


def _dest() -> dict[str, Any]:
    return {"a": torch.zeros(16, 4), "b": torch.zeros(33).half(), "obj": {"k": None}, "step": 0}


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    d = tmp_path_factory.mktemp("pristine")
    dcp.save(_sd(), storage_writer=FileSystemWriter(d, thread_count=2), no_dist=True)
    return {p.name: p.read_bytes() for p in d.iterdir()}


def _materialise(files: dict[str, bytes], d: Path) -> None:
    d.mkdir(parents=True, exist_ok=True)
    for p in d.iterdir():
        p.unlink()
    for name, data in files.items():
        (d / name).write_bytes(data)


@pytest.mark.spec("INTEG-1", "FMT-1", "FMT-3")
def test_metadata_carries_checksums_torch_ignores(
    tmp_path: Path, pristine: dict[str, bytes]
) -> None:
    _materialise(pristine, tmp_path)
    md = pickle.loads(pristine[".metadata"])  # what torch's reader does
    assert isinstance(md, Metadata) and md.version == "1.0.0" and md.refdcp_format == 1
    for index, info in md.storage_data.items():
        assert isinstance(getattr(info, CRC_ATTR), int)
        if index.offset is not None:
            off = getattr(info, DATA_OFFSET_ATTR)
            assert (info.offset + off) % 64 == 0 or off % 64 == 0
            blob = pristine[info.relative_path][info.offset : info.offset + info.length]
            t = torch.load(io.BytesIO(blob), weights_only=True)
            assert t.is_contiguous()
    assert pristine[".metadata"].rsplit(b"#refdcp-crc32c:", 1)[1].endswith(b"\n")
    out = _dest()
    dcp.load(out, storage_reader=dcp.FileSystemReader(tmp_path), no_dist=True)
    assert torch.equal(out["a"], _sd()["a"]) and out["obj"]["k"] == [1, 2, 3]


def _load_verified(d: Path) -> dict[str, Any]:
    r = FileSystemReader(d)
    r.set_verify(True)
    out = _dest()
    dcp.load(out, storage_reader=r, no_dist=True)
    return out


def _damage(files: dict[str, bytes], name: str, pos: int, kind: str) -> dict[str, bytes]:
    data = bytearray(files[name])
    if kind == "flip":
        data[pos] ^= 0x5A
    else:
        del data[pos:]
    out = dict(files)
    out[name] = bytes(data)
    return out


@pytest.mark.spec("INTEG-3", "INTEG-4", "INTEG-6", "INTEG-2")
@given(data=st.data())
def test_random_damage_is_always_detected(
    tmp_path_factory: pytest.TempPathFactory, pristine: dict[str, bytes], data: st.DataObject
) -> None:
    d = tmp_path_factory.mktemp("damaged")
    name = data.draw(st.sampled_from(sorted(pristine)))
    kind = data.draw(st.sampled_from(["flip", "truncate"]))
    pos = data.draw(st.integers(0, len(pristine[name]) - 1))
    damaged = _damage(pristine, name, pos, kind)
    _materialise(damaged, d)
    report = verify_checkpoint(d)
    assert not report.ok
    assert any(p.file == name or p.file.endswith(name) for p in report.problems)
    with pytest.raises(CheckpointException) as info:
        _load_verified(d)
    assert (
        "CorruptionError" in repr(info.value)
        or isinstance(info.value, CorruptionError)
        or (
            "checksum" in str(info.value)
            or "truncated" in str(info.value)
            or "metadata" in str(info.value)
        )
    )


@pytest.mark.spec("INTEG-3")
def test_corruption_error_names_fqn_file_offset(tmp_path: Path, pristine: dict[str, bytes]) -> None:
    md = pickle.loads(pristine[".metadata"])
    info = next(s for i, s in md.storage_data.items() if i.fqn == "a")
    damaged = _damage(pristine, info.relative_path, info.offset + info.length - 40, "flip")
    _materialise(damaged, tmp_path)
    r = FileSystemReader(tmp_path)
    r.set_verify(True)
    meta = r.read_metadata()
    r.set_up_storage_reader(meta, True)
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    planner = DefaultLoadPlanner()
    dest = _dest()
    before = dest["a"].clone()
    planner.set_up_planner(dest, meta, True)
    with pytest.raises(CorruptionError) as err:
        r.read_data(planner.create_local_plan(), planner).wait()
    assert (err.value.fqn, err.value.file, err.value.offset) == (
        "a",
        info.relative_path,
        info.offset,
    )
    assert torch.equal(dest["a"], before)  # never delivered
    problems = verify_checkpoint(tmp_path).problems
    assert [(p.fqn, p.file, p.offset) for p in problems] == [("a", info.relative_path, info.offset)]


@pytest.mark.spec("INTEG-5", "FMT-5")
def test_torch_checkpoint_reads_but_cannot_verify(tmp_path: Path) -> None:
    dcp.save(_sd(), storage_writer=dcp.FileSystemWriter(tmp_path), no_dist=True)
    out = _dest()
    dcp.load(out, storage_reader=FileSystemReader(tmp_path), no_dist=True)
    assert torch.equal(out["b"], _sd()["b"]) and out["step"] == 11
    with pytest.raises(CheckpointException, match="no checksum"):
        _load_verified(tmp_path)
    report = verify_checkpoint(tmp_path)
    assert report.ok and report.items_checked == 0 and report.items_without_checksum == 4
    with pytest.raises(MissingChecksumError):
        from refdcp.storage.format.items import verify_blob

        verify_blob(
            b"",
            pickle.loads((tmp_path / ".metadata").read_bytes()).storage_data.popitem()[1],
            "x",
            "f",
        )


@pytest.mark.spec("INTEG-7")
def test_verify_command(
    tmp_path: Path, pristine: dict[str, bytes], capsys: pytest.CaptureFixture[str]
) -> None:
    _materialise(pristine, tmp_path)
    assert verify_command(str(tmp_path), json=False) == 0
    assert "OK" in capsys.readouterr().out
    name = next(n for n in pristine if n.endswith(".distcp"))
    _materialise(_damage(pristine, name, 100, "flip"), tmp_path)
    assert verify_command(str(tmp_path), json=True) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is False and report["problems"][0]["file"] == name
    assert {"fqn", "file", "offset", "message"} <= set(report["problems"][0])
    torch_dir = tmp_path / "torch_written"
    dcp.save(_sd(), storage_writer=dcp.FileSystemWriter(torch_dir), no_dist=True)
    assert verify_command(str(torch_dir), json=False) == 3  # nothing could be verified
    assert "UNVERIFIED" in capsys.readouterr().out


class _Payload:
    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, ("touch PWNED_BY_METADATA",))


@pytest.mark.spec("FMT-6")
def test_crafted_metadata_is_refused_without_side_effect(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    dcp.save(_sd(), storage_writer=FileSystemWriter(tmp_path / "ck"), no_dist=True)
    md = pickle.loads((tmp_path / "ck" / ".metadata").read_bytes())
    md.planner_data = {"evil": _Payload()}
    (tmp_path / "ck" / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(CheckpointException, match="not an allowed"):
        dcp.load(_dest(), storage_reader=FileSystemReader(tmp_path / "ck"), no_dist=True)
    with pytest.raises(UnsafeMetadataError, match=r"posix\.system|os\.system"):
        FileSystemReader(tmp_path / "ck").read_metadata()
    assert not verify_checkpoint(tmp_path / "ck").ok
    assert not (tmp_path / "PWNED_BY_METADATA").exists()
    raw = b"\x80\x04cbuiltins\neval\n(V1\ntR."
    with pytest.raises(UnsafeMetadataError):
        load_metadata(raw)
    assert not (tmp_path / "PWNED_BY_METADATA").exists()


@pytest.mark.spec("FMT-7")
def test_unknown_versions_are_refused(pristine: dict[str, bytes]) -> None:
    md = pickle.loads(pristine[".metadata"])
    md.version = "9.9.9"
    with pytest.raises(FormatVersionError, match=r"9\.9\.9"):
        load_metadata(pickle.dumps(md))
    md = pickle.loads(pristine[".metadata"])
    blob = dump_metadata(md)
    assert load_metadata(blob).version == "1.0.0"
    md.refdcp_format = 2
    body = pickle.dumps(md)
    import crc32c

    with pytest.raises(FormatVersionError, match="refdcp format 2"):
        load_metadata(body + b"#refdcp-crc32c:%08x\n" % crc32c.crc32c(body))


@pytest.mark.spec("INTEG-2")
def test_metadata_trailer_required_for_refdcp_metadata(pristine: dict[str, bytes]) -> None:
    blob = pristine[".metadata"]
    body = blob[: blob.rindex(b"#refdcp-crc32c:")]
    with pytest.raises(CorruptionError, match="trailer"):
        load_metadata(body)
    with pytest.raises(CorruptionError, match="checksum"):
        load_metadata(body[:-1] + b"\x00" + blob[len(body) :])
