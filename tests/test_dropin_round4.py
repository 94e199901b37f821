"""Drop-in, round 4: torch's module paths, older on-disk forms, nothing kept between saves.

API-27: every public name of ``torch.distributed.checkpoint`` 2.13 and of its
public submodules resolves under ``refdcp`` (walked from torch, not listed).
API-28: checkpoints in torch's older ``.metadata`` forms (the ShardedTensor-era
``TensorProperties``, no ``storage_meta``, no ``planner_data``, no ``version``)
load, searched over every combination. API-26: a save leaves nothing behind
that a later save in the same process picks up. STORE-6: torch's wording.
"""

from __future__ import annotations

import importlib
import inspect
import pickle
import pkgutil
import warnings
from pathlib import Path
from types import ModuleType
from typing import Any
from unittest.mock import patch

import pytest
import torch
import torch.distributed.checkpoint as tdcp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed._shard.sharded_tensor.metadata import TensorProperties as ShardedEraProps
from torch.distributed.checkpoint.metadata import Metadata, TensorProperties

import refdcp
from refdcp.errors import CheckpointError
from refdcp.torch_names import OWN_MODULES, SUBMODULES, TOP_LEVEL, WHOLE, Absent, NotProvidedError

warnings.filterwarnings("ignore", message="torch.distributed is disabled")
warnings.filterwarnings("ignore", message="torch.distributed is not initialized")
warnings.filterwarnings("ignore", message=r"save\(state_dict, storage_writer\)")

ABCS = (tdcp.StorageWriter, tdcp.StorageReader, tdcp.SavePlanner, tdcp.LoadPlanner)


def _public_submodules() -> list[str]:
    return sorted(m.name for m in pkgutil.iter_modules(tdcp.__path__) if not m.name.startswith("_"))


def _public_names(module: ModuleType) -> list[str]:
    names = getattr(module, "__all__", None)
    return sorted(names if names is not None else (n for n in dir(module) if not n.startswith("_")))


def _same_meaning(ours: Any, theirs: Any, where: str) -> None:
    """Ours is torch's object, or refdcp's implementation of the same role."""
    if ours is theirs:
        return
    if isinstance(theirs, type):
        assert isinstance(ours, type), where
        for base in ABCS:
            if issubclass(theirs, base):
                assert issubclass(ours, base), f"{where}: not a {base.__name__}"
        return
    assert callable(ours) and callable(theirs), where
    missing = set(inspect.signature(theirs).parameters) - set(inspect.signature(ours).parameters)
    assert not missing, f"{where}: refdcp's takes no {sorted(missing)}"


@pytest.mark.spec("API-27")
@pytest.mark.parametrize("sub", _public_submodules())
def test_every_public_name_of_every_torch_submodule_resolves_under_refdcp(sub: str) -> None:
    theirs_mod = importlib.import_module(f"torch.distributed.checkpoint.{sub}")
    ours_mod = importlib.import_module(f"refdcp.{sub}")
    assert getattr(refdcp, sub) is ours_mod
    assert sub in SUBMODULES or sub in WHOLE or sub in OWN_MODULES, f"{sub} is not mapped"
    if sub in OWN_MODULES:
        names = list(OWN_MODULES[sub])
    elif sub in WHOLE:  # no public list of its own: every name it has
        names = sorted(n for n in dir(theirs_mod) if not n.startswith("_"))
    else:
        names = _public_names(theirs_mod)
    assert names
    for name in names:
        where = f"refdcp.{sub}.{name}"
        entry = SUBMODULES.get(sub, {}).get(name)
        if isinstance(entry, Absent):
            with pytest.raises(NotProvidedError, match=rf"{where} is not provided by refdcp: use "):
                getattr(ours_mod, name)
            assert name not in ours_mod.__all__
            continue
        _same_meaning(getattr(ours_mod, name), getattr(theirs_mod, name), where)
    if sub in SUBMODULES:  # the table lists exactly torch's names, no more
        assert set(SUBMODULES[sub]) == set(names)


@pytest.mark.spec("API-27")
def test_every_top_level_torch_name_resolves_under_refdcp() -> None:
    names = _public_names(tdcp)
    assert {"Metadata", "CheckpointException", "HuggingFaceStorageWriter", "save"} <= set(names)
    for name in names:
        entry = TOP_LEVEL.get(name)
        if isinstance(entry, Absent):
            with pytest.raises(NotProvidedError, match=f"refdcp.{name} is not provided"):
                getattr(refdcp, name)
            assert not hasattr(refdcp, name)  # still an AttributeError for hasattr/getattr
            continue
        theirs = getattr(tdcp, name)
        ours = getattr(refdcp, name)
        if isinstance(theirs, ModuleType):
            assert ours is importlib.import_module(f"refdcp.{name}")
        else:
            _same_meaning(ours, theirs, f"refdcp.{name}")
    with pytest.raises(AttributeError):
        refdcp.no_such_name  # noqa: B018


