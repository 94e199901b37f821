"""Read-once loads (spec/read_once.md): one reader per shared stored item, boxes exchanged."""

from __future__ import annotations

import shutil
import tempfile
import warnings
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem

import refdcp
from refdcp.comm import FakeWorld
from refdcp.errors import CheckpointError
from refdcp.planning import DefaultLoadPlanner, LocalShards
from refdcp.planning.read_once import assign_readers
from refdcp.reference.load_planner import read_once_readers
from refdcp.testing.spawn import run_gloo
from refdcp.testing.storage_wrappers import CountingReader

warnings.filterwarnings("ignore", message="torch.distributed is disabled")

DTYPES = (torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.complex64, torch.uint8)


# -- the rule: reference and fast version -------------------------------------------------


@st.composite
def _plans_and_metadata(draw: Any) -> tuple[list[LoadPlan], Metadata]:
    world = draw(st.integers(1, 6))
    md: dict[str, Any] = {}
    stored: list[tuple[str, tuple[int, ...] | None, int]] = []
    for i in range(draw(st.integers(1, 8))):
        fqn = f"k{i}"
        if draw(st.booleans()):
            rows = [draw(st.integers(1, 5)) for _ in range(draw(st.integers(1, 3)))]
            dtype = draw(st.sampled_from(DTYPES))
            chunks, at = [], 0
            for r in rows:
                chunks.append(ChunkStorageMetadata(torch.Size([at, 0]), torch.Size([r, 3])))
                stored.append((fqn, (at, 0), len(chunks) - 1))
                at += r
            md[fqn] = TensorStorageMetadata(
                TensorProperties(dtype=dtype), torch.Size([at, 3]), chunks
            )
        else:
            md[fqn] = object()
            stored.append((fqn, None, 0))
    plans = []
    for _ in range(world):
        items = []
        for fqn, offset, index in stored:
            if draw(st.booleans()):
                ty = LoadItemType.BYTE_IO if offset is None else LoadItemType.TENSOR
                where = MetadataIndex(fqn, None if offset is None else torch.Size(offset), index)
                items.append(
                    ReadItem(ty, where, torch.Size([0]), where, torch.Size([0]), torch.Size([1]))
                )
        plans.append(LoadPlan(items))
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    state = {k: (BytesStorageMetadata() if v.__class__ is object else v) for k, v in md.items()}
    return plans, Metadata(state_dict_metadata=state)


@pytest.mark.spec("ONCE-8", "ONCE-1", "REF-4")
@given(_plans_and_metadata())
def test_fast_readers_equal_the_reference(case: tuple[list[LoadPlan], Metadata]) -> None:
    plans, md = case
    fast = assign_readers(plans, md)
    assert fast == read_once_readers(plans, md)
    for key, reader in fast.items():  # only shared items, each to a rank that reads it
        holders = [
            r for r, p in enumerate(plans) if any(i.storage_index.fqn == key[0] for i in p.items)
        ]
        assert len(holders) >= 2 and reader in holders


@pytest.mark.spec("ONCE-1")
def test_equal_replicated_items_are_spread_evenly_largest_first() -> None:
    sizes = [40, 30, 20, 10, 10, 10]
    md = Metadata(
        state_dict_metadata={
            f"w{i}": TensorStorageMetadata(
                TensorProperties(dtype=torch.uint8),
                torch.Size([n]),
                [ChunkStorageMetadata(torch.Size([0]), torch.Size([n]))],
            )
            for i, n in enumerate(sizes)
        }
    )
    items = [
        ReadItem(
            LoadItemType.TENSOR,
            MetadataIndex(f"w{i}", torch.Size([0])),
            torch.Size([0]),
            MetadataIndex(f"w{i}", torch.Size([0])),
            torch.Size([0]),
            torch.Size([n]),
        )
        for i, n in enumerate(sizes)
    ]
    readers = read_once_readers([LoadPlan(items)] * 3, md)
    # largest first to the least loaded, ties to the lowest rank: 40->0, 30->1, 20->2,
    # 10->2 (20 < 30), 10->1 (30 < 40 ... ties 30/30 to rank 1), 10->2
    assert [readers[(f"w{i}", (0,))] for i in range(6)] == [0, 1, 2, 2, 1, 2]
    assert assign_readers([LoadPlan(items)] * 3, md) == readers


