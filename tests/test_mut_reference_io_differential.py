"""The reference path's entry points, files and `.metadata` parsing against the default path
(REF-4, REF-2): the same refusals of a call without a checkpoint, the same Metadata returned,
nothing left by a failed save, the same file modes, the same checkpoint ids accepted, and the
same error class for every damaged `.metadata`, symlinked file or damaged data file.

Each case runs once per path, so the differential suite sees a reference mutant that makes the
two paths part ways; the reference-only checks are in test_mut_reference_{api,format,storage}.py.
"""

from __future__ import annotations

import functools
import os
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import crc32c
import pytest
import torch
from torch.distributed.checkpoint.metadata import Metadata

import refdcp
import refdcp.reference
from refdcp.comm import FakeWorld, SingleRank
from refdcp.reference import ReferenceReader, ReferenceWriter
from refdcp.reference import format as fmt
from refdcp.storage.metadata.safe import load_metadata as fast_load_metadata

PATHS: dict[str, Any] = {"fast": refdcp, "reference": refdcp.reference}
READERS: dict[str, Any] = {"fast": refdcp.FileSystemReader, "reference": ReferenceReader}
WRITERS: dict[str, Any] = {"fast": refdcp.FileSystemWriter, "reference": ReferenceWriter}


def _sd() -> dict[str, Any]:
    return {"a": "xyz", "w": torch.arange(5.0), "v": torch.ones(3, dtype=torch.int16)}


@pytest.mark.spec("REF-4", "REF-2", "API-5")
@pytest.mark.parametrize("impl", sorted(PATHS))
def test_both_paths_need_a_checkpoint_or_a_storage_object(impl: str, tmp_path: Path) -> None:
    api = PATHS[impl]
    with pytest.raises(ValueError, match="checkpoint_id"):
        api.save(_sd(), comm=SingleRank())
    with pytest.raises(ValueError, match="checkpoint_id"):
        api.load(_sd(), comm=SingleRank())
    md = api.save(_sd(), storage_writer=WRITERS[impl](tmp_path), comm=SingleRank())
    assert isinstance(md, Metadata) and set(md.state_dict_metadata) == {"a", "w", "v"}
    out = {"a": "", "w": torch.zeros(5), "v": torch.zeros(3, dtype=torch.int16)}
    api.load(out, storage_reader=READERS[impl](tmp_path), comm=SingleRank())
    assert out["a"] == "xyz" and torch.equal(out["w"], torch.arange(5.0))


@pytest.mark.spec("REF-4", "REF-2")
def test_both_paths_return_the_metadata_they_commit(tmp_path: Path) -> None:
    got = {
        impl: api.save(_sd(), checkpoint_id=tmp_path / impl, comm=SingleRank())
        for impl, api in PATHS.items()
    }
    assert got["fast"].state_dict_metadata == got["reference"].state_dict_metadata
    for impl in PATHS:
        stored = READERS[impl](tmp_path / impl).read_metadata()
        assert got[impl].state_dict_metadata == stored.state_dict_metadata


class _Boom:
    def __reduce__(self) -> tuple[object, ...]:
        raise RuntimeError("cannot pickle")


@pytest.mark.spec("REF-4", "REF-8", "STORE-31")
@pytest.mark.parametrize("impl", sorted(PATHS))
def test_a_failed_save_leaves_nothing_on_either_path(impl: str, tmp_path: Path) -> None:
    planner = (
        refdcp.reference.ReferenceSavePlanner(check_replicas=False) if impl == "reference" else None
    )
    with pytest.raises(refdcp.CheckpointError) as info:
        PATHS[impl].save(
            {"w": torch.ones(2), "x": _Boom()},
            checkpoint_id=tmp_path,
            comm=SingleRank(),
            planner=planner,
        )
    assert info.value.committed is False
    assert os.listdir(tmp_path) == []


