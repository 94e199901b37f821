"""Stream transforms (torch's ``_extensions``, zstd) both ways (FMT-23..FMT-27, INTEG-12, INTEG-13, API-10).

The differential tests cross writer (torch's or refdcp's ``FileSystemWriter``
with ``ZStandard``) x reader (torch's or refdcp's ``FileSystemReader``) x the
world sizes of the save and of the load (1-4, so most loads reshard). The
zstd tests need the ``zstandard`` package (the ``test`` extra installs it) and
skip only when it is absent; the tests with a transform of their own run
everywhere.
"""

from __future__ import annotations

import io
import warnings
from pathlib import Path
from typing import IO, Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint._extension import ExtensionRegistry, StreamTransformExtension

import refdcp
from refdcp.comm import FakeWorld
from refdcp.crc.kernel import crc32c
from refdcp.errors import CheckpointError
from refdcp.storage import CorruptionError, FileSystemReader, FileSystemWriter
from refdcp.storage.format.items import CRC_ATTR, DATA_OFFSET_ATTR
from refdcp.storage.fs import transforms as tr
from tests.test_storage_compat import bits, make_tensor

SINGLE_PATH = "stream transforms (_extensions, zstd; FMT-23..27) are a feature of refdcp's FileSystemWriter/Reader, crossed here with torch's"

warnings.filterwarnings("ignore", message="torch.distributed is disabled")

WRITERS = {"torch": dcp.FileSystemWriter, "refdcp": FileSystemWriter}
READERS = {"torch": dcp.FileSystemReader, "refdcp": FileSystemReader}
DTYPES = [torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.uint8, torch.complex64]


def _zstd() -> Any:
    pytest.importorskip("zstandard")
    return tr.zstd()


# -- a transform of the tests' own, registered through torch's ExtensionRegistry ---------------


class _XorOut(io.RawIOBase):
    def __init__(self, out: IO[bytes]) -> None:
        self.out = out

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        data = bytes(memoryview(b).cast("B"))
        self.out.write(bytes(x ^ 0xA5 for x in data))
        return len(data)

    def close(self) -> None:
        if not self.closed:
            self.out.close()
        super().close()


class _XorIn(io.RawIOBase):
    def __init__(self, source: IO[bytes]) -> None:
        self.source = source

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        data = self.source.read(len(b))
        if not data:
            return 0
        b[: len(data)] = bytes(x ^ 0xA5 for x in data)
        return len(data)


class Xor(StreamTransformExtension):
    """XOR every byte with 0xA5: not commutative with compression, so order shows."""

    @staticmethod
    def registry_name() -> str:
        return "test.xor"

    @staticmethod
    def from_descriptor(version: str) -> Xor:
        return Xor()

    def get_descriptor(self) -> str:
        return "test.xor/1"

    def transform_to(self, output: IO[bytes]) -> IO[bytes]:
        return _XorOut(output)  # type: ignore[return-value]

    def transform_from(self, input: IO[bytes]) -> IO[bytes]:
        return io.BufferedReader(_XorIn(input))  # type: ignore[return-value]


def _registry() -> ExtensionRegistry:
    reg = ExtensionRegistry()
    reg.register(Xor)
    return reg


def _reader(kind: str, path: Path, registry: Any = None) -> Any:
    return READERS[kind](path, _extension_registry=registry)


# -- states: a row-sharded tensor per dtype, a replicated one, objects ------------------------


def _full(rows: int, seed: int) -> dict[str, torch.Tensor]:
    return {f"s.{dt}": make_tensor(dt, (rows, 3), seed + i) for i, dt in enumerate(DTYPES)}


