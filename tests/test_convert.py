"""``refdcp convert``: DCP <-> torch.save <-> safetensors (spec/tooling.md, TOOL-18..22)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
import torch.distributed.checkpoint as tdcp
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save, torch_save_to_dcp

import refdcp
import refdcp.tools.convert as cv
from refdcp.comm import FakeWorld
from refdcp.storage.errors import CorruptionError
from refdcp.tools.cli import main as cli_main
from refdcp.tools.convert import SAFETENSORS_DTYPES, ConvertError, convert, detect_format
from refdcp.tools.spec_report import repo_root

SINGLE_PATH = "tests the `refdcp convert` tool (TOOL-18..22), built on the default path"

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

#: Every dtype a plain CPU tensor can have that both DCP and torch.save hold.
ALL_DTYPES = [
    torch.float64,
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.complex64,
    torch.complex128,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.uint16,
    torch.uint32,
    torch.uint64,
    torch.bool,
    torch.float8_e4m3fn,
    torch.float8_e4m3fnuz,
    torch.float8_e5m2,
    torch.float8_e5m2fnuz,
]


def _random(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random bytes reinterpreted as ``dtype``: NaN payloads, denormals, every bit pattern."""
    g = torch.Generator().manual_seed(seed)
    n = torch.Size(shape).numel() * dtype.itemsize
    raw = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        raw = raw % 2
    return raw.view(dtype).reshape(shape)


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def same(a: Any, b: Any) -> bool:
    """Equal structure, types, dtypes, shapes and bytes."""
    if isinstance(a, torch.Tensor):
        return (
            isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and _bits(a) == _bits(b)
        )
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and bool(a == b)


def all_dtype_state(seed: int = 0) -> dict[str, Any]:
    tensors = {
        str(dt).replace("torch.", ""): _random((3, 5), dt, seed + i)
        for i, dt in enumerate(ALL_DTYPES)
    }
    return {
        "model": {
            "dtypes": tensors,
            "scalar": _random((), torch.float32, 99),
            "empty": torch.empty(0, 4),
            "layers": [torch.arange(6.0).reshape(2, 3), torch.ones(2, dtype=torch.int64)],
        },
        "step": 1234,
        "lr": 0.25,
        "name": "run-7",
    }


def _torch_dcp_save(state: dict[str, Any], path: Path) -> None:
    tdcp.save(state, checkpoint_id=str(path), no_dist=True)


def _no_partial_files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.startswith("."))


# --- format detection -------------------------------------------------------------------------


@pytest.mark.spec("TOOL-18")
def test_formats_come_from_the_paths(tmp_path: Path) -> None:
    (tmp_path / "ckpt").mkdir()
    assert detect_format(tmp_path / "ckpt", existing=True) == "dcp"
    for name, fmt in [
        ("m.safetensors", "safetensors"),
        ("m.pt", "torch"),
        ("m.PTH", "torch"),
        ("m.bin", "torch"),
        ("m.ckpt", "torch"),
        ("out_dir", "dcp"),
    ]:
        assert detect_format(tmp_path / name, existing=False) == fmt
    blob = tmp_path / "weights.data"
    torch.save({"a": torch.ones(1)}, blob)
    assert detect_format(blob, existing=True) == "torch"  # sniffed: a zip archive
    (tmp_path / "x.unknown").write_bytes(b"hello")
    with pytest.raises(ConvertError, match="pass --from"):
        detect_format(tmp_path / "x.unknown", existing=True)


# --- DCP -> torch.save, against torch's dcp_to_torch_save -------------------------------------


