"""torch's Hugging Face storage loaded by ``refdcp.load`` (API-25).

torch 2.13's ``HuggingFaceStorageWriter`` writes in three modes: rank-0
checkpointing of a full state dict (one ``model-00001-of-00001.safetensors``, or
several files by ``fqn_to_index_mapping``, with ``model.safetensors.index.json``),
``save_distributed=True`` (each rank a ``shard-NNNNN-...`` file whose header
records the offsets of its shards) and that plus ``enable_consolidation=True``
(full tensors in sharded files with the index, the shards under ``sharded/``).
The tests cross mode x world size of the save (1-4, driven by ``refdcp.save``
with torch's writer, and by torch's own ``dcp.save``) x world size of the load
(1-4, so most loads reshard) x rows x dtypes, and load with ``refdcp.load``
through torch's ``HuggingFaceStorageReader`` (as ``storage_reader=``, chosen
from ``checkpoint_id``, and under the reference path's ``load``), comparing bits with the values saved and with what
torch's own ``dcp.load`` gives.

What the modes cannot hold, found here and left to torch (each case is a test
below): in rank-0 mode every rank that holds items writes the same file name,
so only a state dict held by rank 0 alone is saved whole; a sharded tensor
with no shard on any rank leaves no key; torch's consolidation fails for
non-floating dtypes (``torch.finfo`` of an integer dtype) and writes complex64
and all-empty tensors with headers safetensors refuses.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import refdcp
import refdcp.reference
from refdcp.comm import FakeWorld
from refdcp.errors import CheckpointError
from refdcp.storage.select import select_reader
from tests.test_storage_compat import bits, make_tensor

SINGLE_PATH = "torch's Hugging Face storage read by refdcp's load (API-25): a differential test against torch's own load"

pytest.importorskip("safetensors")
hf = pytest.importorskip("torch.distributed.checkpoint.hf_storage")

warnings.filterwarnings("ignore", message="torch.distributed is disabled")

#: dtypes every mode stores (torch's consolidation takes floating dtypes only).
FLOATS = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.float8_e4m3fn]
#: the others safetensors names, for the modes that do not consolidate.
OTHERS = [torch.int64, torch.int32, torch.int8, torch.uint8, torch.bool, torch.complex64]
MODES = ["rank0", "rank0_index", "distributed", "consolidated"]


def _dtypes(mode: str) -> list[torch.dtype]:
    return FLOATS if mode == "consolidated" else FLOATS + OTHERS


def _full(mode: str, rows: int, seed: int) -> dict[str, torch.Tensor]:
    out = {f"s.{dt}": make_tensor(dt, (rows, 3), seed + i) for i, dt in enumerate(_dtypes(mode))}
    out["rep"] = make_tensor(torch.float32, (4, 2), seed)
    return out


def _bounds(rows: int, world: int, rank: int) -> tuple[int, int]:
    step = -(-rows // world)
    start = min(rank * step, rows)
    return start, min(rows, start + step) - start


def _sharded(full: torch.Tensor, world: int, rank: int, fill: bool) -> refdcp.LocalShards:
    rows = full.shape[0]
    start, n = _bounds(rows, world, rank)
    piece = full[start : start + n] if fill else torch.zeros((n, 3), dtype=full.dtype)
    return refdcp.LocalShards((rows, 3), [((start, 0), piece)] if n else [], dtype=full.dtype)


def _writer(mode: str, path: Path, keys: list[str]) -> Any:
    if mode == "rank0":
        return hf.HuggingFaceStorageWriter(str(path))
    if mode == "rank0_index":
        mapping = {k: 1 + i % 3 for i, k in enumerate(sorted(keys))}
        return hf.HuggingFaceStorageWriter(str(path), fqn_to_index_mapping=mapping)
    if mode == "distributed":
        return hf.HuggingFaceStorageWriter(str(path), save_distributed=True)
    mapping = {k: 1 + i % 2 for i, k in enumerate(sorted(keys))}
    return hf.HuggingFaceStorageWriter(
        str(path), save_distributed=True, enable_consolidation=True, fqn_to_index_mapping=mapping
    )


def _save(path: Path, mode: str, world: int, rows: int, seed: int) -> None:
    full = _full(mode, rows, seed)

    def rank(comm: Any) -> None:
        if mode.startswith("rank0"):  # rank-0 checkpointing: rank 0 holds the full state dict
            sd: dict[str, Any] = dict(full) if comm.rank == 0 else {}
        else:
            sd = {k: _sharded(v, world, comm.rank, True) for k, v in full.items() if k != "rep"}
            sd["rep"] = full["rep"]
        refdcp.save(sd, storage_writer=_writer(mode, path, list(full)), comm=comm)

    FakeWorld(world).run(rank, timeout=120)


def _load(path: Path, mode: str, world: int, rows: int, seed: int, how: str) -> list[list[str]]:
    full = _full(mode, rows, seed)

    def rank(comm: Any) -> list[str]:
        sd: dict[str, Any] = {k: _sharded(v, world, comm.rank, False) for k, v in full.items()}
        sd["rep"] = torch.zeros_like(full["rep"])
        if how == "reader":
            refdcp.load(sd, storage_reader=hf.HuggingFaceStorageReader(str(path)), comm=comm)
        elif how == "reference":  # the readable reference path (REF-1)
            reader = hf.HuggingFaceStorageReader(str(path))
            refdcp.reference.load(sd, storage_reader=reader, comm=comm)
        else:
            refdcp.load(sd, checkpoint_id=str(path), comm=comm)
        bad = [] if torch.equal(bits(sd.pop("rep")), bits(full["rep"])) else ["rep"]
        for k, got in sd.items():
            want = _sharded(full[k], world, comm.rank, True)
            if not all(
                torch.equal(bits(a[1]), bits(b[1])) for a, b in zip(want.chunks, got.chunks)
            ):
                bad.append(k)
        return bad

    return FakeWorld(world).run(rank, timeout=120)


@pytest.mark.spec("API-25", "API-3")
@settings(
    max_examples=16, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    mode=st.sampled_from(MODES),
    w_save=st.integers(1, 4),
    w_load=st.integers(1, 4),
    rows=st.integers(1, 9),
    seed=st.integers(1, 1000),
    how=st.sampled_from(["reader", "checkpoint_id", "reference"]),
)
def test_hf_checkpoints_load_resharded_bit_exact(
    tmp_path_factory: pytest.TempPathFactory,
    mode: str,
    w_save: int,
    w_load: int,
    rows: int,
    seed: int,
    how: str,
) -> None:
    path = tmp_path_factory.mktemp("hf")
    _save(path, mode, w_save, rows, seed)
    names = sorted(p.name for p in path.iterdir())
    if mode in ("rank0_index", "consolidated"):
        assert "model.safetensors.index.json" in names
        assert sum(n.endswith(".safetensors") for n in names) > 1
    assert _load(path, mode, w_load, rows, seed, how) == [[] for _ in range(w_load)]


@pytest.mark.spec("API-25")
@pytest.mark.parametrize("mode", MODES)
def test_refdcp_load_equals_torchs_own_load(tmp_path: Path, mode: str) -> None:
    """refdcp.load and torch's dcp.load of one HF checkpoint give the same bits, and a
    checkpoint written by torch's whole path (dcp.save) loads with refdcp.load."""
    full = _full(mode, 5, 7)
    if mode.startswith("rank0"):
        dcp.save(dict(full), storage_writer=_writer(mode, tmp_path, list(full)), no_dist=True)
    else:
        _save(tmp_path, mode, 3, 5, 7)
    ours = {k: torch.zeros_like(v) for k, v in full.items()}
    theirs = {k: torch.zeros_like(v) for k, v in full.items()}
    refdcp.load(ours, checkpoint_id=str(tmp_path), no_dist=True)
    dcp.load(theirs, storage_reader=hf.HuggingFaceStorageReader(str(tmp_path)), no_dist=True)
    for k, v in full.items():
        assert torch.equal(bits(ours[k]), bits(v)), k
        assert torch.equal(bits(theirs[k]), bits(v)), k