def _bounds(rows: int, world: int, rank: int) -> tuple[int, int]:
    step = -(-rows // world) if rows else 0
    start = min(rank * step, rows)
    return start, min(rows, start + step) - start


def _state(rows: int, seed: int, world: int, rank: int, fill: bool) -> dict[str, Any]:
    start, n = _bounds(rows, world, rank)
    sd: dict[str, Any] = {}
    for k, full in _full(rows, seed).items():
        piece = full[start : start + n] if fill else torch.zeros((n, 3), dtype=full.dtype)
        sd[k] = refdcp.LocalShards((rows, 3), [((start, 0), piece)] if n else [], dtype=full.dtype)
    rep = make_tensor(torch.float64, (5, 2), seed)
    sd["rep"] = rep if fill else torch.zeros_like(rep)
    sd["big"] = (
        torch.arange(300_000, dtype=torch.int32) * seed
        if fill
        else torch.zeros(300_000, dtype=torch.int32)
    )  # compresses far below its size
    sd["obj"] = {"seed": seed, "tags": ["a", "b"]} if fill else {"seed": None, "tags": None}
    sd["buf"] = io.BytesIO(b"raw-%d" % seed) if fill else None
    return sd


def _problems(got: dict[str, Any], rows: int, seed: int, world: int, rank: int) -> list[str]:
    want = _state(rows, seed, world, rank, True)
    bad = []
    for k, w in want.items():
        g = got[k]
        if isinstance(w, refdcp.LocalShards):
            pairs = list(zip(w.chunks, g.chunks))
            if any(not torch.equal(bits(a[1]), bits(b[1])) for a, b in pairs):
                bad.append(k)
        elif isinstance(w, torch.Tensor):
            if not torch.equal(bits(w), bits(g)):
                bad.append(k)
        elif isinstance(w, io.BytesIO):
            if not isinstance(g, io.BytesIO) or g.getvalue() != w.getvalue():
                bad.append(k)
        elif g != w:
            bad.append(k)
    return bad


def _save(path: Path, writer: str, world: int, rows: int, seed: int, exts: list[Any]) -> None:
    def rank(comm: Any) -> None:
        w = WRITERS[writer](path, _extensions=exts)
        refdcp.save(_state(rows, seed, world, comm.rank, True), storage_writer=w, comm=comm)

    FakeWorld(world).run(rank, timeout=120)


def _load(
    path: Path, reader: str, world: int, rows: int, seed: int, registry: Any = None
) -> list[list[str]]:
    def rank(comm: Any) -> list[str]:
        out = _state(rows, seed, world, comm.rank, False)
        refdcp.load(out, storage_reader=_reader(reader, path, registry), comm=comm)
        return _problems(out, rows, seed, world, comm.rank)

    return FakeWorld(world).run(rank, timeout=120)


@pytest.mark.spec("FMT-23", "FMT-24", "INTEG-12")
@settings(
    max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    writer=st.sampled_from(sorted(WRITERS)),
    reader=st.sampled_from(sorted(READERS)),
    w_save=st.integers(1, 4),
    w_load=st.integers(1, 4),
    rows=st.integers(0, 9),
    seed=st.integers(1, 1000),
)
def test_zstd_checkpoints_cross_both_ways_resharded(
    tmp_path_factory: pytest.TempPathFactory,
    writer: str,
    reader: str,
    w_save: int,
    w_load: int,
    rows: int,
    seed: int,
) -> None:
    path = tmp_path_factory.mktemp("zstd")
    _save(path, writer, w_save, rows, seed, [_zstd()])
    md = dcp.FileSystemReader(path).read_metadata()
    assert {tuple(i.transform_descriptors) for i in md.storage_data.values()} == {
        ("stream.zstd/1",)
    }
    assert _load(path, reader, w_load, rows, seed) == [[] for _ in range(w_load)]


@pytest.mark.spec("FMT-23", "FMT-24")
@pytest.mark.parametrize("writer", sorted(WRITERS))
def test_zstd_checkpoints_load_with_torchs_own_load(tmp_path: Path, writer: str) -> None:
    """torch's whole path (planner, protocol, reader) reads a checkpoint either writer made,
    and refdcp.load (resharded at 3 ranks) reads one torch's whole path wrote."""
    ext = _zstd()
    full = {**_full(7, 3), "obj": {"k": [1, 2]}, "buf": io.BytesIO(b"q")}
    dcp.save(full, storage_writer=WRITERS[writer](tmp_path / "a", _extensions=[ext]), no_dist=True)
    out: dict[str, Any] = {k: torch.zeros_like(v) for k, v in _full(7, 0).items()}
    out |= {"obj": {"k": None}, "buf": None}
    dcp.load(out, storage_reader=dcp.FileSystemReader(tmp_path / "a"), no_dist=True)
    assert all(torch.equal(bits(out[k]), bits(full[k])) for k in _full(7, 0))
    assert out["obj"] == {"k": [1, 2]} and out["buf"].getvalue() == b"q"

    def rank(comm: Any) -> list[str]:
        sd = {k: v for k, v in _state(7, 3, 3, comm.rank, False).items() if k.startswith("s.")}
        refdcp.load(sd, storage_reader=FileSystemReader(tmp_path / "a"), comm=comm)
        return _shard_problems(sd, 7, 3, comm.rank)

    assert FakeWorld(3).run(rank) == [[], [], []]


def _shard_problems(sd: dict[str, Any], rows: int, seed: int, rank: int) -> list[str]:
    want = _state(rows, seed, 3, rank, True)
    return [
        k
        for k in sd
        if k.startswith("s.")
        and not all(
            torch.equal(bits(a[1]), bits(b[1])) for a, b in zip(want[k].chunks, sd[k].chunks)
        )
    ]


@pytest.mark.spec("FMT-23", "INTEG-12")
def test_refdcp_transformed_item_records(tmp_path: Path) -> None:
    """Every item carries the descriptors and the CRC-32C of its stored range, no data offset;
    the value stored is the zstd of the untransformed item."""
    ext = _zstd()
    import zstandard

    sd = {"w": torch.arange(1000.0), "o": [1, 2]}
    refdcp.save(sd, storage_writer=FileSystemWriter(tmp_path, _extensions=[ext]), no_dist=True)
    md = dcp.FileSystemReader(tmp_path).read_metadata()
    for info in md.storage_data.values():
        assert info.transform_descriptors == ["stream.zstd/1"]
        assert getattr(info, DATA_OFFSET_ATTR, None) is None
        stored = (tmp_path / info.relative_path).read_bytes()[
            info.offset : info.offset + info.length
        ]
        assert getattr(info, CRC_ATTR) == crc32c(stored)
        decoded = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(stored)).read()
        assert decoded  # a whole zstd frame
    plain = tmp_path / "plain"
    refdcp.save(sd, storage_writer=FileSystemWriter(plain, _extensions=[]), no_dist=True)
    md = dcp.FileSystemReader(plain).read_metadata()
    assert all(i.transform_descriptors is None for i in md.storage_data.values())


