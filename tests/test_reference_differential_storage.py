"""The reference writer, reader and stored format against refdcp's (REF-4, REF-2): the same
storage records (which fields, checksums that match the bytes, raw data where the record says,
1 MiB tensors 64-byte aligned, objects before tensors), the same files synced whole and the
directory after the commit, no descriptor left open, the same files left by a failed write, the
same refusals (class and the key, file and offset they name) for damaged data and `.metadata`
across every `verify` setting, and the same calls into the load planner.

Each case runs once per path and compares; the reference-only checks of the same behaviour are
in test_mut_reference_{format,storage,errors}.py.
"""

from __future__ import annotations

import gc
import io
import os
import stat
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import crc32c
import pytest
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
)

import refdcp
import refdcp.reference
from refdcp.comm import SingleRank
from refdcp.planning import DefaultLoadPlanner, DefaultSavePlanner
from refdcp.reference import ReferenceReader, ReferenceWriter
from refdcp.reference import format as fmt
from refdcp.reference.load_planner import ReferenceLoadPlanner
from refdcp.reference.save_planner import ReferenceSavePlanner
from refdcp.storage.format.items import encode_tensor, make_storage_info

from .test_mut_reference_io_differential import _metadata_cases

PATHS: dict[str, Any] = {"fast": refdcp, "reference": refdcp.reference}
WRITERS: dict[str, Any] = {"fast": refdcp.FileSystemWriter, "reference": ReferenceWriter}
READERS: dict[str, Any] = {"fast": refdcp.FileSystemReader, "reference": ReferenceReader}
SAVE_PLANNERS: dict[str, Any] = {"fast": DefaultSavePlanner, "reference": ReferenceSavePlanner}
LOAD_PLANNERS: dict[str, Any] = {"fast": DefaultLoadPlanner, "reference": ReferenceLoadPlanner}

BIG = (1 << 18) + 5  # float32 elements: a tensor item of over 1 MiB (STORE-50)


def _quantized() -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.quantize_per_tensor(torch.arange(4.0), 0.5, 0, torch.quint8)


def _sd() -> dict[str, Any]:
    """An odd-sized object first, so nothing but padding puts the tensor after it on 64 bytes."""
    return {
        "o": "x" * 7,
        "big": torch.arange(BIG, dtype=torch.float32),
        "s": torch.arange(3, dtype=torch.int16),
        "q": _quantized(),
        "n": [1, 2],
    }


def _fds() -> int:
    """Open descriptors, after a collection: a dropped writer in a reference cycle closes its
    directory's descriptor when collected, which must not land inside a measured span."""
    gc.collect()
    return len(os.listdir("/proc/self/fd"))


def _layout(where: Path, sd: dict[str, Any]) -> dict[str, Any]:
    """What a checkpoint's records say, in terms both paths must agree on."""
    md = ReferenceReader(where).read_metadata()
    records = sorted(md.storage_data.items(), key=lambda kv: (kv[1].relative_path, kv[1].offset))
    kinds = [
        "object" if isinstance(md.state_dict_metadata[i.fqn], BytesStorageMetadata) else "tensor"
        for i, _ in records
    ]
    items: dict[str, Any] = {}
    for index, info in records:
        blob = (where / info.relative_path).read_bytes()[info.offset : info.offset + info.length]
        value = sd[index.fqn]
        data_at = getattr(info, "refdcp_data_offset", None)
        raw_ok = None
        if data_at is not None:
            raw = value.reshape(-1).view(torch.uint8).numpy().tobytes()
            raw_ok = blob[data_at : data_at + len(raw)] == raw
        aligned = None
        if index.fqn == "big" and data_at is not None:
            aligned = (info.offset % 64, (info.offset + data_at) % 64)
        items[index.fqn] = (
            sorted(vars(info)),
            len(blob) == info.length and crc32c.crc32c(blob) == info.refdcp_crc32c,
            raw_ok,
            aligned,
        )
    sm = md.storage_meta
    meta = None
    if sm is not None:
        names = [p.name for p in where.glob("*.distcp")]
        meta = (str(sm.checkpoint_id) == str(where), all(f".{sm.save_id}." in n for n in names))
    return {"order": kinds, "items": items, "storage_meta": meta}