@pytest.mark.spec("REF-4", "REF-2", "STORE-7")
def test_both_paths_write_files_with_the_same_modes(tmp_path: Path) -> None:
    modes = {}
    for impl, api in PATHS.items():
        api.save(_sd(), checkpoint_id=tmp_path / impl, comm=SingleRank())
        modes[impl] = sorted(
            (p.name == ".metadata", p.stat().st_mode) for p in (tmp_path / impl).iterdir()
        )
    assert modes["fast"] == modes["reference"] and len(modes["fast"]) == 2


@pytest.mark.spec("REF-4", "API-7")
@pytest.mark.parametrize("cid", ["a/b", Path("x"), "s3://x", "file://x"])
def test_both_writers_and_readers_accept_the_same_checkpoint_ids(cid: Any) -> None:
    assert ReferenceWriter.validate_checkpoint_id(cid) == (
        refdcp.FileSystemWriter.validate_checkpoint_id(cid)
    )
    assert ReferenceReader.validate_checkpoint_id(cid) == (
        refdcp.FileSystemReader.validate_checkpoint_id(cid)
    )


def _metadata_cases() -> dict[str, bytes]:
    good = fmt.dump_metadata(Metadata(state_dict_metadata={}))
    cases = {
        "good": good,
        "flipped": good[:5] + bytes([good[5] ^ 1]) + good[6:],
        "trailer without newline": good[:-1] + b"x",
        "foreign global": b"cbuiltins\nfloat32\n.",
        "persistent id": b"P0\n.",
        "not a Metadata": pickle.dumps([1]),
        "garbage": b"\x80\x04garbage",
    }
    crc = good[-9:-1]
    cases["wrong checksum"] = good[:-9] + (b"0" if crc[:1] != b"0" else b"1") + good[-8:]
    cases.update(_record_cases())
    md = Metadata(state_dict_metadata={})
    md.version = "9.9.9"
    cases["version"] = fmt.dump_metadata(md)
    md = Metadata(state_dict_metadata={})
    md.refdcp_format = 2  # type: ignore[attr-defined]
    body = pickle.dumps(md)
    cases["format"] = body + fmt.TRAILER + b"%08x\n" % crc32c.crc32c(body)
    md = Metadata(state_dict_metadata={})
    md.refdcp_format = 1  # type: ignore[attr-defined]
    cases["refdcp without trailer"] = pickle.dumps(md)
    return cases


def _record_cases() -> dict[str, bytes]:
    """Storage records naming no plain file or with bad byte ranges. (A missing record and
    two records sharing a byte are refused by the reference's reader and by the fast path's
    load plan, both before any destination is written (FMT-29), so not at the same call.)"""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    def md(records: dict[Any, Any], **tensors: Any) -> bytes:
        sd = {
            fqn: TensorStorageMetadata(
                TensorProperties(dtype=torch.float32),
                torch.Size(size),
                [ChunkStorageMetadata(torch.Size(o), torch.Size(n)) for o, n in chunks],
            )
            for fqn, (size, chunks) in tensors.items()
        }
        return fmt.dump_metadata(Metadata(state_dict_metadata=sd, storage_data=records))

    def rec(name: Any = "__0_0.distcp", offset: Any = 0, length: Any = 8) -> Any:
        return _StorageInfo(name, offset, length)

    def at(fqn: str, *off: int) -> Any:
        return MetadataIndex(fqn, torch.Size(off))

    one = {"w": ((2,), [((0,), (2,))])}
    two = {"w": ((4,), [((0,), (2,)), ((2,), (2,))])}
    return {
        "records fine": md({at("w", 0): rec()}, **one, e=((0,), [((0,), (0,))])),
        "record names a path": md({at("w", 0): rec("a/b")}, **one),
        "record names 256 bytes": md({at("w", 0): rec("x" * 256)}, **one),
        "record names 255 bytes": md({at("w", 0): rec("x" * 255)}, **one),
        "record names dotdot": md({at("w", 0): rec("..")}, **one),
        "record offset negative": md({at("w", 0): rec(offset=-1)}, **one),
        "record length a bool": md({at("w", 0): rec(length=True)}, **one),
        "records apart": md({at("w", 0): rec(), at("w", 2): rec(offset=8)}, **two),
        "records in two files": md(
            {at("w", 0): rec(), at("w", 2): rec("__1_0.distcp", offset=0)}, **two
        ),
    }