@pytest.mark.spec("FMT-24", "FMT-23")
@pytest.mark.parametrize("writer", sorted(WRITERS))
@pytest.mark.parametrize("reader", sorted(READERS))
def test_a_registered_transform_of_ones_own_works(tmp_path: Path, writer: str, reader: str) -> None:
    _save(tmp_path, writer, 2, 5, 11, [Xor()])
    md = dcp.FileSystemReader(tmp_path).read_metadata()
    assert {tuple(i.transform_descriptors) for i in md.storage_data.values()} == {("test.xor/1",)}
    assert _load(tmp_path, reader, 3, 5, 11, _registry()) == [[], [], []]


@pytest.mark.spec("FMT-24", "FMT-27")
@pytest.mark.parametrize("reader", sorted(READERS))
def test_two_transforms_in_the_order_both_readers_undo_them(tmp_path: Path, reader: str) -> None:
    """refdcp records [e1, e2] for _extensions=[e1, e2]; torch 2.13's writer records the
    reverse, which neither reader can undo (FMT-27's stated difference)."""
    exts = [_zstd(), Xor()]
    _save(tmp_path / "r", "refdcp", 1, 4, 5, exts)
    md = dcp.FileSystemReader(tmp_path / "r").read_metadata()
    assert {tuple(i.transform_descriptors) for i in md.storage_data.values()} == {
        ("stream.zstd/1", "test.xor/1")
    }
    assert _load(tmp_path / "r", reader, 2, 4, 5, _registry()) == [[], []]
    _save(tmp_path / "t", "torch", 1, 4, 5, exts)
    md = dcp.FileSystemReader(tmp_path / "t").read_metadata()
    assert {tuple(i.transform_descriptors) for i in md.storage_data.values()} == {
        ("test.xor/1", "stream.zstd/1")
    }
    with pytest.raises(CheckpointError):
        _load(tmp_path / "t", reader, 1, 4, 5, _registry())