@pytest.mark.spec("REF-4", "REF-2", "FMT-2", "FMT-3", "STORE-50", "INTEG-1", "STORE-2")
def test_both_writers_record_the_same_layout(tmp_path: Path) -> None:
    """Into a directory not there yet (both make its parents), records with the same fields,
    checksums matching the bytes, raw data where the data offset says, the 1 MiB tensor's item
    and raw data on 64-byte boundaries after an odd-sized object, objects before tensors."""
    sd = _sd()
    got = {}
    for impl, api in PATHS.items():
        where = tmp_path / impl / "x" / "y"
        api.save(sd, checkpoint_id=where, comm=SingleRank())
        got[impl] = _layout(where, sd)
    assert got["fast"] == got["reference"]
    ref = got["reference"]
    assert ref["order"] == ["object", "object", "tensor", "tensor", "tensor"]
    assert ref["items"]["big"][2:] == (True, (0, 0))
    assert ref["items"]["q"][2] is None and ref["items"]["o"][2] is None  # no data offset
    assert all(v[1] for v in ref["items"].values()) and ref["storage_meta"] == (True, True)


_TENSORS: dict[str, Callable[[], torch.Tensor]] = {
    "dense": lambda: torch.arange(6.0).reshape(2, 3),
    "empty": lambda: torch.zeros(0, 3),
    "view": lambda: torch.arange(12.0).reshape(3, 4)[:, 1::2],
    "conj": lambda: torch.tensor([1 + 2j, 3 - 1j]).conj(),
    "neg": lambda: torch.tensor([1 + 2j]).conj().imag,
    "quantized": _quantized,
    "sparse": lambda: torch.eye(3).to_sparse(),
}


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.layout != b.layout or a.is_quantized != b.is_quantized or a.dtype != b.dtype:
        return False
    if a.is_sparse:
        return torch.equal(a.to_dense(), b.to_dense())
    if a.is_quantized:
        return torch.equal(a.int_repr(), b.int_repr()) and a.q_scale() == b.q_scale()
    return torch.equal(a, b)


@pytest.mark.spec("REF-4", "FMT-3", "FMT-4", "SAVE-10", "INTEG-1")
@pytest.mark.parametrize("kind", sorted(_TENSORS))
def test_both_encoders_store_a_tensor_alike(kind: str) -> None:
    """The reference's item bytes and refdcp's decode to the same tensor, record a data offset
    for the same tensors (dense ones), with the same raw bytes there, and the same record
    fields; the fast writer refuses a sparse tensor earlier (its planner), not its encoder."""
    t = _TENSORS[kind]()
    blob, data_at = fmt.encode_item(t)
    enc = encode_tensor(t)
    fast_blob = b"".join(bytes(p) for p in enc.parts)
    fast_crc = crc32c.crc32c(fast_blob)
    assert (data_at is None) == (enc.data_offset is None) == (kind in ("quantized", "sparse"))
    ref_t = fmt.decode_tensor(blob)
    assert _same(ref_t, torch.load(io.BytesIO(fast_blob), weights_only=True))
    if data_at is not None and enc.data_offset is not None:
        n = ref_t.numel() * ref_t.element_size()
        assert blob[data_at : data_at + n] == fast_blob[enc.data_offset : enc.data_offset + n]
    ref_info = fmt.storage_info("f", 64, blob, data_at)
    enc.crc = fast_crc
    fast_info = make_storage_info("f", 64, enc)
    assert sorted(vars(ref_info)) == sorted(vars(fast_info))
    assert ref_info.refdcp_crc32c == crc32c.crc32c(blob)  # type: ignore[attr-defined]


def _sync_log(
    impl: str, where: Path, sync: bool, monkeypatch: pytest.MonkeyPatch
) -> tuple[Any, ...]:
    """(files synced, and whether whole; the directory synced after the metadata; fds left)."""
    log: list[tuple[int, int, bool]] = []
    real = os.fsync

    def spy(fd: int) -> None:
        st = os.fstat(fd)
        log.append((st.st_ino, st.st_size, stat.S_ISDIR(st.st_mode)))
        real(fd)

    before = _fds()
    with monkeypatch.context() as m:
        m.setattr(os, "fsync", spy)
        PATHS[impl].save(
            {"o": "x" * 7, "w": torch.arange(100.0)},
            storage_writer=WRITERS[impl](where, sync_files=sync),
            comm=SingleRank(),
        )
    left = _fds() - before
    final = {p.stat().st_ino: p for p in where.iterdir()}
    files = set()
    meta_at = -1
    for n, (ino, size, is_dir) in enumerate(log):
        if not is_dir and ino in final:
            p = final[ino]
            files.add(
                (p.suffix if p.name != ".metadata" else ".metadata", size == p.stat().st_size)
            )
            if p.name == ".metadata":
                meta_at = n
    dir_ino = where.stat().st_ino
    dir_after = (
        any(ino == dir_ino for ino, _, d in log[meta_at + 1 :] if d) if meta_at >= 0 else None
    )
    return sorted(files), dir_after, left


