"""What a plain load of either implementation (``impl``) detects and accepts by default (LOAD-7..10)."""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import decimal
import enum
import fractions
import pathlib
import uuid
import warnings
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

import refdcp
from refdcp.comm import FakeWorld
from refdcp.errors import CheckpointError
from refdcp.storage import CorruptionError
from refdcp.storage.metadata.safe_globals import UnsafeObjectError, default_safe_globals

warnings.filterwarnings("ignore", message="torch.distributed is disabled")


class Color(enum.Enum):
    RED = 1


@dataclasses.dataclass
class Config:
    lr: float = 0.1


def _data_values() -> dict[str, Any]:
    return {
        "rng": np.random.RandomState(3).get_state(),
        "arr": np.arange(6.0).reshape(2, 3),
        "rec": np.zeros(2, dtype=[("x", "f4"), ("y", "i8")]),
        "obj_arr": np.array([1, "a"], dtype=object),
        "i32": np.int32(7),
        "ns": argparse.Namespace(lr=0.1, name="run"),
        "dt": datetime.datetime(2024, 1, 2, 3, 4, tzinfo=datetime.timezone.utc),
        "date": datetime.date(2024, 1, 2),
        "td": datetime.timedelta(seconds=5),
        "dec": decimal.Decimal("1.10"),
        "frac": fractions.Fraction(1, 3),
        "uuid": uuid.UUID(int=5),
        "fs": frozenset({1, 2}),
        "sl": slice(1, 9, 2),
        "rg": range(2, 8),
        "path": pathlib.PurePosixPath("/data/x"),
    }


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, tuple):
        return type(a) is type(b) and len(a) == len(b) and all(map(_equal, a, b))
    if isinstance(a, np.ndarray):
        return type(b) is np.ndarray and a.dtype == b.dtype and a.tolist() == b.tolist()
    return type(a) is type(b) and bool(a == b)


def _torch_save_dcp(sd: dict[str, Any], path: Path) -> None:
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(str(path)), no_dist=True)


@pytest.mark.spec("LOAD-7")
@pytest.mark.parametrize("writer", ["refdcp", "torch"])
def test_common_data_values_load_by_default(impl: ModuleType, tmp_path: Path, writer: str) -> None:
    saved = {"w": torch.ones(2), **_data_values()}
    if writer == "refdcp":
        impl.save(saved, checkpoint_id=tmp_path, no_dist=True)
    else:
        _torch_save_dcp(saved, tmp_path)
    dest: dict[str, Any] = {k: None for k in saved}
    dest["w"] = torch.zeros(2)
    impl.load(dest, checkpoint_id=tmp_path, no_dist=True)
    for k, v in saved.items():
        if k != "w":
            assert _equal(v, dest[k]), k
    assert torch.equal(dest["w"], torch.ones(2))


@pytest.mark.spec("LOAD-7")
def test_allow_list_holds_no_code_running_callables() -> None:
    # single path: default_safe_globals is the default path's allow list
    import builtins

    names = set()
    for g in default_safe_globals():
        obj = g[0] if isinstance(g, tuple) else g
        names.add(f"{getattr(obj, '__module__', '')}.{getattr(obj, '__qualname__', '')}")
    for dangerous in ("eval", "exec", "getattr", "__import__", "open", "compile"):
        assert f"builtins.{dangerous}" not in names
        assert getattr(builtins, dangerous) not in default_safe_globals()
    assert not any(n.startswith(("os.", "subprocess.", "posix.", "importlib.")) for n in names)


@pytest.mark.spec("LOAD-8", "LOAD-9", "LOAD-18")
def test_refused_value_names_key_class_and_option(impl: ModuleType, tmp_path: Path) -> None:
    # the save must be told the classes are allowed (SAVE-12); a load without them refuses
    saver = impl.DefaultSavePlanner(safe_globals=[Config, Color])
    impl.save(
        {"cfg": Config(), "color": Color.RED}, checkpoint_id=tmp_path, no_dist=True, planner=saver
    )
    dest: dict[str, Any] = {"cfg": None}
    with pytest.raises(CheckpointError) as err:
        impl.load(dest, checkpoint_id=tmp_path, no_dist=True)
    (exc,) = [f.exception for f in err.value.rank_failures.values()]
    assert isinstance(exc, UnsafeObjectError)
    msg = str(exc)
    assert "'cfg'" in msg and f"{__name__}.Config" in msg and "safe_globals=" in msg
    assert exc.fqn == "cfg" and exc.refused == f"{__name__}.Config"
    assert dest == {"cfg": None}  # nothing applied (LOAD-5)
    # the option the message names makes it load
    impl.load(dest, checkpoint_id=tmp_path, no_dist=True, safe_globals=[Config])
    assert dest["cfg"] == Config()
    dest2: dict[str, Any] = {"color": None}
    planner = impl.DefaultLoadPlanner(safe_globals=[Color])
    impl.load(dest2, checkpoint_id=tmp_path, no_dist=True, planner=planner)
    assert dest2["color"] is Color.RED