@pytest.mark.spec("FMT-23", "API-10")
def test_writer_refuses_what_is_not_a_stream_transform(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not a stream transform"):
        FileSystemWriter(tmp_path, _extensions=[object()])
    assert FileSystemWriter(tmp_path, _extensions=[Xor()])._transforms is not None
    assert FileSystemWriter(tmp_path, _extensions=None)._transforms is None


@pytest.mark.spec("FMT-25")
def test_missing_zstd_binding_names_the_package(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ext = _zstd()
    sd = {"w": torch.arange(10.0)}
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(tmp_path, _extensions=[ext]), no_dist=True)
    import torch.distributed.checkpoint._extension as text

    monkeypatch.setattr(text, "zstandard", None)
    monkeypatch.setattr(text, "pyzstd", None)
    with pytest.raises(CheckpointError, match="pip install zstandard") as err:
        refdcp.load({"w": torch.zeros(10)}, checkpoint_id=tmp_path, no_dist=True)
    (failure,) = err.value.rank_failures.values()
    assert isinstance(failure.exception, tr.TransformUnavailableError)
    assert "'w'" in str(failure.exception) or "w in" in str(failure.exception)
    with pytest.raises(tr.TransformUnavailableError, match="refdcp\\[zstd\\]"):
        tr.zstd()


@pytest.mark.spec("FMT-25")
def test_unknown_descriptor_names_it_and_the_registry(tmp_path: Path) -> None:
    _save(tmp_path, "refdcp", 1, 3, 2, [Xor()])
    with pytest.raises(CheckpointError, match=r"test\.xor") as err:
        _load(tmp_path, "refdcp", 1, 3, 2)  # the default registry knows only stream.zstd
    assert "_extension_registry" in str(err.value)


def _stored_range(path: Path, fqn: str) -> tuple[Path, int, int]:
    md = dcp.FileSystemReader(path).read_metadata()
    ((_, info),) = [(k, v) for k, v in md.storage_data.items() if k.fqn == fqn]
    return path / info.relative_path, info.offset, info.length


def _flip(file: Path, at: int) -> None:
    data = bytearray(file.read_bytes())
    data[at] ^= 0xFF
    file.write_bytes(bytes(data))


@pytest.mark.spec("INTEG-12")
@settings(max_examples=10, deadline=None)
@given(where=st.floats(0.0, 0.999))
def test_damage_to_stored_bytes_is_a_checksum_mismatch_before_decoding(
    tmp_path_factory: pytest.TempPathFactory, where: float
) -> None:
    path = tmp_path_factory.mktemp("crc")
    sd = {"w": torch.arange(5000.0), "o": {"a": 1}}
    refdcp.save(sd, storage_writer=FileSystemWriter(path, _extensions=[_zstd()]), no_dist=True)
    file, offset, length = _stored_range(path, "w")
    _flip(file, offset + int(where * length))
    calls: list[int] = []
    real = tr.decode_item

    def spy(*args: Any, **kwargs: Any) -> bytes:
        calls.append(1)
        return real(*args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tr, "decode_item", spy)
        with pytest.raises(CheckpointError, match="checksum mismatch"):
            refdcp.load({"w": torch.zeros(5000)}, checkpoint_id=path, no_dist=True)
    assert calls == []  # refused before any byte reached the decoder
    report = refdcp.verify_checkpoint(path)  # checks stored bytes, without decoding (INTEG-6)
    assert not report.ok and [p.fqn for p in report.problems] == ["w"]


@pytest.mark.spec("INTEG-12")
def test_verify_true_needs_checksums_on_transformed_items_too(tmp_path: Path) -> None:
    dcp.save(
        {"w": torch.ones(4)},
        storage_writer=dcp.FileSystemWriter(tmp_path, _extensions=[_zstd()]),
        no_dist=True,
    )
    with pytest.raises(CheckpointError, match="no checksum"):
        refdcp.load({"w": torch.zeros(4)}, checkpoint_id=tmp_path, no_dist=True, verify=True)
    out = {"w": torch.zeros(4)}
    refdcp.load(out, checkpoint_id=tmp_path, no_dist=True)  # default: unchecked, as LOAD-10
    assert torch.equal(out["w"], torch.ones(4))


@pytest.mark.spec("FMT-26")
def test_undecodable_stored_bytes_are_corruption(tmp_path: Path) -> None:
    sd = {"w": torch.arange(5000.0)}
    refdcp.save(sd, storage_writer=FileSystemWriter(tmp_path, _extensions=[_zstd()]), no_dist=True)
    file, offset, _ = _stored_range(tmp_path, "w")
    _flip(file, offset + 5)  # inside the zstd frame header
    with pytest.raises(CheckpointError, match="cannot decode") as err:
        refdcp.load({"w": torch.zeros(5000)}, checkpoint_id=tmp_path, no_dist=True, verify=False)
    (failure,) = err.value.rank_failures.values()
    assert isinstance(failure.exception, CorruptionError)


@pytest.mark.spec("FMT-26")
@settings(max_examples=8, deadline=None)
@given(size=st.integers(0, 3 << 20), limit=st.integers(0, 2 << 20))
def test_decoding_stops_past_the_limit(size: int, limit: int) -> None:
    ext = _zstd()
    stored = tr.WriteTransforms([ext]).encode([bytes(size)])
    if size <= limit:
        for bound in (limit, None):
            got = tr.decode_item(stored, ["stream.zstd/1"], ExtensionRegistry(), "x", "f", 0, bound)
            assert got == bytes(size)
    else:
        with pytest.raises(CorruptionError, match="decode to more than"):
            tr.decode_item(stored, ["stream.zstd/1"], ExtensionRegistry(), "x", "f", 0, limit)


@pytest.mark.spec("FMT-24")
def test_untransformed_loads_never_enter_the_transform_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import refdcp.storage.fs.filesystem as fs

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("transform path used for an untransformed item")

    monkeypatch.setattr(fs, "read_transformed_item", refuse)
    monkeypatch.setattr(fs, "write_transformed_items", refuse)
    sd = {"w": torch.arange(10.0), "o": [1]}
    refdcp.save(sd, checkpoint_id=tmp_path, no_dist=True)
    out: dict[str, Any] = {"w": torch.zeros(10), "o": None}
    refdcp.load(out, checkpoint_id=tmp_path, no_dist=True)
    assert torch.equal(out["w"], sd["w"]) and out["o"] == [1]


# -- torch's own save and load on spawned Gloo ranks ---------------------------------------------

_KEYS = ("s.", "rep", "obj")
_ROWS, _SEED = 9, 17


def _dtensor_state(rank: int, world: int, fill: bool) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world,))
    start, n = _bounds(_ROWS, world, rank)
    sd: dict[str, Any] = {}
    for k, full in _full(_ROWS, _SEED).items():
        local = full[start : start + n].clone() if fill else torch.zeros((n, 3), dtype=full.dtype)
        sd[k] = DTensor.from_local(
            local, mesh, [Shard(0)], run_check=False, shape=full.shape, stride=full.stride()
        )
    rest = _state(_ROWS, _SEED, world, rank, fill)
    sd["rep"], sd["obj"] = rest["rep"], rest["obj"]
    return sd


