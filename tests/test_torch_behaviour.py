"""Recorded torch runs behind the spec's claims about torch 2.13 (HARN-30).

A sentence of ``spec/`` that says what torch does points here (or at another
test that runs torch) with a ``(checked: tests/...::test_...)`` marker; these
tests run torch's own DCP (``dcp.load`` over a spawned Gloo group, or a single
process with ``no_dist=True``) and assert what the claim says.
"""

from __future__ import annotations

import io
import itertools
import pickle
import zipfile
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import (
    DefaultSavePlanner,
    FileSystemReader,
    FileSystemWriter,
)
from torch.distributed.checkpoint import filesystem as torch_filesystem
from torch.distributed.checkpoint._checkpointer import _Checkpointer
from torch.distributed.checkpoint._nested_dict import flatten_state_dict as torch_flatten
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import _StoragePrefix
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import (
    SavePlan,
    TensorWriteData,
    WriteItemType,
)
from torch.distributed.checkpoint.staging import BlockingAsyncStager, StateDictStager
from torch.distributed.checkpoint.state_dict import (
    get_optimizer_state_dict as torch_get_optimizer_state_dict,
)
from torch.distributed.checkpoint.state_dict import (
    set_optimizer_state_dict as torch_set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

from refdcp.testing.spawn import run_gloo


class _Counter(Stateful):
    """A ``Stateful`` that records every ``load_state_dict`` call."""

    def __init__(self) -> None:
        self.loaded: list[float] = []

    def state_dict(self) -> dict[str, Any]:
        return {"v": torch.zeros(2)}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.loaded.append(float(sd["v"][0]))


class _FailingReader(FileSystemReader):  # type: ignore[misc]
    """torch's reader, whose ``read_data`` raises on rank 1."""

    def read_data(self, plan: Any, planner: Any) -> Any:
        if dist.get_rank() == 1:
            raise OSError("injected read failure on rank 1")
        return super().read_data(plan, planner)


def _torch_load_with_a_failed_read_on_rank_1(rank: int, world: int, path: str) -> dict[str, Any]:
    sd: dict[str, Any] = {"app": _Counter(), "step": 0, "w": torch.zeros(4)}
    source = {"app": {"v": torch.full((2,), 7.0)}, "step": 5, "w": torch.arange(4.0)}
    dcp.save(source, storage_writer=FileSystemWriter(path))
    control: dict[str, Any] = {"app": _Counter(), "step": 0, "w": torch.zeros(4)}
    dcp.load(control, storage_reader=FileSystemReader(path))  # the same load, applied
    try:
        dcp.load(sd, storage_reader=_FailingReader(path))
        raised = ""
    except CheckpointException as e:  # a BaseException in torch 2.13
        raised = f"{type(e).__name__} {sorted(e.failures)}"
    return {
        "control": (control["app"].loaded, control["step"]),
        "raised": raised,
        "applied": sd["app"].loaded,
        "step": sd["step"],
    }


def _two_ranks(rank: int, world: int, path: str) -> dict[str, Any]:
    """Every Gloo run of this module in one spawn (a spawn costs seconds)."""
    return {
        "load": _torch_load_with_a_failed_read_on_rank_1(rank, world, f"{path}/load"),
        "interrupt": _torch_save_interrupted_on_rank_1(rank, world, f"{path}/interrupt"),
    }


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    path = tmp_path_factory.mktemp("gloo")
    got: list[dict[str, Any]] = run_gloo(2, _two_ranks, str(path), timeout=120.0)
    return got


@pytest.mark.dist
@pytest.mark.spec("LOAD-5")
def test_torch_applies_nothing_when_a_read_fails_on_any_rank(
    two_ranks: list[dict[str, Any]],
) -> None:
    """torch 2.13: the read all-gather raises on every rank before any apply."""
    for r in (run["load"] for run in two_ranks):
        assert r["control"] == ([7.0], 5), two_ranks  # without the failure torch applies
        assert r["raised"] == "CheckpointException [1]" and r["applied"] == [] and r["step"] == 0


# --- single-process runs of torch's own DCP (no_dist) ----------------------------------------


def _torch_save(sd: dict[str, Any], path: Path, **writer: Any) -> None:
    dcp.save(sd, storage_writer=FileSystemWriter(str(path), **writer), no_dist=True)


def _rewrite_metadata(path: Path, change: Any) -> None:
    md = FileSystemReader(str(path)).read_metadata()
    change(md)
    (path / ".metadata").write_bytes(pickle.dumps(md))


@pytest.mark.spec("FLAT-2")
def test_torch_drops_empty_dicts() -> None:
    flat, mapping = torch_flatten({"empty": {}, "w": {"t": torch.ones(1)}})
    assert list(flat) == ["w.t"] and "empty" not in str(mapping)


@pytest.mark.spec("INTEG-1")
def test_torch_stores_no_checksums(tmp_path: Path) -> None:
    _torch_save({"w": torch.arange(8.0), "o": {"n": 3}}, tmp_path)
    md = FileSystemReader(str(tmp_path)).read_metadata()
    assert md.storage_data
    for info in md.storage_data.values():
        assert not [k for k in vars(info) if "crc" in k.lower() or "checksum" in k.lower()]
    assert not (tmp_path / ".metadata").read_bytes().endswith(b"\n")  # no trailer either


@pytest.mark.spec("FMT-7")
def test_torch_never_checks_the_version(tmp_path: Path) -> None:
    _torch_save({"w": torch.arange(4.0)}, tmp_path)
    _rewrite_metadata(tmp_path, lambda md: setattr(md, "version", "99.0.0"))
    out = {"w": torch.zeros(4)}
    dcp.load(out, storage_reader=FileSystemReader(str(tmp_path)), no_dist=True)
    assert torch.equal(out["w"], torch.arange(4.0))


_CALLED: list[str] = []


def _record_call() -> dict[str, int]:
    """Unpickled by reference: proof that the reader ran a function the file named."""
    _CALLED.append("ran")
    return {}


class _RunsCode:
    def __reduce__(self) -> tuple[Any, tuple[()]]:
        return (_record_call, ())


@pytest.mark.spec("FMT-6", "TOOL-7")
def test_torch_unpickles_metadata_without_restriction(tmp_path: Path) -> None:
    _torch_save({"w": torch.arange(4.0)}, tmp_path)
    _rewrite_metadata(tmp_path, lambda md: setattr(md, "planner_data", _RunsCode()))
    _CALLED.clear()
    FileSystemReader(str(tmp_path)).read_metadata()
    assert _CALLED == ["ran"]


@pytest.mark.spec("STORE-26")
def test_torch_opens_a_data_file_outside_the_directory(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    _torch_save({"w": torch.arange(4.0)}, ckpt)
    [data] = list(ckpt.glob("*.distcp"))
    data.rename(tmp_path / "outside.distcp")

    def point_outside(md: Any) -> None:
        for info in md.storage_data.values():
            info.relative_path = "../outside.distcp"

    _rewrite_metadata(ckpt, point_outside)
    out = {"w": torch.zeros(4)}
    dcp.load(out, storage_reader=FileSystemReader(str(ckpt)), no_dist=True)
    assert torch.equal(out["w"], torch.arange(4.0))


@pytest.mark.spec("STORE-5")
def test_torch_leaves_stale_data_files_behind(tmp_path: Path) -> None:
    sd = {"a": torch.ones(4), "b": torch.ones(4)}
    _torch_save(sd, tmp_path, thread_count=2)
    _torch_save(sd, tmp_path, thread_count=1)
    md = FileSystemReader(str(tmp_path)).read_metadata()
    named = {info.relative_path for info in md.storage_data.values()}
    stale = {p.name for p in tmp_path.glob("*.distcp")} - named
    assert stale, named


@pytest.mark.spec("STORE-50")
def test_torch_packs_items_back_to_back(tmp_path: Path) -> None:
    _torch_save({f"t{i}": torch.ones(3 + i * 1000) for i in range(3)} | {"o": 7}, tmp_path)
    md = FileSystemReader(str(tmp_path)).read_metadata()
    spans = sorted((i.offset, i.length) for i in md.storage_data.values())
    assert all(a + n == b for (a, n), (b, _) in itertools.pairwise(spans)), spans
    assert any(off % 64 for off, _ in spans)  # no alignment padding


@pytest.mark.spec("DEDUP-6", "DEDUP-13")
def test_torch_keeps_one_ranks_value_of_a_differing_replica_without_a_word() -> None:
    """torch's default planner keeps a replicated key on the rank whose plan holds the fewest
    bytes so far, not the lowest rank, and never compares the values."""
    states = [{"big": torch.zeros(100), "shared": torch.zeros(4)}, {"shared": torch.ones(4)}]
    plans = []
    for rank, sd in enumerate(states):
        planner = DefaultSavePlanner()
        planner.set_up_planner(sd, is_coordinator=rank == 0)
        plans.append(planner.create_local_plan())
    coordinator = DefaultSavePlanner()
    coordinator.set_up_planner(states[0], is_coordinator=True)
    global_plans, _ = coordinator.create_global_plan(plans)  # no error though values differ
    keepers = [
        r for r, p in enumerate(global_plans) if any(i.index.fqn == "shared" for i in p.items)
    ]
    assert keepers == [1]
    lowest = DefaultSavePlanner(dedup_save_to_lowest_rank=True)
    lowest.set_up_planner(states[0], is_coordinator=True)
    global_plans, _ = lowest.create_global_plan(plans)
    keepers = [
        r for r, p in enumerate(global_plans) if any(i.index.fqn == "shared" for i in p.items)
    ]
    assert keepers == [0]


def _torch_load(sd: dict[str, Any], path: Path) -> None:
    dcp.load(sd, storage_reader=FileSystemReader(str(path)), no_dist=True)


class _UserValue:
    """A user class: torch's weights-only unpickler would refuse it."""

    def __init__(self) -> None:
        self.v = 1


@pytest.mark.spec("FLAT-3")
def test_torch_writes_a_loaded_object_under_the_stringified_key(tmp_path: Path) -> None:
    _torch_save({"m": {1: "x", "t": torch.ones(1)}}, tmp_path)
    out: dict[str, Any] = {"m": {1: None, "t": torch.zeros(1)}}
    _torch_load(out, tmp_path)
    assert out["m"][1] is None and out["m"]["1"] == "x"


@pytest.mark.spec("FLAT-4")
def test_torch_pickles_a_tuple_holding_a_tensor_as_one_object(tmp_path: Path) -> None:
    _torch_save({"tup": (torch.ones(2), 3)}, tmp_path)
    md = FileSystemReader(str(tmp_path)).read_metadata()
    assert {k: type(v).__name__ for k, v in md.state_dict_metadata.items()} == {
        "tup": "BytesStorageMetadata"
    }


@pytest.mark.spec("PLAN-7", "LOAD-7")
def test_torch_unpickles_objects_without_weights_only(tmp_path: Path) -> None:
    _torch_save({"u": _UserValue()}, tmp_path)
    out: dict[str, Any] = {"u": None}
    _torch_load(out, tmp_path)
    assert isinstance(out["u"], _UserValue)


@pytest.mark.spec("POLICY-5")
def test_torch_casts_a_dtype_mismatch_silently(tmp_path: Path) -> None:
    _torch_save({"x": torch.arange(3, dtype=torch.float64)}, tmp_path)
    out = {"x": torch.zeros(3, dtype=torch.float32)}
    _torch_load(out, tmp_path)
    assert out["x"].dtype == torch.float32 and out["x"].tolist() == [0.0, 1.0, 2.0]


@pytest.mark.spec("POLICY-6")
def test_torch_replaces_a_tensor_slot_by_an_object(tmp_path: Path) -> None:
    _torch_save({"x": 3}, tmp_path)
    out: dict[str, Any] = {"x": torch.zeros(1)}
    _torch_load(out, tmp_path)
    assert out["x"] == 3


@pytest.mark.spec("POLICY-3")
def test_torch_skips_checkpoint_keys_absent_from_the_state_dict(tmp_path: Path) -> None:
    _torch_save({"x": torch.ones(2), "y": torch.ones(2)}, tmp_path)
    out = {"x": torch.zeros(2)}
    _torch_load(out, tmp_path)
    assert list(out) == ["x"] and out["x"].tolist() == [1.0, 1.0]


@pytest.mark.spec("API-23")
def test_torch_reports_a_missing_key_as_a_runtime_error(tmp_path: Path) -> None:
    _torch_save({"x": torch.ones(2)}, tmp_path)
    with pytest.raises(CheckpointException) as info:
        _torch_load({"x": torch.zeros(2), "z": torch.zeros(1)}, tmp_path)
    cause = info.value.failures[0]
    cause = cause[0] if isinstance(cause, tuple) else cause
    assert type(cause) is RuntimeError and "Missing key in checkpoint state_dict: z." in str(cause)


@pytest.mark.spec("FMT-2")
def test_torch_places_bytes_items_before_tensors(tmp_path: Path) -> None:
    _torch_save({"t": torch.ones(100), "o": {"a": 1}, "b": io.BytesIO(b"x")}, tmp_path)
    md = FileSystemReader(str(tmp_path)).read_metadata()
    order = [k.fqn for k, _ in sorted(md.storage_data.items(), key=lambda kv: kv[1].offset)]
    assert order[-1] == "t" and set(order[:-1]) == {"o.a", "b"}


@pytest.mark.spec("STORE-9")
def test_torch_prefixes_plans_without_storage_data_by_rank() -> None:
    plans = [SavePlan([]), SavePlan([], storage_data=_StoragePrefix("__7_")), SavePlan([])]
    out = FileSystemWriter("/unused").prepare_global_plan(plans)
    assert [p.storage_data.prefix for p in out] == ["__0_", "__7_", "__2_"]


def _torch_global_plans(states: list[dict[str, Any]]) -> list[Any]:
    plans = []
    for rank, sd in enumerate(states):
        planner = DefaultSavePlanner()
        planner.set_up_planner(sd, is_coordinator=rank == 0)
        plans.append(planner.create_local_plan())
    coordinator = DefaultSavePlanner()
    coordinator.set_up_planner(states[0], is_coordinator=True)
    global_plans, _ = coordinator.create_global_plan(plans)
    return [[i.index.fqn for i in p.items] for p in global_plans]


@pytest.mark.spec("DEDUP-7")
def test_torch_spreads_replicated_objects_over_the_ranks() -> None:
    states = [{f"o{i}": i for i in range(4)} for _ in range(2)]
    assert _torch_global_plans(states) == [["o0", "o2"], ["o1", "o3"]]


@pytest.mark.spec("DEDUP-3")
def test_torch_counts_the_global_size_of_a_shard() -> None:
    chunk = ChunkStorageMetadata(offsets=torch.Size([0]), sizes=torch.Size([2]))
    data = TensorWriteData(chunk=chunk, properties=TensorProperties(), size=torch.Size([10]))
    item = dcp.planner.WriteItem(
        index=MetadataIndex("w", torch.Size([0])), type=WriteItemType.SHARD, tensor_data=data
    )
    assert item.tensor_storage_size() == 10 * 4  # the global tensor's bytes, not the chunk's 8


@pytest.mark.spec("SAVE-15")
def test_torch_reports_no_commit_status() -> None:
    err = dcp.api.CheckpointException("write", {})
    assert not hasattr(err, "committed") and not isinstance(err, Exception)


@pytest.mark.spec("STAGE-7")
def test_torch_stager_copies_the_whole_storage_of_a_view() -> None:
    big = torch.arange(1000.0)
    snap = StateDictStager().stage({"v": big[10:12]})
    assert snap["v"].tolist() == [10.0, 11.0] and snap["v"].untyped_storage().nbytes() == 4000


@pytest.mark.spec("STAGE-8")
def test_torch_stager_keeps_views_sharing_storage() -> None:
    base = torch.arange(6.0)
    snap = StateDictStager().stage({"a": base[0:4], "b": base[2:6]})
    snap["a"][2] = 100.0
    assert snap["b"][0].item() == 100.0


@pytest.mark.spec("STAGE-11")
@pytest.mark.skipif(torch.cuda.is_available(), reason="the claim is about a CPU-only build")
def test_torch_cached_blocking_stager_needs_an_accelerator() -> None:
    with pytest.raises(RuntimeError, match="accelerator"):
        BlockingAsyncStager(cache_staged_state_dict=True).stage({"w": torch.ones(2)})


@pytest.mark.spec("COMM-11")
def test_torch_without_dist_passes_objects_by_reference() -> None:
    obj = object()
    wrapper = dcp.utils._DistWrapper(None, False, 0)
    assert wrapper.broadcast_object(obj) is obj
    assert wrapper.all_gather_object(obj)[0] is obj and wrapper.scatter_object([obj]) is obj


@pytest.mark.spec("ASYNC-9")
def test_torch_checkpointer_save_raises_type_error(tmp_path: Path) -> None:
    ck = _Checkpointer(
        storage_writer=FileSystemWriter(str(tmp_path)),
        storage_reader=FileSystemReader(str(tmp_path)),
        no_dist=True,
    )
    with pytest.raises(TypeError, match="coordinator_rank"):
        ck.save({"x": torch.ones(1)})


@pytest.mark.spec("API-2")
def test_torch_replaces_top_level_values_and_applies_statefuls(tmp_path: Path) -> None:
    _torch_save({"step": 5, "app": {"v": torch.full((2,), 7.0)}}, tmp_path)
    app = _Counter()
    out: dict[str, Any] = {"step": 0, "app": app}
    _torch_load(out, tmp_path)
    assert out["step"] == 5 and out["app"] is app and app.loaded == [7.0]


@pytest.mark.spec("API-22")
def test_torch_refuses_a_storage_given_twice_with_an_assertion(tmp_path: Path) -> None:
    _torch_save({"x": torch.ones(1)}, tmp_path)
    reader = FileSystemReader(str(tmp_path))
    with pytest.raises(AssertionError):
        dcp.load({"x": torch.zeros(1)}, reader, storage_reader=reader, no_dist=True)


@pytest.mark.spec("FLAT-3")
def test_torch_stringifies_keys_of_other_types() -> None:
    flat, _ = torch_flatten({("a", 1): {"t": torch.ones(1)}, 2.5: torch.ones(1)})
    assert list(flat) == ["('a', 1).t", "2.5"]


@pytest.mark.spec("META-4", "TRACE-14")
def test_torch_metadata_takes_the_first_ranks_values_in_plan_order() -> None:
    states = [
        {"w": torch.zeros(4), "b": torch.zeros(1)},
        {"w": torch.zeros(4, dtype=torch.float64)},
    ]
    plans = []
    for rank, sd in enumerate(states):
        planner = DefaultSavePlanner()
        planner.set_up_planner(sd, is_coordinator=rank == 0)
        plans.append(planner.create_local_plan())
    coordinator = DefaultSavePlanner()
    coordinator.set_up_planner(states[0], is_coordinator=True)
    _, md = coordinator.create_global_plan(plans)  # no error though the dtypes differ
    assert md.state_dict_metadata["w"].properties.dtype == torch.float32
    assert list(md.state_dict_metadata) == ["w", "b"]  # in the order the plans list them


def _zip_crc_of_data(path: Path) -> int:
    md = FileSystemReader(str(path)).read_metadata()
    [info] = md.storage_data.values()
    blob = (path / info.relative_path).read_bytes()[info.offset : info.offset + info.length]
    with zipfile.ZipFile(io.BytesIO(blob)) as archive:
        [member] = [i for i in archive.infolist() if i.filename.endswith("/data/0")]
        return member.CRC


@pytest.mark.spec("FMT-3")
def test_torch_save_writes_a_zero_zip_crc_only_with_crc32_off(tmp_path: Path) -> None:
    t = torch.arange(100.0)
    _torch_save({"t": t}, tmp_path / "default")
    assert _zip_crc_of_data(tmp_path / "default") == zlib.crc32(t.numpy().tobytes())
    torch.serialization.set_crc32_options(False)
    try:
        _torch_save({"t": t}, tmp_path / "off")
    finally:
        torch.serialization.set_crc32_options(True)
    assert _zip_crc_of_data(tmp_path / "off") == 0


@pytest.mark.spec("SAVE-10")
def test_torch_stores_the_values_of_views(tmp_path: Path) -> None:
    base = torch.arange(8.0)
    z = torch.complex(torch.arange(3.0), torch.ones(3))
    sd = {"slice": base[1:7:2], "conj": z.conj(), "expanded": torch.ones(1).expand(4)}
    _torch_save(sd, tmp_path)
    out = {k: torch.zeros_like(v.resolve_conj()) for k, v in sd.items()}
    _torch_load(out, tmp_path)
    for k, v in sd.items():
        assert torch.equal(out[k], v.resolve_conj()), k


@pytest.mark.spec("STORE-1")
def test_torch_removes_the_old_metadata_before_its_rename(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _torch_save({"x": torch.ones(1)}, tmp_path)
    calls: list[str] = []
    fs = torch_filesystem.FileSystem
    rm_file, rename = fs.rm_file, fs.rename
    monkeypatch.setattr(
        fs, "rm_file", lambda s, p: (calls.append(f"rm {Path(p).name}"), rm_file(s, p))[1]
    )
    monkeypatch.setattr(
        fs, "rename", lambda s, a, b: (calls.append(f"mv {Path(b).name}"), rename(s, a, b))[1]
    )
    _torch_save({"x": torch.ones(1)}, tmp_path)
    assert calls == ["rm .metadata", "mv .metadata"]


@pytest.mark.spec("PLAN-9")
def test_torch_caches_plans_per_planner_class_for_the_whole_process(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in ("save_plan", "final_save_plan", "all_plans", "global_plan", "metadata"):
        monkeypatch.setattr(dcp.planner.SavePlanner, f"_cached_{name}", {})
    sd = {"w": torch.zeros(2)}
    first = DefaultSavePlanner(enable_plan_caching=True)
    first.set_up_planner(sd, is_coordinator=True)
    global_plans, _ = first.create_global_plan([first.create_local_plan()])
    first.finish_plan(global_plans[0])
    second = DefaultSavePlanner(enable_plan_caching=True)  # another instance, same class
    second.set_up_planner(sd, is_coordinator=True)
    assert second.create_local_plan() == dcp.planner.SavePlan([], usable=False)  # served


@pytest.mark.spec("FMT-29")
def test_torch_reads_the_bytes_a_record_names_even_another_items(tmp_path: Path) -> None:
    _torch_save({"a": torch.ones(4), "b": torch.zeros(4)}, tmp_path)

    def b_points_at_a(md: Any) -> None:
        by_fqn = {k.fqn: k for k in md.storage_data}
        md.storage_data[by_fqn["b"]] = md.storage_data[by_fqn["a"]]

    _rewrite_metadata(tmp_path, b_points_at_a)
    out = {"a": torch.zeros(4), "b": torch.full((4,), 5.0)}
    _torch_load(out, tmp_path)
    assert out["b"].tolist() == [1.0] * 4


@pytest.mark.spec("LOAD-11")
def test_torchs_reader_keeps_the_storage_data_after_a_load(tmp_path: Path) -> None:
    _torch_save({"x": torch.ones(2)}, tmp_path)
    reader = FileSystemReader(str(tmp_path))
    dcp.load({"x": torch.zeros(2)}, storage_reader=reader, no_dist=True)
    assert reader.storage_data


@pytest.mark.spec("INTEG-4")
def test_torch_leaves_tensors_read_before_a_failed_item_loaded(tmp_path: Path) -> None:
    _torch_save({"a": torch.ones(4), "b": torch.ones(1000)}, tmp_path)
    md = FileSystemReader(str(tmp_path)).read_metadata()
    last = max(md.storage_data.values(), key=lambda i: i.offset)
    first = min(md.storage_data.values(), key=lambda i: i.offset)
    data = tmp_path / last.relative_path
    data.write_bytes(data.read_bytes()[: last.offset + 10])  # cut the item stored last
    out = {"a": torch.zeros(4), "b": torch.zeros(1000)}
    with pytest.raises(CheckpointException):
        _torch_load(out, tmp_path)
    stored_first = next(k.fqn for k, v in md.storage_data.items() if v is first)
    assert out[stored_first].tolist() == [1.0] * out[stored_first].numel()


class _BigBytes:
    """Pickles as a call of ``bytes(n)``: a few bytes in the file, ``n`` in memory."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __reduce__(self) -> tuple[Any, tuple[int]]:
        return (bytes, (self.n,))


@pytest.mark.spec("FMT-11")
def test_torch_builds_whatever_the_metadata_describes(tmp_path: Path) -> None:
    _torch_save({"w": torch.arange(4.0)}, tmp_path)
    _rewrite_metadata(tmp_path, lambda md: setattr(md, "planner_data", _BigBytes(50 << 20)))
    assert (tmp_path / ".metadata").stat().st_size < 4096
    md = FileSystemReader(str(tmp_path)).read_metadata()
    assert isinstance(md.planner_data, bytes) and len(md.planner_data) == 50 << 20


@pytest.mark.spec("SAVE-12")
def test_torch_saves_what_weights_only_refuses_and_fails_at_write_on_the_unpicklable(
    tmp_path: Path,
) -> None:
    _torch_save({"u": _UserValue()}, tmp_path / "user")
    out: dict[str, Any] = {"u": None}
    _torch_load(out, tmp_path / "user")  # its own load unpickles it (not weights-only)
    assert isinstance(out["u"], _UserValue)
    with pytest.raises(CheckpointException) as info:
        _torch_save({"my_fn_key": lambda: 1}, tmp_path / "fn")
    text = str(info.value)
    assert "Can't pickle" in text and "write_data" in text and "my_fn_key" not in text


@pytest.mark.spec("SD-8")
def test_torch_raises_at_the_first_missing_optimizer_state() -> None:
    def model_and_adam() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
        return model, torch.optim.Adam(model.parameters())

    model, optim = model_and_adam()
    model(torch.ones(1, 2)).sum().backward()
    optim.step()
    osd = torch_get_optimizer_state_dict(model, optim)
    del osd["state"]["0.weight"], osd["state"]["1.bias"]
    fresh, fresh_optim = model_and_adam()
    with pytest.raises(RuntimeError, match=r"0\.weight") as info:
        torch_set_optimizer_state_dict(fresh, fresh_optim, osd)
    assert "1.bias" not in str(info.value)  # one parameter named, not every one


@pytest.mark.spec("FMT-28", "RESHARD-5", "META-3")
def test_torch_saves_and_loads_a_layout_with_a_hole(tmp_path: Path) -> None:
    """One plan: torch's save checks no coverage; its load leaves the hole's old values."""
    import refdcp

    held = [((0, 0), torch.ones(1, 2))]
    dcp.save({"h": refdcp.LocalShards((3, 2), held)}, checkpoint_id=tmp_path, no_dist=True)
    dest = {"h": torch.full((3, 2), 5.0)}
    _torch_load(dest, tmp_path)
    assert dest["h"].tolist() == [[1.0, 1.0], [5.0, 5.0], [5.0, 5.0]]


class _KwargsWriter(FileSystemWriter):  # type: ignore[misc]
    """torch's writer, recording how torch calls its set-up."""

    calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.calls.append(((is_coordinator, *args), kwargs))
        super().set_up_storage_writer(is_coordinator, *args, **kwargs)


class _KwargsReader(FileSystemReader):  # type: ignore[misc]
    """torch's reader, recording how torch calls its set-up."""

    calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    def set_up_storage_reader(
        self, metadata: Any, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        self.calls.append(((is_coordinator, *args), kwargs))
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)


@pytest.mark.spec("CONF-3")
def test_torch_passes_rank_and_use_collectives_to_kwargs_storage(tmp_path: Path) -> None:
    _KwargsWriter.calls.clear()
    _KwargsReader.calls.clear()
    dcp.save({"x": torch.ones(1)}, storage_writer=_KwargsWriter(str(tmp_path)), no_dist=True)
    dcp.load({"x": torch.zeros(1)}, storage_reader=_KwargsReader(str(tmp_path)), no_dist=True)
    expected = [((True,), {"rank": 0, "use_collectives": True})]
    assert _KwargsWriter.calls == expected and _KwargsReader.calls == expected


class _InterruptedWriter(FileSystemWriter):  # type: ignore[misc]
    """torch's writer, interrupted (KeyboardInterrupt) in its local planning on rank 1."""

    def prepare_local_plan(self, plan: Any) -> Any:
        if dist.get_rank() == 1:
            raise KeyboardInterrupt
        return super().prepare_local_plan(plan)


def _torch_save_interrupted_on_rank_1(rank: int, world: int, path: str) -> str:
    try:
        dcp.save({"w": torch.ones(2)}, storage_writer=_InterruptedWriter(path))
    except CheckpointException as e:
        cause = e.failures[1]
        cause = cause[0] if isinstance(cause, tuple) else cause
        return f"CheckpointException {sorted(e.failures)} {type(cause).__name__}"
    except KeyboardInterrupt:
        return "KeyboardInterrupt"
    return "returned"


@pytest.mark.dist
@pytest.mark.spec("ERR-10")
def test_torch_raises_checkpoint_exception_on_the_interrupted_rank(
    two_ranks: list[dict[str, Any]],
) -> None:
    got = [run["interrupt"] for run in two_ranks]
    assert got == ["CheckpointException [1] KeyboardInterrupt"] * 2


class _RepointingWriter(FileSystemWriter):  # type: ignore[misc]
    """torch's writer; before committing, the checkpoint path (a link) is re-pointed."""

    def finish(self, metadata: Any, results: Any) -> None:
        link = Path(self.path)
        link.unlink()
        link.symlink_to(link.parent / "b", target_is_directory=True)
        super().finish(metadata, results)


@pytest.mark.spec("STORE-57")
def test_torch_commits_where_the_path_points_at_commit_not_where_it_wrote(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    link = tmp_path / "ckpt"
    link.symlink_to(tmp_path / "a", target_is_directory=True)
    dcp.save({"w": torch.ones(4)}, storage_writer=_RepointingWriter(str(link)), no_dist=True)
    assert list((tmp_path / "a").glob("*.distcp")) and not (tmp_path / "a" / ".metadata").exists()
    assert (tmp_path / "b" / ".metadata").exists() and not list((tmp_path / "b").glob("*.distcp"))
    with pytest.raises(CheckpointException):  # the save reported success; the path does not load
        _torch_load({"w": torch.zeros(4)}, link)


class _InterleavedWriter(FileSystemWriter):  # type: ignore[misc]
    """torch's writer; another whole torch save into the same directory runs before its commit."""

    def finish(self, metadata: Any, results: Any) -> None:
        _torch_save({"w": torch.full((64,), 2.0), "x": torch.ones(64)}, Path(self.path))
        super().finish(metadata, results)


@pytest.mark.spec("STORE-29")
def test_torch_lets_two_saves_interleave_both_succeeding(tmp_path: Path) -> None:
    dcp.save({"w": torch.ones(4)}, storage_writer=_InterleavedWriter(str(tmp_path)), no_dist=True)
    # both saves returned; the committed .metadata is the first's, over the second's data
    with pytest.raises(CheckpointException, match="corrupted"):
        _torch_load({"w": torch.zeros(4)}, tmp_path)


class _RecordingWriter(FileSystemWriter):  # type: ignore[misc]
    """torch's writer, keeping (alive) every tensor the planner hands it to write."""

    seen: list[torch.Tensor] = []

    def write_data(self, plan: Any, planner: Any) -> Any:
        for item in plan.items:
            data = planner.resolve_data(item)
            if isinstance(data, torch.Tensor):
                self.seen.append(data)
        return super().write_data(plan, planner)


@pytest.mark.spec("ASYNC-30")
def test_torch_async_save_stages_into_fresh_memory_every_time(tmp_path: Path) -> None:
    _RecordingWriter.seen.clear()
    sd = {"w": torch.ones(1000)}
    for n in range(2):
        writer = _RecordingWriter(str(tmp_path / str(n)))
        dcp.async_save(sd, storage_writer=writer, no_dist=True).result(timeout=60)
    first, second = _RecordingWriter.seen  # both kept alive: a reused buffer would repeat
    assert len({first.data_ptr(), second.data_ptr(), sd["w"].data_ptr()}) == 3


@pytest.mark.spec("STORE-64")
def test_torch_hf_reader_follows_a_link_named_safetensors(tmp_path: Path) -> None:
    """torch's HuggingFaceStorageReader opens a ``*.safetensors`` link and reads what it leads to."""
    st = pytest.importorskip("safetensors.torch")
    outside = tmp_path / "outside.bin"
    st.save_file({"secret": torch.full((2,), 7.0)}, outside)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "model.safetensors").symlink_to(outside)
    metadata = dcp.HuggingFaceStorageReader(str(ckpt)).read_metadata()
    assert "secret" in metadata.state_dict_metadata