@pytest.mark.spec("REF-4", "STORE-1", "STORE-4")
@pytest.mark.parametrize("sync", [True, False])
def test_both_writers_sync_the_same_files_whole_and_close_them(
    sync: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for impl in PATHS:  # a first save may open what the process keeps (a pool, a lock table)
        _sync_log(impl, tmp_path / f"{impl}-first", sync, monkeypatch)
    got = {impl: _sync_log(impl, tmp_path / impl, sync, monkeypatch) for impl in PATHS}
    assert got["fast"] == got["reference"]
    want = ([(".distcp", True), (".metadata", True)], True, 0) if sync else ([], None, 0)
    assert got["reference"] == want


class _RefFailing(ReferenceSavePlanner):
    def resolve_data(self, write_item: Any) -> Any:
        if write_item.index.fqn == "b":
            raise RuntimeError("no data for b")
        return super().resolve_data(write_item)


class _FastFailing(DefaultSavePlanner):
    def resolve_data(self, write_item: Any) -> Any:
        if write_item.index.fqn == "b":
            raise RuntimeError("no data for b")
        return super().resolve_data(write_item)


@pytest.mark.spec("REF-4", "STORE-31", "REF-8")
@pytest.mark.parametrize("how", ["resolve fails", "file already gone"])
def test_a_failed_write_removes_its_files_on_both_writers(how: str, tmp_path: Path) -> None:
    """The writer's own calls, without the driver's abort after them: a failing `write_data`
    removes the rank's file at once; `abort_save` after someone else removed it is quiet."""
    planners = {"fast": _FastFailing, "reference": _RefFailing}
    got = {}
    for impl in PATHS:
        where = tmp_path / impl
        w = WRITERS[impl](where)
        w.set_up_storage_writer(True, rank=0)
        planner = planners[impl](check_replicas=False)
        sd = {"a": torch.ones(2), "b": torch.ones(2)} if how == "resolve fails" else {"a": 1}
        planner.set_up_planner(sd, None, True)
        plan = w.prepare_global_plan([w.prepare_local_plan(planner.create_local_plan())])[0]
        try:
            w.write_data(plan, planner).wait()
            for data in where.glob("*.distcp"):
                data.unlink()
            w.abort_save()
            outcome = "ok"
        except Exception as exc:  # the class and message are what is compared
            outcome = f"{type(exc).__name__}: {exc}"
        got[impl] = (outcome, sorted(p.suffix for p in where.iterdir()))
    assert got["fast"] == got["reference"]
    assert got["fast"] == ("RuntimeError: no data for b" if how == "resolve fails" else "ok", [])


def _error(run: Callable[[], Any]) -> Any:
    """ "ok", or the error's class with the key, file name and offset it names (per rank)."""
    try:
        run()
    except refdcp.CheckpointError as exc:
        return [_named(f.exception) for f in exc.rank_failures.values()]
    except Exception as exc:  # the class and its fields are what is compared
        return _named(exc)
    return "ok"


def _named(exc: BaseException) -> tuple[Any, ...]:
    file = getattr(exc, "file", None)
    return (
        type(exc).__name__,
        getattr(exc, "fqn", None),
        None if file is None else Path(file).suffix or Path(file).name,
        getattr(exc, "offset", None),
        getattr(exc, "field", None),
    )


def _write_metadata(where: Path, md: Metadata) -> None:
    (where / ".metadata").write_bytes(fmt.dump_metadata(md))


def _damage(where: Path, how: str) -> dict[str, int]:
    """Damage the checkpoint; where each key's record starts in its file."""
    md = ReferenceReader(where).read_metadata()
    starts = {k.fqn: v.offset for k, v in md.storage_data.items()}
    info = next(v for k, v in md.storage_data.items() if k.fqn == "w")
    data = where / info.relative_path
    raw = bytearray(data.read_bytes())
    if how == "missing":
        data.unlink()
    elif how == "truncated":
        data.write_bytes(bytes(raw[: info.offset + info.length - 1]))
    elif how == "flipped":  # a byte of the raw data
        raw[info.offset + info.refdcp_data_offset + 5] ^= 1
        data.write_bytes(bytes(raw))
    elif how == "no checksums":
        for rec in md.storage_data.values():
            del rec.refdcp_crc32c
        _write_metadata(where, md)
    elif how == "fifo":
        data.unlink()
        os.mkfifo(data)
    return starts


DAMAGE = ["intact", "missing", "truncated", "flipped", "no checksums", "fifo"]


@pytest.mark.spec("REF-4", "LOAD-10", "INTEG-3", "INTEG-5", "STORE-13", "STORE-27")
@pytest.mark.parametrize("verify", [None, True, False])
@pytest.mark.parametrize("how", DAMAGE)
def test_both_readers_treat_damage_alike_under_every_verify(
    how: str, verify: bool | None, tmp_path: Path
) -> None:
    """The same outcome, naming the same key (of the file, for a missing one), file and offset
    (from the item's start: the two layouts differ; not for a truncated item, whose offset the
    two readers place differently); the same values when it loads; no descriptor left open."""
    got = {}
    for impl, api in PATHS.items():
        where = tmp_path / impl
        api.save({"w": torch.arange(64.0), "o": "obj"}, checkpoint_id=where, comm=SingleRank())
        starts = _damage(where, how)
        out = {"w": torch.zeros(64), "o": ""}
        before = _fds()
        outcome = _error(
            lambda api=api, where=where, out=out: api.load(
                out, checkpoint_id=where, comm=SingleRank(), verify=verify
            )
        )
        if how == "truncated" and isinstance(outcome, list):
            outcome = [o[:3] for o in outcome]
        elif how == "missing" and isinstance(outcome, list):  # either key of the file it held
            outcome = [(o[0], o[1] in ("w", "o"), *o[2:]) for o in outcome]
        elif isinstance(outcome, list):  # the offset from the start of the named key's item
            outcome = [(*o[:3], o[3] and o[3] - starts.get(o[1], 0), o[4]) for o in outcome]
        got[impl] = (outcome, out["w"].tolist() if outcome == "ok" else None, _fds() - before)
    assert got["fast"] == got["reference"]
    assert got["fast"][2] == 0
    refused = {
        "missing": True,
        "truncated": True,
        "flipped": verify is not False,
        "no checksums": verify is True,
        "fifo": True,
    }.get(how, False)
    assert (got["fast"][0] != "ok") == refused


@pytest.mark.spec("REF-4", "FMT-6", "FMT-7", "FMT-9", "INTEG-2", "STORE-26")
@pytest.mark.parametrize("case", sorted(_metadata_cases()))
def test_both_readers_name_the_same_fields_of_a_damaged_metadata_file(
    case: str, tmp_path: Path
) -> None:
    (tmp_path / ".metadata").write_bytes(_metadata_cases()[case])
    ref = _error(lambda: ReferenceReader(tmp_path).read_metadata())
    assert ref == _error(lambda: READERS["fast"](tmp_path).read_metadata())


def _records_case(where: Path, how: str) -> None:
    """A checkpoint of "w" and "v" whose `.metadata` is then made inconsistent."""
    md = ReferenceReader(where).read_metadata()
    w_index = next(k for k in md.storage_data if k.fqn == "w")
    v_index = next(k for k in md.storage_data if k.fqn == "v")
    w_md = md.state_dict_metadata["w"]
    if how == "same bytes":  # v's record is w's (equal values, so every checksum matches)
        md.storage_data[v_index] = md.storage_data[w_index]
    elif how == "no record after an empty chunk":
        empty = ChunkStorageMetadata(torch.Size([0]), torch.Size([0]))
        w_md.chunks.insert(0, empty)  # type: ignore[union-attr]
        del md.storage_data[w_index]
    elif how == "overlapping chunks":
        chunk = ChunkStorageMetadata(torch.Size([2]), torch.Size([2]))
        w_md.chunks.append(chunk)  # type: ignore[union-attr]
        rec = md.storage_data[w_index]  # its record: bytes past the file's end, shared by none
        end = (where / rec.relative_path).stat().st_size
        md.storage_data[MetadataIndex("w", torch.Size([2]))] = _StorageInfo(
            rec.relative_path, end, 8
        )
    _write_metadata(where, md)


@pytest.mark.spec("REF-4", "REF-9", "FMT-28", "FMT-29")
@pytest.mark.parametrize(
    "how", ["intact", "same bytes", "no record after an empty chunk", "overlapping chunks"]
)
def test_both_paths_refuse_inconsistent_records_and_chunks_alike(how: str, tmp_path: Path) -> None:
    got = {}
    for impl, api in PATHS.items():
        where = tmp_path / impl
        api.save({"w": torch.ones(4), "v": torch.ones(4)}, checkpoint_id=where, comm=SingleRank())
        _records_case(where, how)
        out = {"w": torch.zeros(4), "v": torch.zeros(4)}
        outcome = _error(
            lambda api=api, where=where, out=out: api.load(
                out, checkpoint_id=where, comm=SingleRank()
            )
        )
        if isinstance(outcome, list):  # which field names the key differs: that one is named
            outcome = [(*o[:4], o[4] and "'w'" in o[4]) for o in outcome]
        got[impl] = (outcome, out["w"].tolist(), out["v"].tolist())
    assert got["fast"] == got["reference"]
    if how == "intact":
        assert got["fast"] == ("ok", [1.0] * 4, [1.0] * 4)
    else:  # refused before any destination is written
        assert got["fast"][0][0][0] == "MalformedMetadataError" and got["fast"][1] == [0.0] * 4


class _Gadget:
    def __reduce__(self) -> tuple[Any, ...]:
        return (print, ("a stored tensor item ran code",))


@pytest.mark.spec("REF-4", "FMT-3", "FMT-8")
def test_both_readers_unpickle_a_stored_tensor_weights_only(tmp_path: Path) -> None:
    """A tensor item replaced by an archive of a foreign object (its checksum recomputed and no
    data offset, as torch writes): both readers refuse it unrun."""
    buf = io.BytesIO()
    torch.save({"x": _Gadget()}, buf)
    blob = buf.getvalue()
    got = {}
    for impl, api in PATHS.items():
        where = tmp_path / impl
        api.save({"w": torch.arange(4.0)}, checkpoint_id=where, comm=SingleRank())
        md = ReferenceReader(where).read_metadata()
        ((_, info),) = md.storage_data.items()
        data = where / info.relative_path
        data.write_bytes(data.read_bytes()[: info.offset] + blob)
        info.length = len(blob)
        info.refdcp_crc32c = crc32c.crc32c(blob)
        if hasattr(info, "refdcp_data_offset"):
            del info.refdcp_data_offset
        _write_metadata(where, md)
        got[impl] = _error(
            lambda api=api, where=where: api.load(
                {"w": torch.zeros(4)}, checkpoint_id=where, comm=SingleRank()
            )
        )
    assert got["fast"] == got["reference"]
    assert got["fast"][0][0] == "UnpicklingError"


def _load_planner(impl: str, *, size: int | None) -> Any:
    """A load planner that records what the reader hands back, and may hand out a destination
    of the wrong size."""

    class Recording(LOAD_PLANNERS[impl]):  # type: ignore[misc, valid-type]
        committed: list[tuple[str, list[float]]]

        def resolve_tensor(self, read_item: Any) -> torch.Tensor:
            if size is not None:  # (2, 3): a read of 3 elements would broadcast into it
                return torch.zeros(size, 3)
            t: torch.Tensor = super().resolve_tensor(read_item)
            return t

        def commit_tensor(self, read_item: Any, tensor: torch.Tensor) -> None:
            self.committed.append((read_item.dest_index.fqn, tensor.tolist()))
            super().commit_tensor(read_item, tensor)

    planner = Recording()
    planner.committed = []
    return planner


@pytest.mark.spec("REF-4", "STORE-12")
@pytest.mark.parametrize("size", [None, 2])
def test_both_readers_hand_the_planner_the_same_tensors(size: int | None, tmp_path: Path) -> None:
    """`read_data` alone: each filled tensor handed to `commit_tensor`, and a destination of
    another shape refused (one the read would broadcast into), by both readers."""
    got = {}
    for impl, api in PATHS.items():
        where = tmp_path / impl
        api.save({"w": torch.arange(3.0), "o": "x"}, checkpoint_id=where, comm=SingleRank())
        reader = READERS[impl](where)
        md = reader.read_metadata()
        planner = _load_planner(impl, size=size)
        planner.set_up_planner({"w": torch.zeros(3), "o": ""}, md, True)
        plan = planner.create_local_plan()
        reader.set_up_storage_reader(md, True)
        outcome = _error(
            lambda reader=reader, plan=plan, planner=planner: reader.read_data(plan, planner).wait()
        )
        got[impl] = (outcome == "ok", planner.committed)  # the classes differ: refdcp's own
    assert got["fast"] == got["reference"]
    want = (True, [("w", [0.0, 1.0, 2.0])]) if size is None else (False, [])
    assert got["fast"] == want