def _gloo_torch_save(rank: int, world: int, path: str) -> None:
    from torch.distributed.checkpoint._extension import ZStandard

    warnings.filterwarnings("ignore")
    sd = _dtensor_state(rank, world, True)
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(path, _extensions=[ZStandard()]))


def _gloo_torch_load(rank: int, world: int, path: str) -> list[str]:
    warnings.filterwarnings("ignore")
    out = _dtensor_state(rank, world, False)
    dcp.load(out, storage_reader=dcp.FileSystemReader(path))
    want = _dtensor_state(rank, world, True)
    bad = [
        k
        for k in want
        if k.startswith("s.") and not torch.equal(bits(want[k].to_local()), bits(out[k].to_local()))
    ]
    if not torch.equal(bits(want["rep"]), bits(out["rep"])) or want["obj"] != out["obj"]:
        bad.append("rep/obj")
    return bad


@pytest.mark.dist
@pytest.mark.spec("FMT-23", "FMT-24")
@pytest.mark.timeout(300)
def test_torchs_own_multi_rank_save_and_load_cross_refdcp(tmp_path: Path) -> None:
    """torch's dcp.save on 3 Gloo ranks (DTensor shards, zstd) loads with refdcp.load at 2 and 4
    fake ranks; refdcp.save at 4 fake ranks (zstd) loads with torch's dcp.load on 3 Gloo ranks."""
    from refdcp.testing.spawn import run_gloo

    _zstd()
    theirs = tmp_path / "torch"
    run_gloo(3, _gloo_torch_save, str(theirs), timeout=240.0)
    for world in (2, 4):

        def rank(comm: Any, world: int = world) -> list[str]:
            sd = _state(_ROWS, _SEED, world, comm.rank, False)
            sd = {k: v for k, v in sd.items() if k.startswith(_KEYS)}
            refdcp.load(sd, storage_reader=FileSystemReader(theirs), comm=comm)
            return [
                k for k in _problems(sd | _rest(world, comm.rank), _ROWS, _SEED, world, comm.rank)
            ]

        assert FakeWorld(world).run(rank, timeout=120) == [[] for _ in range(world)]
    ours = tmp_path / "refdcp"
    _save(ours, "refdcp", 4, _ROWS, _SEED, [_zstd()])
    assert run_gloo(3, _gloo_torch_load, str(ours), timeout=240.0) == [[], [], []]