@pytest.mark.spec("LOAD-9")
def test_refused_value_fails_every_rank(impl: ModuleType, tmp_path: Path) -> None:
    saver = impl.DefaultSavePlanner(safe_globals=[Config])
    impl.save({"cfg": Config()}, checkpoint_id=tmp_path, no_dist=True, planner=saver)

    def rank(comm: Any) -> str:
        with pytest.raises(CheckpointError) as err:
            impl.load({"cfg": None}, checkpoint_id=tmp_path, comm=comm)
        return str(err.value.rank_failures[0].exception)

    assert all("safe_globals=" in m for m in FakeWorld(2).run(rank))


def _flip_data_byte(path: Path, md: Any, fqn: str) -> None:
    from refdcp.storage.format.items import data_offset_of

    (_idx, info), *_ = [(i, s) for i, s in md.storage_data.items() if i.fqn == fqn]
    f = path / info.relative_path
    raw = bytearray(f.read_bytes())
    raw[info.offset + (data_offset_of(info) or 0) + 3] ^= 0x10
    f.write_bytes(bytes(raw))


@pytest.mark.spec("LOAD-10")
@pytest.mark.parametrize("size", [16, (3 << 20) // 4])  # one piece; several pieces
def test_flipped_data_byte_fails_a_plain_load(impl: ModuleType, tmp_path: Path, size: int) -> None:
    src = {"w": torch.arange(size, dtype=torch.float32), "v": torch.ones(3)}
    md = impl.save(
        src, storage_writer=impl.FileSystemWriter(tmp_path, sync_files=False), no_dist=True
    )
    _flip_data_byte(tmp_path, md, "w")
    dest = {"w": torch.zeros(size), "v": torch.zeros(3)}
    with pytest.raises(CheckpointError) as err:
        impl.load(dest, checkpoint_id=tmp_path, no_dist=True)
    exc = err.value.rank_failures[0].exception
    assert isinstance(exc, CorruptionError) and exc.fqn == "w" and exc.file.endswith(".distcp")
    # the opt-out reads the damaged bytes without checking
    impl.load(dest, checkpoint_id=tmp_path, no_dist=True, verify=False)
    assert not torch.equal(dest["w"], src["w"])


@pytest.mark.spec("LOAD-10", "LOAD-17")
def test_default_check_covers_resharded_and_memory_reads(impl: ModuleType, tmp_path: Path) -> None:
    full = torch.arange(64 * 16, dtype=torch.float32).reshape(64, 16)
    md = impl.save(
        {"w": full}, storage_writer=impl.FileSystemWriter(tmp_path, sync_files=False), no_dist=True
    )

    def rank(comm: Any) -> torch.Tensor:
        rows = torch.zeros(32, 16)
        shards = impl.LocalShards((64, 16), [((32 * comm.rank, 0), rows)])
        impl.load({"w": shards}, checkpoint_id=str(tmp_path), comm=comm)
        return rows

    got = FakeWorld(2).run(rank)
    assert torch.equal(torch.cat(got), full)  # intact: loads
    _flip_data_byte(tmp_path, md, "w")
    with pytest.raises(CheckpointError):
        FakeWorld(2).run(rank)
    storage = refdcp.MemoryStorage()
    impl.save({"w": full}, storage_writer=storage.writer("c"), no_dist=True)
    data = storage._snapshot("c").files
    name = next(n for n in data if n.endswith(".distcp"))
    raw = bytearray(data[name])
    raw[-100] ^= 1
    data[name] = bytes(raw)
    with pytest.raises(CheckpointError, match="checksum"):
        impl.load({"w": torch.zeros(64, 16)}, storage_reader=storage.reader("c"), no_dist=True)


@pytest.mark.spec("LOAD-10")
def test_torch_written_checkpoint_loads_unchecked_by_default(
    impl: ModuleType, tmp_path: Path
) -> None:
    _torch_save_dcp({"w": torch.ones(4)}, tmp_path)
    dest = {"w": torch.zeros(4)}
    impl.load(dest, checkpoint_id=tmp_path, no_dist=True)
    assert torch.equal(dest["w"], torch.ones(4))
    with pytest.raises(CheckpointError, match="no checksum"):
        impl.load(dest, checkpoint_id=tmp_path, no_dist=True, verify=True)