@pytest.mark.spec("API-25", "API-5")
def test_checkpoint_id_chooses_the_hf_reader_only_for_its_layout(tmp_path: Path) -> None:
    hf_dir, dcp_dir, empty = tmp_path / "hf", tmp_path / "dcp", tmp_path / "empty"
    empty.mkdir()
    dcp.save({"a": torch.ones(2)}, storage_writer=_writer("rank0", hf_dir, ["a"]), no_dist=True)
    refdcp.save({"a": torch.ones(2)}, checkpoint_id=str(dcp_dir), no_dist=True)
    assert type(select_reader(str(hf_dir))).__name__ == "HuggingFaceStorageReader"
    assert type(select_reader(hf_dir)).__name__ == "HuggingFaceStorageReader"
    assert type(select_reader(str(dcp_dir))) is refdcp.FileSystemReader
    assert type(select_reader(str(empty))) is refdcp.FileSystemReader
    # a .safetensors file beside a .metadata: the DCP checkpoint wins
    (dcp_dir / "extra.safetensors").write_bytes(b"")
    assert type(select_reader(str(dcp_dir))) is refdcp.FileSystemReader


@pytest.mark.spec("API-25")
def test_without_safetensors_the_error_names_the_package(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import sys

    dcp.save({"a": torch.ones(2)}, storage_writer=_writer("rank0", tmp_path, ["a"]), no_dist=True)
    monkeypatch.setitem(sys.modules, "safetensors", None)
    with pytest.raises(CheckpointError, match="pip install safetensors"):
        refdcp.load({"a": torch.zeros(2)}, checkpoint_id=str(tmp_path), no_dist=True)


# -- what torch's modes cannot hold: stated, so a torch that changes it is noticed -----------


@pytest.mark.spec("API-25")
def test_rank0_mode_keeps_only_one_ranks_items(tmp_path: Path) -> None:
    """Every rank writes ``model-00001-of-00001.safetensors``: the ranks' files overwrite each
    other (here the result does not load; torch gives no guarantee that it never does)."""

    def rank(comm: Any) -> None:
        sd = {"a": torch.ones(4) * (comm.rank + 1)} if comm.rank == 0 else {"b": torch.ones(3)}
        refdcp.save(sd, storage_writer=hf.HuggingFaceStorageWriter(str(tmp_path)), comm=comm)

    FakeWorld(2).run(rank)
    out = {"a": torch.zeros(4), "b": torch.zeros(3)}
    with pytest.raises(CheckpointError):
        refdcp.load(out, checkpoint_id=str(tmp_path), no_dist=True)


@pytest.mark.spec("API-25")
def test_consolidation_refuses_integer_dtypes(tmp_path: Path) -> None:
    full = torch.arange(6, dtype=torch.int32).reshape(2, 3)

    def rank(comm: Any) -> None:
        sd = {"x": _sharded(full, 2, comm.rank, True)}
        refdcp.save(sd, storage_writer=_writer("consolidated", tmp_path, ["x"]), comm=comm)

    with pytest.raises(CheckpointError, match="finfo"):
        FakeWorld(2).run(rank)