# -- end to end: bit-exact, bytes read once ------------------------------------------------
# The bit-exact property runs on both implementations (``impl``); the tests below it that
# count the bytes each rank reads, name the rank whose read failed or configure the planner's
# read_once are single path: reading once is the default path's bandwidth feature.


def _values(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    raw = torch.randint(0, 255, (*shape, 16), generator=g, dtype=torch.uint8)
    size = torch.empty((), dtype=dtype).element_size()
    t = raw[..., :size].contiguous().view(dtype).reshape(shape)
    return t.clone()


def _rows(n: int, world: int, rank: int) -> tuple[int, int]:
    """Uneven row split: rank r gets rows [start, start + count)."""
    cuts = [n * i // world for i in range(world + 1)]
    return cuts[rank], cuts[rank + 1] - cuts[rank]


def _state(layout: list[tuple[str, str, tuple[int, ...], Any]], world: int, rank: int, fill: bool):
    out: dict[str, Any] = {}
    for name, kind, shape, dtype in layout:
        if kind == "object":
            out[name] = f"value of {name}" if fill else ""
            continue
        full = _values(name, shape, dtype)
        if kind == "replicated":
            out[name] = full.clone() if fill else torch.zeros(shape, dtype=dtype)
            continue
        start, count = _rows(shape[0], world, rank)
        local = (
            full[start : start + count].clone()
            if fill
            else torch.zeros((count, *shape[1:]), dtype=dtype)
        )
        chunks = [((start, *[0] * (len(shape) - 1)), local)] if count else []
        out[name] = LocalShards(shape, chunks, dtype=dtype)
    return out


def _bytes(t: torch.Tensor) -> tuple[Any, ...]:
    return (tuple(t.shape), t.dtype, t.contiguous().view(torch.uint8).numpy().tobytes())


def _dense(value: Any) -> Any:
    if isinstance(value, LocalShards):
        return [(tuple(o), _bytes(t)) for o, t in value.chunks]
    if isinstance(value, torch.Tensor):
        return _bytes(value)
    return value


def _load_all(
    path: Path, layout: Any, world: int, read_once: bool, impl: ModuleType = refdcp, **kw: Any
) -> list[Any]:
    def rank(comm: Any) -> Any:
        sd = _state(layout, world, comm.rank, fill=False)
        reader = CountingReader(impl.FileSystemReader(path))
        impl.load(sd, storage_reader=reader, comm=comm, read_once=read_once, **kw)
        return {k: _dense(v) for k, v in sd.items()}, reader.bytes_read

    return FakeWorld(world).run(rank)


@st.composite
def _layouts(draw: Any) -> list[tuple[str, str, tuple[int, ...], Any]]:
    out = []
    for i in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["replicated", "sharded", "object"]))
        shape = (draw(st.integers(1, 9)), draw(st.integers(1, 4)))
        out.append((f"t{i}", kind, shape, draw(st.sampled_from(DTYPES))))
    return out


@pytest.mark.spec("ONCE-7", "ONCE-2", "ONCE-3", "ONCE-1")
@given(
    layout=_layouts(),
    save_world=st.integers(1, 4),
    load_world=st.integers(1, 4),
    verify=st.sampled_from([None, True, False]),
)
def test_read_once_is_bit_exact_with_the_ordinary_load(
    impl: ModuleType, layout: Any, save_world: int, load_world: int, verify: bool | None
) -> None:
    with tempfile.TemporaryDirectory() as d:
        path = Path(d)

        def save(comm: Any) -> None:
            impl.save(_state(layout, save_world, comm.rank, True), checkpoint_id=path, comm=comm)

        FakeWorld(save_world).run(save)
        plain = _load_all(path, layout, load_world, False, impl, verify=verify)
        once = _load_all(path, layout, load_world, True, impl, verify=verify)
        stored = sum(
            info.length
            for info in refdcp.FileSystemReader(path).read_metadata().storage_data.values()
        )
    assert [sd for sd, _ in once] == [sd for sd, _ in plain]
    for sd in (sd for sd, _ in once):  # and equal to what was saved
        for name, kind, shape, dtype in layout:
            if kind == "replicated":
                assert sd[name] == _bytes(_values(name, shape, dtype))
            if kind == "object":
                assert sd[name] == f"value of {name}"
    # every stored item the load needs is read once: here the load needs them all. Only the
    # default path reads once: the reference accepts read_once= and reads plainly (ONCE-6).
    if impl is refdcp:
        assert sum(b for _, b in once) == stored