@pytest.mark.spec("TOOL-20")
@pytest.mark.parametrize("writer", ["refdcp", "torch"])
def test_dcp_to_torch_save_equals_torchs_bit_for_bit(tmp_path: Path, writer: str) -> None:
    state = all_dtype_state()
    src = tmp_path / "dcp"
    if writer == "refdcp":
        refdcp.save(state, checkpoint_id=str(src))
    else:
        _torch_dcp_save(state, src)
    convert(src, tmp_path / "ours.pt")
    dcp_to_torch_save(src, tmp_path / "torchs.pt")
    ours = torch.load(tmp_path / "ours.pt", weights_only=True)
    theirs = torch.load(tmp_path / "torchs.pt", weights_only=True)
    assert same(ours, theirs)
    assert same(ours, state)


@pytest.mark.spec("TOOL-19", "TOOL-20")
def test_torch_written_chunks_are_read_in_place_not_decoded_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = all_dtype_state()
    _torch_dcp_save(state, tmp_path / "dcp")
    spans: list[object] = []
    real = cv._torch_save_span

    def spy(*args: Any) -> Any:
        spans.append(real(*args))
        return spans[-1]

    monkeypatch.setattr(cv, "_torch_save_span", spy)
    convert(tmp_path / "dcp", tmp_path / "o.pt")
    nonempty = sum(1 for v in state["model"]["dtypes"].values()) + 3  # + scalar, 2 layers
    assert len(spans) == nonempty + 1  # + the empty tensor's chunk
    assert all(s is not None for s in spans)
    assert same(torch.load(tmp_path / "o.pt", weights_only=True), state)


@pytest.mark.spec("TOOL-20")
@pytest.mark.parametrize("sharding", ["rows", "cols"])
@pytest.mark.parametrize("scratch", [None, 64])
def test_sharded_multi_rank_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sharding: str, scratch: int | None
) -> None:
    """Chunks of 4 ranks, row or column boxes, scattered through a tiny scratch buffer."""
    if scratch is not None:
        monkeypatch.setattr(cv, "_SCRATCH_BYTES", scratch)
    full = _random((8, 12), torch.bfloat16, 5)
    dim = 0 if sharding == "rows" else 1
    path = tmp_path / "dcp"

    def rank_main(comm: Any) -> Any:
        r = comm.rank
        n = full.shape[dim] // 4
        piece = full.narrow(dim, r * n, n).clone()
        offsets = (r * n, 0) if dim == 0 else (0, r * n)
        state = {"w": refdcp.LocalShards(tuple(full.shape), [(offsets, piece)]), "b": full[0]}
        return refdcp.save(state, checkpoint_id=str(path), comm=comm)

    FakeWorld(4).run(rank_main)
    convert(path, tmp_path / "o.pt")
    dcp_to_torch_save(path, tmp_path / "t.pt")
    ours = torch.load(tmp_path / "o.pt", weights_only=True)
    assert same(ours, torch.load(tmp_path / "t.pt", weights_only=True))
    assert same(ours["w"], full)


# --- torch.save -> DCP, against torch's torch_save_to_dcp -------------------------------------


def _template(state: Any) -> Any:
    if isinstance(state, torch.Tensor):
        return torch.zeros_like(state)
    if isinstance(state, dict):
        return {k: _template(v) for k, v in state.items()}
    if isinstance(state, list):
        return [_template(v) for v in state]
    return None


@pytest.mark.spec("TOOL-20")
def test_torch_save_to_dcp_loads_like_torchs(tmp_path: Path) -> None:
    state = all_dtype_state()
    torch.save(state, tmp_path / "m.pt")
    convert(tmp_path / "m.pt", tmp_path / "ours")
    torch_save_to_dcp(tmp_path / "m.pt", tmp_path / "torchs")
    for which in ("ours", "torchs"):
        for loader in ("torch", "refdcp"):
            dest = _template(state)
            if loader == "torch":
                tdcp.load(dest, checkpoint_id=str(tmp_path / which), no_dist=True)
            else:
                refdcp.load(dest, checkpoint_id=str(tmp_path / which))
            assert same(dest, state), (which, loader)
    # the same keys and metadata entries as torch's own conversion
    ours = refdcp.FileSystemReader(tmp_path / "ours").read_metadata()
    theirs = refdcp.FileSystemReader(tmp_path / "torchs").read_metadata()
    assert ours.state_dict_metadata.keys() == theirs.state_dict_metadata.keys()
    for fqn, entry in theirs.state_dict_metadata.items():
        assert type(ours.state_dict_metadata[fqn]) is type(entry)
    assert refdcp.verify_checkpoint(tmp_path / "ours") is not None  # refdcp checksums present


