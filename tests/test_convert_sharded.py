"""``refdcp convert`` to and from sharded safetensors with an index (TOOL-32).

Oracles: the ``safetensors`` package reads every shard the index names, and torch's
``HuggingFaceStorageReader`` (through ``refdcp.load`` and torch's ``dcp.load``) loads
what convert writes; convert reads what torch's ``HuggingFaceStorageWriter`` writes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as tdcp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import refdcp
from refdcp.comm import FakeWorld
from refdcp.tools.cli import main as cli_main
from refdcp.tools.convert import INDEX_SUFFIX, ConvertError, convert, detect_format
from tests.test_convert import _random, same

SINGLE_PATH = "tests the `refdcp convert` tool (TOOL-32) against torch's Hugging Face storage"

safetensors_torch = pytest.importorskip("safetensors.torch")
hf = pytest.importorskip("torch.distributed.checkpoint.hf_storage")

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

#: safetensors dtypes torch's HuggingFaceStorageReader also reads back.
DTYPES = [
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.complex64,
]


def _state(sizes: list[int], seed: int) -> dict[str, torch.Tensor]:
    return {
        f"layer{i}.w": _random((n, 3), DTYPES[(seed + i) % len(DTYPES)], seed + i)
        for i, n in enumerate(sizes)
    }


def _read_with_package(index: Path) -> dict[str, torch.Tensor]:
    weight_map = json.loads(index.read_text())["weight_map"]
    out: dict[str, torch.Tensor] = {}
    for name in sorted(set(weight_map.values())):
        part = safetensors_torch.load_file(index.parent / name)
        assert {k for k, v in weight_map.items() if v == name} == set(part)
        out |= part
    return out


@pytest.mark.spec("TOOL-32")
@settings(
    max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    sizes=st.lists(st.integers(0, 40), min_size=1, max_size=7),
    max_shard=st.integers(1, 600),
    seed=st.integers(0, 100),
    load_world=st.integers(1, 4),
)
def test_dcp_to_sharded_and_back_bit_exact(
    tmp_path_factory: pytest.TempPathFactory,
    sizes: list[int],
    max_shard: int,
    seed: int,
    load_world: int,
) -> None:
    tmp = tmp_path_factory.mktemp("sharded")
    state = _state(sizes, seed)
    refdcp.save(state, checkpoint_id=str(tmp / "dcp"), no_dist=True)
    report = convert(
        tmp / "dcp", tmp / "out", dst_format="safetensors-index", max_shard_bytes=max_shard
    )
    index = tmp / "out" / f"model{INDEX_SUFFIX}"
    doc = json.loads(index.read_text())
    names = sorted(set(doc["weight_map"].values()))
    assert report.shards == len(names) == len(list((tmp / "out").glob("*.safetensors")))
    assert doc["metadata"]["total_size"] == sum(t.nbytes for t in state.values())
    assert all(
        n == f"model-{i:05d}-of-{len(names):05d}.safetensors" for i, n in enumerate(names, 1)
    )
    # each shard holds at most max_shard bytes unless one tensor alone is larger
    for name in names:
        keys = [k for k, v in doc["weight_map"].items() if v == name]
        held = sum(state[k].nbytes for k in keys)
        assert held <= max_shard or len(keys) == 1
    assert same(_read_with_package(index), state)
    assert detect_format(tmp / "out", existing=True) == "safetensors-index"

    # torch's HF reader loads it through refdcp.load, every rank a full copy
    def rank(comm: Any) -> bool:
        got = {k: torch.zeros_like(v) for k, v in state.items()}
        refdcp.load(got, checkpoint_id=str(tmp / "out"), comm=comm)
        return same(got, state)

    assert FakeWorld(load_world).run(rank) == [True] * load_world
    # and back: the directory and the index file both name the source
    for i, src in enumerate((tmp / "out", index)):
        convert(src, tmp / f"back{i}")
        back = {k: torch.zeros_like(v) for k, v in state.items()}
        refdcp.load(back, checkpoint_id=str(tmp / f"back{i}"), no_dist=True)
        assert same(back, state)


@pytest.mark.spec("TOOL-32")
@pytest.mark.parametrize("world", [1, 3])
def test_reads_what_torchs_hf_writer_writes(tmp_path: Path, world: int) -> None:
    """torch's consolidated sharded output (float dtypes: torch consolidates no others)
    converts to DCP and to torch.save bit-exact."""
    full = {f"t{i}": _random((6, 2), dt, i) for i, dt in enumerate(DTYPES[:4])}
    mapping = {k: 1 + i % 2 for i, k in enumerate(sorted(full))}

    def rank(comm: Any) -> None:
        sd = {}
        for k, v in full.items():
            lo, hi = 6 * comm.rank // world, 6 * (comm.rank + 1) // world
            sd[k] = refdcp.LocalShards(
                (6, 2), [((lo, 0), v[lo:hi])] if hi > lo else [], dtype=v.dtype
            )
        w = hf.HuggingFaceStorageWriter(
            str(tmp_path / "hf"),
            save_distributed=True,
            enable_consolidation=True,
            fqn_to_index_mapping=mapping,
        )
        refdcp.save(sd, storage_writer=w, comm=comm)

    FakeWorld(world).run(rank)
    assert detect_format(tmp_path / "hf", existing=True) == "safetensors-index"
    convert(tmp_path / "hf", tmp_path / "dcp")
    out = {k: torch.zeros_like(v) for k, v in full.items()}
    tdcp.load(out, storage_reader=tdcp.FileSystemReader(tmp_path / "dcp"), no_dist=True)
    assert same(out, full)
    convert(tmp_path / "hf", tmp_path / "m.pt")
    assert same(torch.load(tmp_path / "m.pt", weights_only=True), full)


@pytest.mark.spec("TOOL-32")
def test_index_destination_names_the_shards_and_cli_size(tmp_path: Path, capsys: Any) -> None:
    state = {f"w{i}": _random((50, 3), torch.float32, i) for i in range(3)}  # 600 B each
    safetensors_torch.save_file(state, tmp_path / "one.safetensors")
    dst = tmp_path / "o" / f"ckpt{INDEX_SUFFIX}"
    code = cli_main(
        ["convert", str(tmp_path / "one.safetensors"), str(dst), "--max-shard-size", "1KiB"]
    )
    assert code == 0
    assert "shards: " in capsys.readouterr().out
    names = sorted(p.name for p in dst.parent.iterdir())
    assert names == [f"ckpt-0000{i}-of-00003.safetensors" for i in (1, 2, 3)] + [dst.name]
    assert same(_read_with_package(dst), state)
    theirs = {k: torch.zeros_like(v) for k, v in state.items()}  # torch's whole load path
    tdcp.load(theirs, storage_reader=hf.HuggingFaceStorageReader(str(dst.parent)), no_dist=True)
    assert same(theirs, state)
    with pytest.raises(SystemExit):
        cli_main(["convert", str(dst), str(tmp_path / "x"), "--max-shard-size", "lots"])
    # overwriting with fewer shards removes the shards the old index named
    assert cli_main(["convert", str(tmp_path / "one.safetensors"), str(dst), "--overwrite"]) == 0
    assert sorted(p.name for p in dst.parent.iterdir()) == [
        "ckpt-00001-of-00001.safetensors",
        dst.name,
    ]


@pytest.mark.spec("TOOL-32", "TOOL-21")
def test_refusals_leave_no_index_and_no_shard(tmp_path: Path) -> None:
    state: dict[str, Any] = {"a": torch.ones(3), "c": torch.ones(2, dtype=torch.complex128)}
    refdcp.save(state, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    with pytest.raises(ConvertError, match="complex128"):
        convert(tmp_path / "dcp", tmp_path / f"o/m{INDEX_SUFFIX}", max_shard_bytes=4)
    assert not (tmp_path / "o").exists() or not list((tmp_path / "o").iterdir())
    refdcp.save({"a": torch.ones(3), "n": 5}, checkpoint_id=str(tmp_path / "d2"), no_dist=True)
    with pytest.raises(ConvertError, match="non-tensor"):
        convert(tmp_path / "d2", tmp_path / f"p/m{INDEX_SUFFIX}")


def _sharded_source(tmp_path: Path) -> Path:
    state = _state([4, 5], 2)
    refdcp.save(state, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    convert(tmp_path / "dcp", tmp_path / "s", dst_format="safetensors-index", max_shard_bytes=1)
    return tmp_path / "s" / f"model{INDEX_SUFFIX}"


@pytest.mark.spec("TOOL-32")
@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda m: m | {"layer9.w": "model-00001-of-00002.safetensors"}, "disagree"),
        (lambda m: dict(zip(m, reversed(m.values()))), "disagree"),
        (lambda m: dict.fromkeys(m, "model-00001-of-00002.safetensors"), "disagree"),
        (
            lambda m: dict.fromkeys(m, "../model-00001-of-00002.safetensors"),
            "not a plain file name",
        ),
        (lambda m: 7, "weight_map"),
    ],
)
def test_an_index_that_disagrees_with_its_files_is_refused(
    tmp_path: Path, edit: Any, message: str
) -> None:
    index = _sharded_source(tmp_path)
    doc = json.loads(index.read_text())
    doc["weight_map"] = edit(doc["weight_map"])
    index.write_text(json.dumps(doc))
    with pytest.raises(ConvertError, match=message):
        convert(index, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.spec("TOOL-32")
def test_a_directory_with_two_indexes_must_name_one(tmp_path: Path) -> None:
    index = _sharded_source(tmp_path)
    (index.parent / f"other{INDEX_SUFFIX}").write_text(index.read_text())
    with pytest.raises(ConvertError, match="name the index itself"):
        convert(index.parent, tmp_path / "out")
    convert(index, tmp_path / "out")
    assert (tmp_path / "out" / ".metadata").is_file()