@pytest.mark.spec("API-27")
def test_code_written_for_torch_runs_after_changing_the_import(tmp_path: Path) -> None:
    dcp: Any = refdcp
    from refdcp.state_dict_loader import load as loader_load
    from refdcp.state_dict_saver import save as saver_save

    sd = {"w": torch.arange(12.0).reshape(3, 4), "step": 3}
    saver_save(sd, dcp.filesystem.FileSystemWriter(str(tmp_path)))
    md = dcp.filesystem.FileSystemReader(str(tmp_path)).read_metadata()
    assert isinstance(md, dcp.metadata.Metadata) and isinstance(md, dcp.Metadata)
    out = {"w": torch.zeros(3, 4), "step": 0}
    loader_load(
        out, dcp.FileSystemReader(str(tmp_path)), planner=dcp.default_planner.DefaultLoadPlanner()
    )
    assert torch.equal(out["w"], sd["w"]) and out["step"] == 3
    with pytest.raises(dcp.CheckpointException):
        dcp.load({"missing": torch.zeros(1)}, checkpoint_id=str(tmp_path))


# -- API-28: older on-disk forms --------------------------------------------------------------

OPTIONAL_FIELDS = ("storage_meta", "planner_data", "version")


def _rewrite_metadata(path: Path, drop: set[str]) -> None:
    """``.metadata`` as an older torch wrote it: the dropped fields absent from the pickle."""
    with (path / ".metadata").open("rb") as f:
        md = pickle.load(f)
    old = Metadata.__new__(Metadata)
    old.__dict__.update({k: v for k, v in md.__dict__.items() if k not in drop})
    with (path / ".metadata").open("wb") as f:
        pickle.dump(old, f)


@pytest.mark.spec("API-28")
@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    drop=st.sets(st.sampled_from(OPTIONAL_FIELDS)),
    sharded_era=st.booleans(),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.int64]),
    shape=st.lists(st.integers(0, 4), min_size=0, max_size=3),
)
def test_older_metadata_forms_load_as_torch_loads_them(
    tmp_path_factory: pytest.TempPathFactory,
    impl: ModuleType,
    drop: set[str],
    sharded_era: bool,
    dtype: torch.dtype,
    shape: list[int],
) -> None:
    path = tmp_path_factory.mktemp("old")
    n = 1
    for s in shape:
        n *= s
    value = torch.arange(n).reshape(shape).to(dtype)
    # no planner_data: torch before flattening saved flat state dicts only
    sd: dict[str, Any] = {"w": value, "b": torch.ones(3)}
    if "planner_data" not in drop:
        sd["nested"] = {"x": value.clone(), "k": 7}
    if sharded_era:
        with patch("torch.distributed.checkpoint.metadata.TensorProperties", ShardedEraProps):
            tdcp.save(sd, checkpoint_id=str(path), no_dist=True)
    else:
        tdcp.save(sd, checkpoint_id=str(path), no_dist=True)
    _rewrite_metadata(path, drop)

    def fresh() -> dict[str, Any]:
        out: dict[str, Any] = {"w": torch.zeros(shape, dtype=dtype), "b": torch.zeros(3)}
        if "nested" in sd:
            out["nested"] = {"x": torch.zeros(shape, dtype=dtype), "k": 0}
        return out

    theirs, ours = fresh(), fresh()
    tdcp.load(theirs, checkpoint_id=str(path), no_dist=True)
    impl.load(ours, checkpoint_id=str(path))
    assert torch.equal(ours["w"], value) and torch.equal(ours["w"], theirs["w"])
    assert torch.equal(ours["b"], theirs["b"])
    if "nested" in sd:
        assert ours["nested"]["k"] == theirs["nested"]["k"] == 7
        assert torch.equal(ours["nested"]["x"], value)


# -- API-26: nothing kept between saves ------------------------------------------------------


@pytest.mark.spec("API-26", "API-28")
def test_a_save_under_torchs_own_compatibility_patch_leaves_nothing_for_the_next(
    tmp_path: Path, impl: ModuleType
) -> None:
    """torch's test_sharded_tensor_dependency then test_storage_meta, in one process."""
    with patch("torch.distributed.checkpoint.metadata.TensorProperties", ShardedEraProps):
        impl.save({"a": torch.zeros(4, 4)}, impl.FileSystemWriter(str(tmp_path / "old")))
    impl.load({"a": torch.zeros(4, 4)}, impl.FileSystemReader(str(tmp_path / "old")))
    writer = impl.FileSystemWriter(str(tmp_path / "new"))
    impl.save({"a": torch.zeros(4, 4)}, storage_writer=writer)
    reader = impl.FileSystemReader(str(tmp_path / "new"))
    md = reader.read_metadata()
    assert type(md.state_dict_metadata["a"].properties) is TensorProperties
    assert md.storage_meta is not None
    assert str(md.storage_meta.checkpoint_id) == str(tmp_path / "new")
    assert md.storage_meta.save_id == writer.save_id
    assert md.storage_meta.load_id == reader.load_id