@pytest.mark.spec("TOOL-20")
def test_dcp_round_trip_through_torch_save_and_back(tmp_path: Path) -> None:
    state = all_dtype_state()
    refdcp.save(state, checkpoint_id=str(tmp_path / "a"))
    convert(tmp_path / "a", tmp_path / "a.pt")
    convert(tmp_path / "a.pt", tmp_path / "b")
    convert(tmp_path / "b", tmp_path / "b.pt")
    assert same(
        torch.load(tmp_path / "a.pt", weights_only=True),
        torch.load(tmp_path / "b.pt", weights_only=True),
    )


# --- safetensors ------------------------------------------------------------------------------


def _tensor_state(seed: int = 0) -> dict[str, torch.Tensor]:
    return {
        f"t.{str(dt).replace('torch.', '')}": _random((4, 3), dt, seed + i)
        for i, dt in enumerate(SAFETENSORS_DTYPES)
    } | {"scalar": torch.tensor(1.5), "empty": torch.empty(0, 3, dtype=torch.float16)}


@pytest.mark.spec("TOOL-20")
def test_our_dtype_names_are_the_safetensors_packages() -> None:
    names = {v: k for k, v in safetensors.torch._TYPES.items()}
    assert {dt: names[dt] for dt in SAFETENSORS_DTYPES} == SAFETENSORS_DTYPES


@pytest.mark.spec("TOOL-20")
@pytest.mark.parametrize("src_fmt", ["dcp", "torch"])
def test_to_safetensors_loads_with_the_package(tmp_path: Path, src_fmt: str) -> None:
    state = _tensor_state()
    src = tmp_path / ("src" if src_fmt == "dcp" else "src.pt")
    if src_fmt == "dcp":
        _torch_dcp_save(state, src)
    else:
        torch.save(state, src)
    convert(src, tmp_path / "m.safetensors")
    loaded = safetensors.torch.load_file(tmp_path / "m.safetensors")
    assert same(loaded, state)


@pytest.mark.spec("TOOL-20")
@pytest.mark.parametrize("dst_fmt", ["dcp", "torch"])
def test_from_safetensors_written_by_the_package(tmp_path: Path, dst_fmt: str) -> None:
    state = _tensor_state(7)
    safetensors.torch.save_file(state, tmp_path / "m.safetensors", metadata={"k": "v"})
    dst = tmp_path / ("out" if dst_fmt == "dcp" else "out.pt")
    convert(tmp_path / "m.safetensors", dst)
    if dst_fmt == "torch":
        got = torch.load(dst, weights_only=True)
    else:
        got = _template(state)
        tdcp.load(got, checkpoint_id=str(dst), no_dist=True)
    assert same(got, state)


@pytest.mark.spec("TOOL-20")
def test_nested_dcp_to_safetensors_uses_flattened_fqns_and_comes_back(tmp_path: Path) -> None:
    state = {"model": {"w": torch.randn(3, 2), "layers": [torch.ones(2), torch.zeros(1)]}}
    refdcp.save(state, checkpoint_id=str(tmp_path / "a"))
    convert(tmp_path / "a", tmp_path / "a.safetensors")
    flat = safetensors.torch.load_file(tmp_path / "a.safetensors")
    assert sorted(flat) == ["model.layers.0", "model.layers.1", "model.w"]
    convert(tmp_path / "a.safetensors", tmp_path / "b")
    dest = _template(state)
    refdcp.load(dest, checkpoint_id=str(tmp_path / "b"))  # same FQNs: loads into the nesting
    assert same(dest, state)


