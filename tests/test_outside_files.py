"""Nothing outside what refdcp wrote is ever touched (STORE-63, STORE-64, TOOL-33, TOOL-34).

Each test plays the attacker or the careless user: an old index that names files refdcp
never wrote, a hard link planted at a name refdcp writes, a symbolic link or FIFO named
``*.safetensors``, a crafted safetensors header. The property checked is always the
same: no byte outside what refdcp created changes, and refdcp either succeeds without
touching it or refuses naming it.
"""

from __future__ import annotations

import inspect
import json
import os
import struct
import threading
import uuid
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import refdcp
from refdcp.errors import CheckpointError, RefdcpError
from refdcp.storage.errors import UnsafePathError
from refdcp.tools import convert as convert_module
from refdcp.tools.convert import INDEX_SUFFIX, ConvertError, convert

safetensors_torch = pytest.importorskip("safetensors.torch")
safetensors = pytest.importorskip("safetensors")

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

FIXTURES = [HealthCheck.function_scoped_fixture]
OUTSIDE = b"outside bytes refdcp never wrote\n"


def _snapshot(folder: Path) -> dict[str, bytes | str]:
    """Every entry of ``folder``: a file's bytes, a link's target."""
    out: dict[str, bytes | str] = {}
    for p in sorted(folder.iterdir()):
        out[p.name] = os.readlink(p) if p.is_symlink() else p.read_bytes()
    return out


def _state(n: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"w{i}": torch.randn((i + 2, 3), generator=g) for i in range(n)}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# --- TOOL-33: convert --overwrite removes only what it can prove it wrote --------------------

#: files of a Hugging Face directory that an old index may name (crafted or careless)
_HF_FILES = ["config.json", "tokenizer.json", "generation_config.json", "README.md"]