@pytest.mark.spec("API-26")
def test_changing_what_a_save_returned_does_not_change_the_next_save(
    tmp_path: Path, impl: ModuleType
) -> None:
    first = impl.save({"a": torch.zeros(2, 2)}, checkpoint_id=str(tmp_path / "one"))
    first.state_dict_metadata["a"].properties.requires_grad = True
    first.state_dict_metadata["a"].properties.dtype = torch.float64
    second = impl.save({"a": torch.zeros(2, 2)}, checkpoint_id=str(tmp_path / "two"))
    props = second.state_dict_metadata["a"].properties
    assert (props.dtype, props.requires_grad) == (torch.float32, False)
    on_disk = impl.FileSystemReader(str(tmp_path / "two")).read_metadata()
    assert on_disk.state_dict_metadata["a"].properties.dtype == torch.float32


# -- STORE-6: torch's wording ------------------------------------------------------------------


@pytest.mark.spec("STORE-6")
def test_overwrite_false_raises_with_torchs_words(tmp_path: Path) -> None:
    refdcp.save({"a": torch.ones(2)}, checkpoint_id=str(tmp_path))
    with pytest.raises(CheckpointError, match="Checkpoint already exists") as err:
        refdcp.save({"a": torch.ones(2)}, refdcp.FileSystemWriter(str(tmp_path), overwrite=False))
    assert str(tmp_path) in str(err.value)
    mem = refdcp.MemoryStorage()
    refdcp.save({"a": torch.ones(2)}, mem.writer("x"))
    with pytest.raises(CheckpointError, match="Checkpoint already exists"):
        refdcp.save({"a": torch.ones(2)}, mem.writer("x", overwrite=False))


# -- ASYNC-1: the async result is torch's ------------------------------------------------------


@pytest.mark.spec("ASYNC-1", "REF-11")
def test_the_async_handle_is_a_future_and_torchs_async_save_response(
    tmp_path: Path, impl: ModuleType
) -> None:
    import concurrent.futures as cf

    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

    stager = DefaultStager(StagingOptions(False, False, False, False))
    handles = [
        impl.async_save({"a": torch.ones(3)}, checkpoint_id=str(tmp_path / "plain")),
        impl.async_save(
            {"a": torch.ones(3)}, checkpoint_id=str(tmp_path / "ds"), async_stager=stager
        ),
    ]
    done, not_done = cf.wait(handles, timeout=60)
    assert done == set(handles) and not not_done
    assert set(cf.as_completed(handles)) == set(handles)
    for h in handles:
        assert isinstance(h, cf.Future) and isinstance(h, AsyncSaveResponse)
        assert h.upload_completion is h and h.committed is h
        assert h.staging_completion is h.staged and h.staging_completion.result() is None
        assert isinstance(h.result(), Metadata) and h.upload_completion.result() is h.result()
    stager.close()


# -- REF-21: the reference reads zstd checkpoints ---------------------------------------------


@pytest.mark.spec("REF-21", "FMT-24")
@pytest.mark.parametrize("writer", ["torch", "refdcp"])
@settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.int64]),
    rows=st.integers(0, 9),
    world=st.integers(1, 3),
)
def test_zstd_checkpoints_of_either_writer_load_in_either_implementation(
    tmp_path_factory: pytest.TempPathFactory,
    impl: ModuleType,
    writer: str,
    dtype: torch.dtype,
    rows: int,
    world: int,
) -> None:
    from torch.distributed.checkpoint._extension import ZStandard

    from refdcp.comm import FakeWorld

    path = str(tmp_path_factory.mktemp("zstd"))
    value = torch.arange(rows * 4).reshape(rows, 4).to(dtype)
    sd = {"w": value, "meta": {"step": rows, "name": "x" * rows}}
    make = tdcp.FileSystemWriter if writer == "torch" else refdcp.FileSystemWriter
    tdcp.save(sd, storage_writer=make(path, _extensions=[ZStandard()]), no_dist=True)

    def rank(comm: Any) -> bool:  # resharded: each rank reads its rows of the tensor
        out = {"w": torch.zeros(rows, 4, dtype=dtype), "meta": {"step": -1, "name": ""}}
        impl.load(out, checkpoint_id=path, comm=comm)
        return bool(torch.equal(out["w"], value)) and out["meta"] == sd["meta"]

    assert all(FakeWorld(world).run(rank))