# --- refusals ---------------------------------------------------------------------------------


@pytest.mark.spec("TOOL-21")
def test_non_tensors_to_safetensors_are_refused_by_name(tmp_path: Path) -> None:
    state = all_dtype_state()
    state["model"]["dtypes"].pop("complex128")  # keep this test about non-tensors only
    refdcp.save(state, checkpoint_id=str(tmp_path / "a"))
    with pytest.raises(ConvertError) as exc:
        convert(tmp_path / "a", tmp_path / "a.safetensors")
    msg = str(exc.value)
    for key in ("'step' (int)", "'lr' (float)", "'name' (str)", "--drop-non-tensors"):
        assert key in msg
    assert not (tmp_path / "a.safetensors").exists() and _no_partial_files(tmp_path) == []
    report = convert(tmp_path / "a", tmp_path / "a.safetensors", drop_non_tensors=True)
    assert sorted(report.dropped) == ["lr", "name", "step"]
    loaded = safetensors.torch.load_file(tmp_path / "a.safetensors")
    assert "step" not in loaded and same(loaded["model.empty"], state["model"]["empty"])


@pytest.mark.spec("TOOL-21")
def test_dtype_without_a_safetensors_name_is_refused(tmp_path: Path) -> None:
    torch.save({"ok": torch.ones(2), "z": torch.ones(2, dtype=torch.complex128)}, tmp_path / "a.pt")
    with pytest.raises(ConvertError, match=r"z: dtype complex128 has no safetensors name"):
        convert(tmp_path / "a.pt", tmp_path / "a.safetensors")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.pt"]


@pytest.mark.spec("TOOL-18", "TOOL-21")
def test_refusals_write_nothing(tmp_path: Path) -> None:
    torch.save({"a": torch.ones(2)}, tmp_path / "a.pt")
    with pytest.raises(ConvertError, match="both torch"):
        convert(tmp_path / "a.pt", tmp_path / "b.pt")
    with pytest.raises(ConvertError, match="no such file"):
        convert(tmp_path / "missing.pt", tmp_path / "out")
    (tmp_path / "taken.safetensors").write_bytes(b"keep me")
    with pytest.raises(ConvertError, match="--overwrite"):
        convert(tmp_path / "a.pt", tmp_path / "taken.safetensors")
    assert (tmp_path / "taken.safetensors").read_bytes() == b"keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.pt", "taken.safetensors"]
    convert(tmp_path / "a.pt", tmp_path / "taken.safetensors", overwrite=True)
    assert same(safetensors.torch.load_file(tmp_path / "taken.safetensors"), {"a": torch.ones(2)})


# --- corruption -------------------------------------------------------------------------------