class _Sized(bytes):
    """Stands for `.metadata` bytes of a given size without allocating them."""

    n = 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, key: Any) -> bytes:
        raise LookupError("read past the size check")


@pytest.mark.spec("REF-4", "FMT-10")
def test_both_paths_cap_the_metadata_size_alike() -> None:
    for n in ((1 << 30) + 1, 1 << 30):
        data = _Sized()
        data.n = n
        ref = _outcome(lambda data=data: fmt.load_metadata(data, "m"))
        assert ref == _outcome(lambda data=data: fast_load_metadata(data, file="m"))
        assert ref == ("UnsafeMetadataError" if n > 1 << 30 else "LookupError")


def _outcome(run: Callable[[], Any]) -> str:
    """ "ok", or the class of the error (of each rank's error, for a failed collective call)."""
    try:
        run()
    except refdcp.CheckpointError as exc:
        return ", ".join(type(f.exception).__name__ for f in exc.rank_failures.values())
    except Exception as exc:  # the class is what is compared
        return type(exc).__name__
    return "ok"


@pytest.mark.spec("REF-4", "REF-2", "FMT-6", "FMT-7", "FMT-9", "INTEG-2", "STORE-26")
@pytest.mark.parametrize("case", sorted(_metadata_cases()))
def test_both_paths_refuse_a_damaged_metadata_file_alike(case: str, tmp_path: Path) -> None:
    (tmp_path / ".metadata").write_bytes(_metadata_cases()[case])
    ref = _outcome(lambda: ReferenceReader(tmp_path).read_metadata())
    assert ref == _outcome(lambda: refdcp.FileSystemReader(tmp_path).read_metadata())
    fine = ("good", "records fine", "records apart", "records in two files")
    assert (ref == "ok") == (case in (*fine, "record names 255 bytes"))


def _load(api: Any, where: Path) -> None:
    api.load({"w": torch.zeros(64)}, checkpoint_id=where, comm=SingleRank())


def _damage(path: Path, how: str) -> None:
    data_file = next(p for p in path.iterdir() if p.suffix == ".distcp")
    if how == "missing data file":
        data_file.unlink()
    elif how == "truncated data file":
        data_file.write_bytes(data_file.read_bytes()[:-200])
    elif how == "flipped data byte":
        raw = bytearray(data_file.read_bytes())
        raw[-100] ^= 1
        data_file.write_bytes(bytes(raw))
    elif how == "symlinked data file":
        moved = path / "elsewhere"
        data_file.rename(moved)
        data_file.symlink_to(moved)
    else:  # a FIFO where the data file was
        data_file.unlink()
        os.mkfifo(data_file)


@pytest.mark.spec("REF-4", "REF-2", "STORE-27", "INTEG-3")
@pytest.mark.parametrize(
    ("how", "error"),
    [
        ("missing data file", "CorruptionError"),
        ("truncated data file", "CorruptionError"),
        ("flipped data byte", "CorruptionError"),
        ("symlinked data file", "UnsafePathError"),
        ("fifo data file", "UnsafePathError"),
    ],
)
def test_both_paths_refuse_a_damaged_data_file_alike(how: str, error: str, tmp_path: Path) -> None:
    got = {}
    for impl, api in PATHS.items():
        where = tmp_path / impl
        api.save({"w": torch.arange(64.0)}, checkpoint_id=where, comm=SingleRank())
        _damage(where, how)
        got[impl] = _outcome(functools.partial(_load, api, where))
    assert got == {"fast": error, "reference": error}


def _leftovers(path: Path) -> list[str]:
    """What a save left: the kinds of its files (a data file, the metadata, a temporary)."""
    if not path.exists():
        return []
    return sorted(p.suffix if p.name != ".metadata" else ".metadata" for p in path.iterdir())