@pytest.mark.spec("TOOL-33")
@settings(max_examples=20, deadline=None, suppress_health_check=FIXTURES)
@given(
    named=st.lists(
        st.sampled_from([*_HF_FILES, f"model{INDEX_SUFFIX}", "model-00001-of-00001.safetensors"]),
        min_size=1,
        max_size=5,
    ),
    shards=st.integers(1, 3),
)
def test_overwrite_never_removes_what_an_old_index_merely_names(
    tmp_path_factory: pytest.TempPathFactory, named: list[str], shards: int
) -> None:
    """An old index (not refdcp's) naming ``config.json``, the index itself or a shard: after
    ``--overwrite`` every file the conversion does not write is byte for byte as it was."""
    tmp = tmp_path_factory.mktemp("ow")
    hf_dir = tmp / "hf"
    hf_dir.mkdir()
    for name in _HF_FILES:
        (hf_dir / name).write_text(f"{name} of the model\n")
    safetensors_torch.save_file(_state(1, 0), hf_dir / "model-00001-of-00001.safetensors")
    index = {"metadata": {"total_size": 1}, "weight_map": {f"k{i}": n for i, n in enumerate(named)}}
    (hf_dir / f"model{INDEX_SUFFIX}").write_text(json.dumps(index))
    before = _snapshot(hf_dir)
    state = _state(3, 1)
    safetensors_torch.save_file(state, tmp / "src.safetensors")
    try:
        report = convert(
            tmp / "src.safetensors",
            hf_dir,
            dst_format="safetensors-index",
            overwrite=True,
            max_shard_bytes=max(1, sum(t.nbytes for t in state.values()) // shards),
        )
    except ConvertError as exc:  # the old shard it does not replace is not refdcp's
        assert "model-00001-of-00001.safetensors" in named and shards > 1
        assert "model-00001-of-00001.safetensors" in str(exc)
        assert _snapshot(hf_dir) == before
        return
    after = _snapshot(hf_dir)
    written = {f"model{INDEX_SUFFIX}"} | {
        f"model-{i:05d}-of-{report.shards:05d}.safetensors" for i in range(1, report.shards + 1)
    }
    assert {k: v for k, v in before.items() if k not in written} == {
        k: v for k, v in after.items() if k not in written
    }
    assert written <= set(after)
    got: dict[str, torch.Tensor] = {}
    for name in json.loads((hf_dir / f"model{INDEX_SUFFIX}").read_text())["weight_map"].values():
        got |= safetensors_torch.load_file(hf_dir / name)
    assert _same(got, state)


@pytest.mark.spec("TOOL-33")
def test_a_stale_shard_convert_cannot_prove_it_wrote_is_refused_before_writing(
    tmp_path: Path,
) -> None:
    """A Hugging Face directory of three shards, overwritten by a one-shard conversion: the
    old index is not refdcp's, so shards 2 and 3 are not removed: the conversion is refused
    with the directory unchanged."""
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    weight_map = {}
    for i in range(1, 4):
        name = f"model-{i:05d}-of-00003.safetensors"
        safetensors_torch.save_file({f"t{i}": torch.ones(2)}, hf_dir / name)
        weight_map[f"t{i}"] = name
    (hf_dir / f"model{INDEX_SUFFIX}").write_text(json.dumps({"weight_map": weight_map}))
    before = _snapshot(hf_dir)
    safetensors_torch.save_file(_state(1, 0), tmp_path / "src.safetensors")
    with pytest.raises(ConvertError, match=r"model-00002-of-00003\.safetensors"):
        convert(
            tmp_path / "src.safetensors", hf_dir, dst_format="safetensors-index", overwrite=True
        )
    assert _snapshot(hf_dir) == before


@pytest.mark.spec("TOOL-33", "TOOL-32")
@settings(max_examples=25, deadline=None, suppress_health_check=FIXTURES)
@given(fail_at=st.integers(0, 12), first=st.integers(1, 4), second=st.integers(1, 4))
def test_a_failed_overwrite_leaves_the_destination_as_it_was(
    tmp_path_factory: pytest.TempPathFactory, fail_at: int, first: int, second: int
) -> None:
    """A conversion over refdcp's own earlier one fails at the ``fail_at``-th step (a tensor
    read or a rename): the directory is as it was; when it does not fail, the old shards
    are gone and the new ones are there."""
    tmp = tmp_path_factory.mktemp("fail")
    state = _state(4, 3)
    safetensors_torch.save_file(state, tmp / "src.safetensors")
    per = sum(t.nbytes for t in state.values())
    dst = tmp / "dst"
    convert(
        tmp / "src.safetensors", dst, dst_format="safetensors-index", max_shard_bytes=per // first
    )
    (dst / "config.json").write_text("{}")
    before = _snapshot(dst)
    steps = {"n": 0}

    def step() -> None:
        steps["n"] += 1
        if steps["n"] == fail_at:
            raise OSError(28, "No space left on device (injected)")

    real_replace, real_read = os.replace, convert_module._SafetensorsSource.read

    def replace(src: Any, dst_: Any, **kw: Any) -> None:
        step()
        real_replace(src, dst_, **kw)

    def read(self: Any, fqn: str) -> torch.Tensor:
        step()
        return real_read(self, fqn)

    mp = pytest.MonkeyPatch()
    mp.setattr(convert_module.os, "replace", replace)
    mp.setattr(convert_module._SafetensorsSource, "read", read)
    try:
        try:
            report = convert(
                tmp / "src.safetensors",
                dst,
                dst_format="safetensors-index",
                overwrite=True,
                max_shard_bytes=per // second,
            )
        except OSError:
            failed = True
        else:
            failed = False
    finally:
        mp.undo()
    if failed:
        assert _snapshot(dst) == before
        return
    names = {
        f"model-{i:05d}-of-{report.shards:05d}.safetensors" for i in range(1, report.shards + 1)
    }
    assert set(_snapshot(dst)) == names | {f"model{INDEX_SUFFIX}", "config.json"}


# --- STORE-63: hard links planted at every name refdcp writes ---------------------------------

_TOKEN = "0123456789ab"


def _fixed_tokens(mp: pytest.MonkeyPatch) -> None:
    """Every random name a save makes comes from ``_TOKEN``, so a test can plant at it."""
    fixed = uuid.UUID(_TOKEN + "cdef0123456789abcdef")
    mp.setattr(uuid, "uuid4", lambda: fixed)
    import secrets

    mp.setattr(secrets, "token_hex", lambda n=None: _TOKEN[: 2 * (n or 16)])


def _save_names() -> list[str]:
    tok8 = _TOKEN[:8]
    return [
        ".metadata.lock",
        f".metadata.lock.{_TOKEN}.new",
        ".metadata",
        f".metadata.{_TOKEN}.tmp",
        f"__0_0.{_TOKEN}.distcp",
        f"__0_1.{_TOKEN}.distcp",
        f".metadata.{tok8}.tmp",
        f"__0_0.{tok8}.distcp",
        "__0_0.distcp",
    ]


def _one_process(impl: ModuleType) -> dict[str, Any]:
    """The keyword a one-process save takes in ``impl`` (the reference needs none)."""
    return {"no_dist": True} if "no_dist" in inspect.signature(impl.save).parameters else {}


@pytest.mark.spec("STORE-65", "STORE-63", "STORE-56")
@settings(max_examples=12, deadline=None, suppress_health_check=FIXTURES)
@given(
    planted=st.sets(st.sampled_from(_save_names()), min_size=1),
    existing=st.booleans(),
)
def test_a_hard_link_at_any_name_a_save_writes_leaves_the_linked_file_unchanged(
    tmp_path_factory: pytest.TempPathFactory,
    impl: ModuleType,
    planted: set[str],
    existing: bool,
) -> None:
    tmp = tmp_path_factory.mktemp("links")
    outside = tmp / "outside"
    outside.write_bytes(OUTSIDE)
    ckpt = tmp / "ckpt"
    state = _state(2, 5)
    if existing:
        impl.save(_state(2, 6), checkpoint_id=str(ckpt), **_one_process(impl))
    ckpt.mkdir(exist_ok=True)
    for name in planted:
        if not (ckpt / name).exists():
            os.link(outside, ckpt / name)
    mp = pytest.MonkeyPatch()
    _fixed_tokens(mp)
    try:
        impl.save(state, checkpoint_id=str(ckpt), **_one_process(impl))
    except (RefdcpError, CheckpointError, OSError) as exc:
        message = str(exc)
        assert any(name in message for name in planted), message
    else:
        got = {k: torch.zeros_like(v) for k, v in state.items()}
        refdcp.load(got, checkpoint_id=str(ckpt), no_dist=True)
        assert _same(got, state)
    finally:
        mp.undo()
    assert outside.read_bytes() == OUTSIDE


@pytest.mark.spec("STORE-63", "STORE-30")
def test_a_stale_lock_hard_linked_outside_is_refused_unwritten(tmp_path: Path) -> None:
    from refdcp.storage.fs.lock import acquire_save_lock

    outside = tmp_path / "outside"
    outside.write_bytes(OUTSIDE)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    os.link(outside, ckpt / ".metadata.lock")
    with pytest.raises(UnsafePathError, match=r"\.metadata\.lock.*2 links"):
        acquire_save_lock(ckpt, ".metadata", "tok")
    assert outside.read_bytes() == OUTSIDE


@pytest.mark.spec("STORE-65", "STORE-63", "TOOL-33")
@settings(max_examples=15, deadline=None, suppress_health_check=FIXTURES)
@given(
    kind=st.sampled_from(["safetensors", "torch", "index", "dcp"]),
    planted=st.sets(st.integers(0, 3), min_size=1),
)
def test_a_hard_link_at_any_name_convert_writes_leaves_the_linked_file_unchanged(
    tmp_path_factory: pytest.TempPathFactory, kind: str, planted: set[int]
) -> None:
    tmp = tmp_path_factory.mktemp("clinks")
    outside = tmp / "outside"
    outside.write_bytes(OUTSIDE)
    state = _state(3, 7)
    safetensors_torch.save_file(state, tmp / "src.safetensors")
    src = tmp / "src.safetensors"
    if kind == "safetensors":
        refdcp.save(state, checkpoint_id=str(tmp / "dcp"), no_dist=True)
        src = tmp / "dcp"
    dst = {
        "safetensors": tmp / "out.safetensors",
        "torch": tmp / "out.pt",
        "index": tmp / "out" / f"model{INDEX_SUFFIX}",
        "dcp": tmp / "outdcp",
    }[kind]
    names = {
        "safetensors": [dst],
        "torch": [dst],
        "index": [dst, *(dst.parent / f"model-{i:05d}-of-00003.safetensors" for i in (1, 2, 3))],
        "dcp": [dst / ".metadata", dst / ".metadata.lock", dst / f"__0_0.{_TOKEN}.distcp"],
    }[kind]
    for i in planted:
        target = names[i % len(names)]
        target.parent.mkdir(parents=True, exist_ok=True)
        if not target.exists():
            os.link(outside, target)
    mp = pytest.MonkeyPatch()
    _fixed_tokens(mp)
    try:
        convert(src, dst, overwrite=True, max_shard_bytes=1)
    except (RefdcpError, CheckpointError, OSError) as exc:
        assert any(n.name in str(exc) for n in names), str(exc)
    finally:
        mp.undo()
    assert outside.read_bytes() == OUTSIDE


# --- STORE-64: a safetensors directory is read through the opening rule ---------------------


def _hf_dir(tmp: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    state = _state(2, 9)
    d = tmp / "hf"
    d.mkdir()
    safetensors_torch.save_file(state, d / "model-00001-of-00001.safetensors")
    return d, state


def _with_timeout(fn: Any, seconds: float = 20.0) -> BaseException | None:
    """Run ``fn`` in a thread; what it raised (None when it returned); fails when it hangs."""
    box: dict[str, BaseException | None] = {"exc": None}

    def run() -> None:
        try:
            fn()
        except BaseException as exc:
            box["exc"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    return TimeoutError("hung") if t.is_alive() else box["exc"]


def _plant(d: Path, tmp: Path, kind: str, name: str) -> None:
    outside = tmp / "outside.safetensors"
    safetensors_torch.save_file({"secret": torch.full((2,), 7.0)}, outside)
    if kind == "symlink-out":
        os.symlink(outside, d / name)
    elif kind == "symlink-in":
        os.symlink("model-00001-of-00001.safetensors", d / name)
    elif kind == "symlink-dangling":
        os.symlink(tmp / "nowhere", d / name)
    else:
        os.mkfifo(d / name)


def _unblock(d: Path, name: str) -> None:
    """Open a FIFO for writing without blocking, so a reader stuck on it (if any) returns."""
    p = d / name
    if p.exists() and not p.is_symlink() and not p.is_file():
        try:
            fd = os.open(p, os.O_WRONLY | os.O_NONBLOCK)
            os.close(fd)
        except OSError:
            pass


@pytest.mark.spec("STORE-64", "API-25")
@settings(max_examples=12, deadline=None, suppress_health_check=FIXTURES)
@given(
    kind=st.sampled_from(["symlink-out", "symlink-in", "symlink-dangling", "fifo"]),
    name=st.sampled_from(["evil.safetensors", "model-00002-of-00002.safetensors"]),
    how=st.sampled_from(["load", "reader", "convert-dir"]),
)
def test_a_link_or_fifo_in_a_safetensors_directory_is_refused_never_followed(
    tmp_path_factory: pytest.TempPathFactory, kind: str, name: str, how: str
) -> None:
    tmp = tmp_path_factory.mktemp("hfdir")
    d, state = _hf_dir(tmp)
    _plant(d, tmp, kind, name)
    loaded: dict[str, torch.Tensor] = {}

    def run() -> None:
        if how == "convert-dir":
            index = {"weight_map": {"w0": "model-00001-of-00001.safetensors", "secret": name}}
            (d / f"model{INDEX_SUFFIX}").write_text(json.dumps(index))
            convert(d, tmp / "out")
            return
        got = {k: torch.zeros_like(v) for k, v in state.items()}
        got["secret"] = torch.zeros(2)
        if how == "load":
            refdcp.load(got, checkpoint_id=str(d), no_dist=True)
        else:
            from refdcp.storage.select import huggingface_reader

            refdcp.load(got, storage_reader=huggingface_reader(d), no_dist=True)
        loaded.update(got)

    try:
        exc = _with_timeout(run)
    finally:
        _unblock(d, name)
    assert not isinstance(exc, TimeoutError), "the read blocked on a FIFO"
    assert isinstance(exc, (RefdcpError, CheckpointError)), repr(exc)
    assert name in str(exc)
    assert not torch.equal(loaded.get("secret", torch.zeros(2)), torch.full((2,), 7.0))
    assert not (tmp / "out").exists()


@pytest.mark.spec("STORE-64", "API-25")
@settings(max_examples=10, deadline=None, suppress_health_check=FIXTURES)
@given(rows=st.integers(1, 9), world=st.integers(1, 3), seed=st.integers(0, 50))
def test_the_safetensors_reader_loads_what_the_package_writes_resharded(
    tmp_path_factory: pytest.TempPathFactory, rows: int, world: int, seed: int
) -> None:
    """The reader that opens no file by path reads a directory as torch's does."""
    from refdcp.comm import FakeWorld

    tmp = tmp_path_factory.mktemp("hfread")
    g = torch.Generator().manual_seed(seed)
    full = {"a": torch.randn((rows, 3), generator=g), "b": torch.arange(rows * 2).view(rows, 2)}
    safetensors_torch.save_file({"a": full["a"]}, tmp / "x-1.safetensors")
    safetensors_torch.save_file({"b": full["b"]}, tmp / "x-2.safetensors")

    def rank(comm: Any) -> bool:
        step = -(-rows // world)
        start = min(rows, comm.rank * step)
        n = min(rows, start + step) - start
        sd: dict[str, Any] = {
            k: refdcp.LocalShards(
                tuple(v.shape),
                [((start, 0), torch.zeros_like(v[start : start + n]))] if n else [],
                dtype=v.dtype,
            )
            for k, v in full.items()
        }
        refdcp.load(sd, checkpoint_id=str(tmp), comm=comm)
        return all(
            all(
                torch.equal(piece, full[k][o[0] : o[0] + piece.shape[0]])
                for o, piece in sd[k].chunks
            )
            for k in full
        )

    assert FakeWorld(world).run(rank) == [True] * world


# --- TOOL-34: the safetensors package's own layout checks -----------------------------------

_DTYPES = {"U8": 1, "F16": 2, "F32": 4, "I64": 8}


def _file(header: bytes, data: bytes) -> bytes:
    return struct.pack("<Q", len(header)) + header + data


@st.composite
def _layouts(draw: Any) -> tuple[bytes, int]:
    """A header and a data length: sometimes valid, sometimes overlapping, gapped, short."""
    n = draw(st.integers(0, 4))
    entries: dict[str, Any] = {}
    offset = 0
    for i in range(n):
        dtype = draw(st.sampled_from(sorted(_DTYPES)))
        shape = draw(st.lists(st.integers(0, 3), max_size=2))
        nbytes = _DTYPES[dtype]
        for s in shape:
            nbytes *= s
        begin = offset + draw(st.sampled_from([0, 0, 0, -1, 1, -nbytes]))
        end = begin + nbytes + draw(st.sampled_from([0, 0, 0, 1, -1]))
        entries[f"t{i}"] = {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}
        offset = max(offset, end)
    if draw(st.booleans()):
        entries = dict(reversed(list(entries.items())))
    meta = draw(st.sampled_from([None, {"format": "pt"}, {"n": 1}]))
    if meta is not None:
        entries["__metadata__"] = meta
    header = json.dumps(entries).encode()
    header += b" " * draw(st.integers(0, 7))
    data_len = max(0, offset + draw(st.sampled_from([0, 0, 0, 1, -1])))
    return header, data_len


def _package_reads(path: Path) -> dict[str, torch.Tensor] | None:
    try:
        with safetensors.safe_open(str(path), framework="pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    except Exception:
        return None


@pytest.mark.spec("TOOL-34")
@settings(max_examples=200, deadline=None, suppress_health_check=FIXTURES)
@given(layout=_layouts(), seed=st.integers(0, 255))
def test_convert_accepts_exactly_the_layouts_the_package_accepts(
    tmp_path_factory: pytest.TempPathFactory, layout: tuple[bytes, int], seed: int
) -> None:
    header, data_len = layout
    tmp = tmp_path_factory.mktemp("layout")
    path = tmp / "x.safetensors"
    path.write_bytes(_file(header, bytes((seed + i) % 256 for i in range(data_len))))
    theirs = _package_reads(path)
    try:
        convert(path, tmp / "out.pt")
    except ConvertError as exc:
        assert theirs is None, f"refused what the package reads: {exc}"
        assert "x.safetensors" in str(exc)
        return
    assert theirs is not None, f"accepted what the package refuses: {header!r}"
    assert _same(torch.load(tmp / "out.pt", weights_only=True), theirs)


@pytest.mark.spec("TOOL-34")
@settings(max_examples=30, deadline=None, suppress_health_check=FIXTURES)
@given(
    where=st.sampled_from(["top", "entry", "metadata"]),
    same_range=st.booleans(),
)
def test_a_duplicate_name_is_refused_naming_it(
    tmp_path_factory: pytest.TempPathFactory, where: str, same_range: bool
) -> None:
    tmp = tmp_path_factory.mktemp("dup")
    a = '{"dtype":"U8","shape":[2],"data_offsets":[0,2]}'
    b = a if same_range else '{"dtype":"U8","shape":[2],"data_offsets":[2,4]}'
    header = {
        "top": f'{{"dup":{a},"dup":{b}}}',
        "entry": '{"dup":{"dtype":"U8","shape":[2],"data_offsets":[0,2],"dtype":"U8"}}',
        "metadata": f'{{"__metadata__":{{"k":"1","k":"2"}},"dup":{a}}}',
    }[where]
    data = b"abcd" if where == "top" and not same_range else b"ab"
    path = tmp / "x.safetensors"
    path.write_bytes(_file(header.encode(), data))
    with pytest.raises(ConvertError, match=r"duplicate name '(dup|k|dtype)'.*x\.safetensors"):
        convert(path, tmp / "out.pt")
    assert not (tmp / "out.pt").exists()


@pytest.mark.spec("TOOL-34")
def test_an_index_larger_than_the_bound_is_refused_unread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    safetensors_torch.save_file({"w": torch.ones(2)}, tmp_path / "m-00001-of-00001.safetensors")
    index = tmp_path / f"m{INDEX_SUFFIX}"
    doc = {"metadata": {"pad": "x" * 5000}, "weight_map": {"w": "m-00001-of-00001.safetensors"}}
    index.write_text(json.dumps(doc))
    monkeypatch.setattr(convert_module, "MAX_INDEX_BYTES", 4096)
    reads: list[int] = []
    real_pread = convert_module.pread_exact

    def pread(fd: int, n: int, offset: int) -> bytes:
        reads.append(n)
        return real_pread(fd, n, offset)

    monkeypatch.setattr(convert_module, "pread_exact", pread)
    with pytest.raises(ConvertError, match=rf"{index.name}.*4096"):
        convert(index, tmp_path / "out")
    assert all(n <= 4097 for n in reads)
    monkeypatch.setattr(convert_module, "MAX_INDEX_BYTES", 1 << 20)
    convert(index, tmp_path / "out")
    assert (tmp_path / "out" / ".metadata").is_file()


@pytest.mark.spec("STORE-63", "TOOL-21")
@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_a_conversion_failing_mid_write_leaves_no_file_and_no_writer_behind(
    tmp_path: Path, suffix: str
) -> None:
    """The destination is written through the descriptor that created it: a tensor that
    fails its checksum mid-write leaves no file, and the writer is finished while that
    file is still open (torch's zip writer would otherwise write to a closed file when
    collected, which aborts the interpreter)."""
    import gc

    from refdcp.storage.errors import CorruptionError

    state = _state(3, 11)
    refdcp.save(state, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    (data,) = (p for p in (tmp_path / "dcp").iterdir() if p.suffix == ".distcp")
    raw = bytearray(data.read_bytes())
    raw[-8] ^= 0xFF  # inside the last tensor's bytes
    data.write_bytes(bytes(raw))
    with pytest.raises(CorruptionError, match="checksum"):
        convert(tmp_path / "dcp", tmp_path / f"out{suffix}")
    gc.collect()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dcp"]


@pytest.mark.spec("STORE-63", "STORE-29")
@settings(max_examples=20, deadline=None, suppress_health_check=FIXTURES)
@given(
    own=st.integers(0, 2),
    foreign=st.sampled_from([None, "outside", "inside"]),
)
def test_a_stale_lock_keeps_only_refdcps_own_private_names_out_of_the_way(
    tmp_path_factory: pytest.TempPathFactory, own: int, foreign: str | None
) -> None:
    """A save killed between the lock's link and unlink leaves the lock with its private
    ``.metadata.lock.<12 hex>.new`` name: those names are removed and the lock taken over;
    any other name of the file (outside the checkpoint, or another name in it) refuses it."""
    from refdcp.storage.fs.lock import acquire_save_lock

    tmp = tmp_path_factory.mktemp("lock")
    ckpt = tmp / "ckpt"
    ckpt.mkdir()
    lock = ckpt / ".metadata.lock"
    lock.write_bytes(b'{"pid": 999999999, "token": "dead"}\n')
    privates = [ckpt / f".metadata.lock.{uuid.uuid4().hex[:12]}.new" for _ in range(own)]
    for p in privates:
        os.link(lock, p)
    other = {"outside": tmp / "outside", "inside": ckpt / "notes.txt"}.get(foreign or "")
    if other is not None:
        os.link(lock, other)
    if other is None:
        held = acquire_save_lock(ckpt, ".metadata", "tok")
        assert os.stat(lock).st_nlink == 1 and not any(p.exists() for p in privates)
        held.release()
        return
    before = other.read_bytes()
    with pytest.raises(UnsafePathError, match="links"):
        acquire_save_lock(ckpt, ".metadata", "tok")
    assert other.read_bytes() == before and lock.exists()