def _rest(world: int, rank: int) -> dict[str, Any]:
    """The keys a torch-side checkpoint lacks, filled as expected, so _problems checks the rest."""
    full = _state(_ROWS, _SEED, world, rank, True)
    return {k: v for k, v in full.items() if not k.startswith(_KEYS)}


@pytest.mark.spec("INTEG-12", "INTEG-13")
@pytest.mark.parametrize("transformed", [False, True])
@pytest.mark.parametrize("differ", [False, True])
def test_replica_digests_are_the_untransformed_values(
    tmp_path: Path, transformed: bool, differ: bool
) -> None:
    """Replicas that differ in value fail the save (DEDUP-17) with or without transforms; equal
    replicas commit, and the recorded digests are the same with and without them."""
    exts = [Xor()] if transformed else None

    def rank(comm: Any) -> Any:
        value = float(comm.rank) if differ else 1.0
        sd = {"rep": torch.full((64,), value), f"own{comm.rank}": torch.full((3,), 2.0)}
        w = FileSystemWriter(tmp_path, _extensions=exts)
        return refdcp.save(sd, storage_writer=w, comm=comm)

    if differ:
        with pytest.raises(Exception, match="replicas differ in value"):
            FakeWorld(2).run(rank, timeout=60)
        assert not (tmp_path / ".metadata").exists()
        return
    FakeWorld(2).run(rank, timeout=60)
    enc = tr.encode_tensor(torch.full((64,), 1.0))
    enc.final_crc()
    stored = tr.WriteTransforms([Xor()]).encode(enc.parts)
    assert stored == bytes(b ^ 0xA5 for b in b"".join(bytes(p) for p in enc.parts))

    class Out:
        position = 0

        def write(self, parts: list[Any]) -> None:
            self.position += sum(len(p) for p in parts)

    class Planner:
        def resolve_data(self, item: Any) -> torch.Tensor:
            return torch.full((64,), 1.0)

    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

    from refdcp.storage.format.records import value_crc_of

    item = WriteItem(index=MetadataIndex("rep"), type=WriteItemType.TENSOR)
    (result,) = tr.write_transformed_items(
        Out(), "f", [item], Planner(), tr.WriteTransforms([Xor()])
    )  # type: ignore[arg-type]
    assert value_crc_of(result) == enc.value_crc is not None