@pytest.mark.spec("ONCE-7")
def test_replicated_state_at_world_4_reads_each_byte_once(tmp_path: Path) -> None:
    layout = [(f"w{i}", "replicated", (64, 32), torch.float32) for i in range(6)]
    layout.append(("step", "object", (), None))
    refdcp.save(_state(layout, 1, 0, True), checkpoint_id=tmp_path, no_dist=True)
    stored = sum(
        i.length for i in refdcp.FileSystemReader(tmp_path).read_metadata().storage_data.values()
    )
    once = _load_all(tmp_path, layout, 4, True)
    plain = _load_all(tmp_path, layout, 4, False)
    assert sum(b for _, b in once) == stored  # 1x
    assert sum(b for _, b in plain) == 4 * stored  # every rank reads everything: 4x
    assert all(b > 0 for _, b in once)  # balanced: every rank reads its share
    assert [sd for sd, _ in once] == [sd for sd, _ in plain]


@pytest.mark.spec("ONCE-7", "ONCE-2")
def test_resharding_one_saved_chunk_reads_it_once_and_casts_like_the_plain_load(
    tmp_path: Path,
) -> None:
    full = _values("big", (12, 5), torch.float32)
    refdcp.save({"big": full}, checkpoint_id=tmp_path, no_dist=True)

    def rank(comm: Any, once: bool) -> Any:
        start, count = _rows(12, 3, comm.rank)
        start, count = max(start - 1, 0), count + 1  # overlapping boxes of one saved chunk
        count = min(count, 12 - start)
        dest = torch.zeros(count, 5, dtype=torch.float64)  # a cast destination
        reader = CountingReader(refdcp.FileSystemReader(tmp_path))
        sd = {"big": LocalShards((12, 5), [((start, 0), dest)])}
        planner = DefaultLoadPlanner(allow_cast=True)
        refdcp.load(sd, storage_reader=reader, comm=comm, read_once=once, planner=planner)
        return dest, reader.bytes_read, start

    once = FakeWorld(3).run(rank, True)
    plain = FakeWorld(3).run(rank, False)
    for (a, _, start), (b, _, _) in zip(once, plain):
        assert _bytes(a) == _bytes(b) == _bytes(full[start : start + len(a)].double())
    assert sum(n for _, n, _ in once) * 3 == sum(n for _, n, _ in plain)


# -- failures: every rank raises, naming the key and the file -------------------------------


def _corrupt(path: Path, fqn: str) -> str:
    md = refdcp.FileSystemReader(path).read_metadata()
    [info] = [v for k, v in md.storage_data.items() if k.fqn == fqn]
    data = bytearray((path / info.relative_path).read_bytes())
    data[info.offset + info.length - 3] ^= 0xFF
    (path / info.relative_path).write_bytes(bytes(data))
    return str(info.relative_path)


@pytest.mark.spec("ONCE-5", "ONCE-4")
@pytest.mark.parametrize("victim", range(4))
def test_a_reader_whose_check_fails_makes_every_rank_raise(tmp_path: Path, victim: int) -> None:
    # four equal replicated tensors at world 4: rank r reads w{r} (ONCE-1)
    layout = [(f"w{i}", "replicated", (16, 16), torch.float32) for i in range(4)]
    refdcp.save(_state(layout, 1, 0, True), checkpoint_id=tmp_path, no_dist=True)
    file = _corrupt(tmp_path, f"w{victim}")

    def rank(comm: Any) -> Any:
        sd = _state(layout, 4, comm.rank, fill=False)
        with pytest.raises(CheckpointError) as err:
            refdcp.load(sd, checkpoint_id=tmp_path, comm=comm, read_once=True)
        untouched = all(not sd[f"w{i}"].any() for i in range(4) if i != comm.rank)
        return str(err.value), sorted(err.value.rank_failures), untouched

    for msg, failed, untouched in FakeWorld(4).run(rank):
        assert failed == [victim]
        assert f"'w{victim}'" in msg and file in msg and "checksum" in msg
        assert untouched  # no received box was placed


class _FailingReader(CountingReader):
    def __init__(self, inner: Any, fail: bool) -> None:
        super().__init__(inner)
        self.fail = fail

    def before_read(self, sizes: list[int]) -> None:
        if self.fail:
            raise OSError("storage gone on this rank")