@pytest.mark.spec("REF-4", "REF-8", "STORE-31", "SAVE-7")
@pytest.mark.parametrize("step", range(10))
def test_a_save_failing_at_any_step_leaves_the_same_files_on_both_paths(
    step: int, tmp_path: Path
) -> None:
    def fault(i: int, action: Any) -> None:
        if i == step:
            raise RuntimeError("planted")

    got = {}
    for impl, api in PATHS.items():
        where = tmp_path / impl
        try:
            api.save(_sd(), checkpoint_id=where, comm=SingleRank(), fault=fault)
            committed: bool | None = True
        except refdcp.CheckpointError as exc:
            committed = exc.committed
        got[impl] = (committed, _leftovers(where))
    assert got["fast"] == got["reference"]
    if got["fast"][0] is False:
        assert got["fast"][1] == []


def _seen_save(base: type, seen: dict[int, bool], rank: int) -> Any:
    class Seen(base):  # type: ignore[misc, valid-type]
        def set_up_planner(
            self, state_dict: Any, storage_meta: Any = None, is_coordinator: bool = False
        ) -> None:
            super().set_up_planner(state_dict, storage_meta, is_coordinator)
            seen[rank] = is_coordinator

    return Seen()


def _seen_load(base: type, seen: dict[int, bool], rank: int) -> Any:
    class Seen(base):  # type: ignore[misc, valid-type]
        def set_up_planner(
            self, state_dict: Any, metadata: Any = None, is_coordinator: bool = False
        ) -> None:
            super().set_up_planner(state_dict, metadata, is_coordinator)
            seen[rank] = is_coordinator

    return Seen()


@pytest.mark.spec("REF-4", "SAVE-1", "LOAD-1")
@pytest.mark.parametrize("coordinator", [0, 2])
def test_both_paths_tell_the_same_rank_it_coordinates(coordinator: int, tmp_path: Path) -> None:
    bases = {
        "fast": (refdcp.planning.DefaultSavePlanner, refdcp.planning.DefaultLoadPlanner),
        "reference": (refdcp.reference.ReferenceSavePlanner, refdcp.reference.ReferenceLoadPlanner),
    }
    got = {}
    for impl, api in PATHS.items():
        saw: dict[int, bool] = {}
        loaded: dict[int, bool] = {}
        where = tmp_path / impl
        save_base, load_base = bases[impl]
        FakeWorld(3, coordinator_rank=coordinator).run(
            lambda c, api=api, where=where, base=save_base, saw=saw: api.save(
                {"w": torch.ones(4)},
                checkpoint_id=where,
                comm=c,
                planner=_seen_save(base, saw, c.rank),
            )
        )
        FakeWorld(3, coordinator_rank=coordinator).run(
            lambda c, api=api, where=where, base=load_base, loaded=loaded: api.load(
                {"w": torch.zeros(4)},
                checkpoint_id=where,
                comm=c,
                planner=_seen_load(base, loaded, c.rank),
            )
        )
        got[impl] = (saw, loaded)
    want = {r: r == coordinator for r in range(3)}
    assert got["fast"] == got["reference"] == (want, want)


@pytest.mark.spec("REF-4", "REF-2", "PLAN-6")
def test_each_path_loads_the_objects_and_tensors_the_other_saved(tmp_path: Path) -> None:
    sd = {"a": {"k": [1, "two"]}, "s": "xyz", "w": torch.arange(5.0), "n": 7}  # "a.k.0", ...
    for impl, api in PATHS.items():
        api.save(sd, checkpoint_id=tmp_path / impl, comm=SingleRank())
    for loader, saved in (("fast", "reference"), ("reference", "fast")):
        out: dict[str, Any] = {"a": {"k": [0, ""]}, "s": "", "w": torch.zeros(5), "n": 0}
        PATHS[loader].load(out, checkpoint_id=tmp_path / saved, comm=SingleRank())
        assert out["a"] == sd["a"] and out["s"] == "xyz" and out["n"] == 7
        assert torch.equal(out["w"], sd["w"])