def _flip_data_byte(directory: Path, fqn: str, data: torch.Tensor) -> str:
    """Flip one bit inside the raw bytes of ``data`` as stored for ``fqn``."""
    md = refdcp.FileSystemReader(directory).read_metadata()
    assert md.storage_data is not None
    info = next(v for k, v in md.storage_data.items() if k.fqn == fqn)
    path = directory / info.relative_path
    raw = bytearray(path.read_bytes())
    at = raw.find(_bits(data), info.offset, info.offset + info.length)
    assert at >= 0
    raw[at + len(_bits(data)) // 2] ^= 0x01
    path.write_bytes(bytes(raw))
    return str(info.relative_path)


@pytest.mark.spec("TOOL-20")
@pytest.mark.parametrize("writer", ["refdcp", "torch"])
def test_flipped_data_byte_is_named(tmp_path: Path, writer: str) -> None:
    state = {"big": torch.arange(1000, dtype=torch.float32), "small": torch.ones(2)}
    if writer == "refdcp":
        refdcp.save(state, checkpoint_id=str(tmp_path / "a"))
    else:
        _torch_dcp_save(state, tmp_path / "a")
    file = _flip_data_byte(tmp_path / "a", "big", state["big"])
    with pytest.raises(CorruptionError) as exc:
        convert(tmp_path / "a", tmp_path / "a.pt")
    assert "'big'" in str(exc.value) and file in str(exc.value)
    assert not (tmp_path / "a.pt").exists() and _no_partial_files(tmp_path) == []


# --- progress and CLI -------------------------------------------------------------------------


@pytest.mark.spec("TOOL-22", "TOOL-18")
def test_cli_reports_progress_and_a_summary(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    state = {"w": torch.ones(256, 256), "step": 3}
    refdcp.save(state, checkpoint_id=str(tmp_path / "a"))
    assert (
        cli_main(["convert", str(tmp_path / "a"), str(tmp_path / "weights"), "--to", "torch"]) == 0
    )
    out, err = capsys.readouterr()
    assert "convert dcp -> torch done: 256.0 KiB" in err
    assert "(dcp) ->" in out and "(torch): 1 tensor(s), 256.0 KiB, 1 other value(s)" in out
    assert "checksums verified: 2 item(s)" in out
    assert same(torch.load(tmp_path / "weights", weights_only=True), state)
    code = cli_main(["convert", str(tmp_path / "a"), str(tmp_path / "w.safetensors")])
    out, err = capsys.readouterr()
    assert code == 1 and "refdcp convert: error: safetensors holds only tensors" in err
    assert "Traceback" not in err


# --- memory (TOOL-19) -------------------------------------------------------------------------


@pytest.mark.spec("TOOL-19")
@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc")
def test_peak_memory_is_one_tensor_in_a_fresh_process(tmp_path: Path) -> None:
    """6 tensors of 8 MiB: every direction peaks near 8 MiB above its start, never near 48."""
    script = repo_root() / "tests" / "_convert_memory.py"
    env = dict(os.environ, PYTHONPATH=str(repo_root()), PYTHONWARNINGS="ignore")
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path), "6", "8"],
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    figures = json.loads(proc.stdout.strip().splitlines()[-1])
    largest, total = figures.pop("largest_tensor"), figures.pop("total")
    assert len(figures) == 6
    for direction, extra in figures.items():
        assert extra <= largest + (4 << 20), (direction, extra / 2**20)
    assert total == 6 * largest


def test_same_helper_sees_differences() -> None:
    a = {"x": torch.tensor([float("nan")]), "l": [1]}
    b = {"x": torch.tensor([float("nan")]), "l": [1]}
    assert same(a, b)  # NaN equal by bits
    b["x"] = torch.tensor([float("nan")]).view(torch.int32).add(1).view(torch.float32)
    assert not same(a, b)
    assert not same({"l": [1]}, {"l": (1,)})
    assert not same(torch.ones(2), torch.ones(2, dtype=torch.float64))


@pytest.mark.spec("TOOL-20")
@pytest.mark.parametrize(
    ("size", "chunks", "problem"),
    [
        ((4, 4), [((0, 0), (3, 4)), ((2, 0), (2, 4))], "overlap"),
        ((4, 4), [((0, 0), (4, 2)), ((0, 1), (4, 3))], "overlap"),
        ((4, 4), [((0, 0), (2, 4))], "cover 8 of 16"),
        ((4, 4), [((0, 0), (2, 4)), ((3, 0), (2, 4))], "outside"),
        ((), [((), ()), ((), ())], "overlap"),
    ],
)
def test_chunks_that_do_not_tile_the_tensor_are_refused(
    size: tuple[int, ...], chunks: list[Any], problem: str
) -> None:
    """Uncovered elements would be uninitialised memory in the output: refuse them."""
    with pytest.raises(ConvertError, match=problem):
        cv._check_cover("w", size, chunks)
    cv._check_cover("w", (4, 4), [((0, 0), (2, 4)), ((2, 0), (2, 4))])  # a tiling is fine