@pytest.mark.spec("ONCE-5")
@pytest.mark.parametrize("victim", range(3))
def test_a_reader_with_an_io_error_makes_every_rank_raise(tmp_path: Path, victim: int) -> None:
    layout = [(f"w{i}", "replicated", (8, 8), torch.float32) for i in range(3)]
    refdcp.save(_state(layout, 1, 0, True), checkpoint_id=tmp_path, no_dist=True)

    def rank(comm: Any) -> Any:
        reader = _FailingReader(refdcp.FileSystemReader(tmp_path), comm.rank == victim)
        with pytest.raises(CheckpointError) as err:
            refdcp.load(
                _state(layout, 3, comm.rank, False),
                storage_reader=reader,
                comm=comm,
                read_once=True,
            )
        return str(err.value), sorted(err.value.rank_failures)

    for msg, failed in FakeWorld(3).run(rank, timeout=60):
        assert failed == [victim] and "storage gone on this rank" in msg


@pytest.mark.spec("ONCE-4")
def test_boxes_checked_under_another_verify_mode_are_refused(tmp_path: Path) -> None:
    layout = [
        ("w", "replicated", (8, 8), torch.float32),
        ("v", "replicated", (8, 8), torch.float32),
    ]
    refdcp.save(_state(layout, 1, 0, True), checkpoint_id=tmp_path, no_dist=True)

    def rank(comm: Any) -> Any:
        verify = None if comm.rank == 0 else False
        with pytest.raises(CheckpointError) as err:
            refdcp.load(
                _state(layout, 2, comm.rank, False),
                checkpoint_id=tmp_path,
                comm=comm,
                read_once=True,
                verify=verify,
            )
        return str(err.value)

    msgs = FakeWorld(2).run(rank)
    assert any("checked its pieces with verify=" in m for m in msgs)


# -- the option ---------------------------------------------------------------------------


@pytest.mark.spec("ONCE-6")
def test_read_once_is_auto_by_default_and_planners_keep_torchs_abc(tmp_path: Path) -> None:
    assert DefaultLoadPlanner().read_once == "auto"
    for bad in ("yes", None, 2):
        with pytest.raises(ValueError, match="read_once must be"):
            DefaultLoadPlanner(read_once=bad)  # type: ignore[arg-type]
    assert isinstance(DefaultLoadPlanner(read_once=True), LoadPlanner)
    layout = [("w", "replicated", (8, 8), torch.float32)]
    refdcp.save(_state(layout, 1, 0, True), checkpoint_id=tmp_path, no_dist=True)
    got = _load_all(tmp_path, layout, 2, False)
    assert [b for _, b in got] == [got[0][1]] * 2  # off: every rank reads it
    with pytest.raises(ValueError, match="read_once must be"):
        refdcp.load({"w": torch.zeros(8, 8)}, checkpoint_id=tmp_path, no_dist=True, read_once="on")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="read_once= applies to refdcp's DefaultLoadPlanner"):
        refdcp.load(
            {"w": torch.zeros(8, 8)},
            checkpoint_id=tmp_path,
            no_dist=True,
            read_once=True,
            planner=refdcp.reference.load_planner.ReferenceLoadPlanner(),
        )


@pytest.mark.spec("ONCE-6")
def test_a_rank_that_does_not_offer_read_once_gives_a_plain_load(tmp_path: Path) -> None:
    layout = [("w", "replicated", (8, 8), torch.float32)]
    refdcp.save(_state(layout, 1, 0, True), checkpoint_id=tmp_path, no_dist=True)

    def rank(comm: Any) -> Any:
        sd = _state(layout, 2, comm.rank, False)
        reader = CountingReader(refdcp.FileSystemReader(tmp_path))
        refdcp.load(sd, storage_reader=reader, comm=comm, read_once=comm.rank == 0)
        return reader.bytes_read, _bytes(sd["w"]) == _bytes(_values("w", (8, 8), torch.float32))

    (b0, ok0), (b1, ok1) = FakeWorld(2).run(rank)
    assert ok0 and ok1 and b0 == b1 > 0


# -- real Gloo process groups --------------------------------------------------------------


def _gloo_load(rank: int, world: int, path: str, mode: str) -> Any:
    import torch.distributed.checkpoint as tdcp

    layout = [(f"w{i}", "replicated", (1024, 1024), torch.float32) for i in range(4)]
    layout.append(("step", "object", (), None))
    if mode == "all_gather":  # payloads over 4 MiB, of different sizes: by broadcasts
        from refdcp.comm import TorchDistComm

        mine = bytearray([rank + 1]) * ((5 << 20) + rank)
        got = TorchDistComm().all_gather(mine)
        return [(len(g), g[:1], g[-1:]) for g in got] + [got[rank] is not mine]
    if rank == 0 and mode == "save":
        refdcp.save(_state(layout, 1, 0, True), checkpoint_id=path, no_dist=True)
        return None
    sd = _state(layout, world, rank, False)
    if mode == "torch":  # torch's driver: no exchange, every rank reads all
        reader = CountingReader(refdcp.FileSystemReader(path))
        tdcp.load(sd, storage_reader=reader, planner=DefaultLoadPlanner(read_once=True))
        return reader.bytes_read, all(
            _bytes(sd[n]) == _bytes(_values(n, s, d)) for n, k, s, d in layout if k != "object"
        )
    reader = CountingReader(refdcp.FileSystemReader(path))
    try:
        refdcp.load(sd, storage_reader=reader, read_once=True)
    except CheckpointError as exc:
        return "raised", str(exc), sorted(exc.rank_failures)
    exact = all(_bytes(sd[n]) == _bytes(_values(n, s, d)) for n, k, s, d in layout if k != "object")
    return reader.bytes_read, exact and sd["step"] == "value of step"


def _saved_for_gloo(d: str) -> tuple[str, int]:
    """The checkpoint the Gloo tests load, and its stored bytes in all."""
    path = f"{d}/ckpt"
    _gloo_load(0, 1, path, "save")
    metadata = refdcp.FileSystemReader(path).read_metadata()
    return path, sum(i.length for i in metadata.storage_data.values())


@pytest.mark.spec("ONCE-7", "ONCE-5", "ONCE-6", "COMM-63")
def test_gloo_world_2_reads_once_bit_exact_and_every_rank_raises_on_a_bad_reader() -> None:
    with tempfile.TemporaryDirectory() as d:
        path, stored = _saved_for_gloo(d)
        gathered = run_gloo(2, _gloo_load, path, "all_gather", timeout=120)
        want = [((5 << 20) + r, bytearray([r + 1]), bytearray([r + 1])) for r in range(2)]
        assert gathered == [[*want, True]] * 2
        good = run_gloo(2, _gloo_load, path, "load", timeout=120)  # 8 MiB outcomes: broadcasts
        assert sum(b for b, _ in good) == stored and all(ok for _, ok in good)
        torch_driven = run_gloo(2, _gloo_load, path, "torch", timeout=120)
        assert [b for b, _ in torch_driven] == [stored, stored] and all(
            ok for _, ok in torch_driven
        )
        # w0..w3 are equal: rank 0 reads w0 and w2, rank 1 w1 and w3 (ONCE-1)
        for victim in (1, 0):
            copy = f"{d}/copy{victim}"
            shutil.copytree(path, copy)
            file = _corrupt(Path(copy), f"w{victim}")
            bad = run_gloo(2, _gloo_load, copy, "load", timeout=120)
            for outcome in bad:  # every rank raises, naming the reader, key and file
                assert outcome[0] == "raised" and outcome[2] == [victim]
                assert f"'w{victim}'" in outcome[1] and file in outcome[1]


@pytest.mark.slow  # make test-thorough: ~30 s of spawned ranks; world 2 above runs in make test
@pytest.mark.spec("ONCE-7", "ONCE-5")
def test_gloo_world_4_reads_each_byte_once_and_every_rank_raises_on_a_bad_reader() -> None:
    """Four Gloo ranks, four replicated tensors: each rank reads one, the stored bytes
    read add up to the checkpoint once; a flipped byte in the one rank 3 reads makes all
    four raise, naming rank 3, the key and the file."""
    with tempfile.TemporaryDirectory() as d:
        path, stored = _saved_for_gloo(d)
        good = run_gloo(4, _gloo_load, path, "load", timeout=180)
        assert sum(b for b, _ in good) == stored and all(ok for _, ok in good)
        assert all(b > 0 for b, _ in good)  # the reads are spread over every rank
        copy = f"{d}/copy"
        shutil.copytree(path, copy)
        file = _corrupt(Path(copy), "w3")
        bad = run_gloo(4, _gloo_load, copy, "load", timeout=180)
        for outcome in bad:
            assert outcome[0] == "raised" and outcome[2] == [3]
            assert "'w3'" in outcome[1] and file in outcome[1]
