"""torch's call sites run unchanged against both implementations (``impl``; API-9, API-11)."""

from __future__ import annotations

import warnings
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

import refdcp
from refdcp.comm import FakeWorld
from refdcp.errors import CheckpointError

warnings.filterwarnings("ignore", message="torch.distributed is disabled")


@pytest.mark.spec("API-9")
def test_save_without_collectives_writes_per_rank_metadata(tmp_path: Path) -> None:
    # single path: the reference refuses use_collectives=False (REF-17)
    def rank(comm: Any) -> Any:
        sd = {"w": torch.full((2,), float(comm.rank))}
        return refdcp.save(sd, checkpoint_id=tmp_path, comm=comm, use_collectives=False)

    mds = FakeWorld(3).run(rank)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert [n for n in names if n.endswith(".metadata")] == [f"__{r}.metadata" for r in range(3)]
    assert ".metadata" not in names
    for r, md in enumerate(mds):
        (info,) = md.storage_data.values()
        assert info.relative_path.startswith(f"__{r}_")
        # each rank's own checkpoint view reads back its own values with torch's reader
        reader = dcp.FileSystemReader(str(tmp_path))
        got = reader.read_metadata(rank=r)
        assert set(got.state_dict_metadata) == {"w"}


@pytest.mark.spec("API-9")
def test_save_without_collectives_matches_torchs_layout(tmp_path: Path) -> None:
    # single path: the reference refuses use_collectives=False (REF-17)
    sd = {"w": torch.arange(4.0)}
    dcp.save(sd, checkpoint_id=tmp_path / "t", no_dist=True, use_collectives=False)
    refdcp.save(sd, checkpoint_id=tmp_path / "r", no_dist=True, use_collectives=False)
    t = sorted(p.name for p in (tmp_path / "t").iterdir() if p.name.endswith("metadata"))
    r = sorted(p.name for p in (tmp_path / "r").iterdir() if p.name.endswith("metadata"))
    assert t == r == ["__0.metadata"]


@pytest.mark.spec("API-9", "ERR-1")
def test_save_without_collectives_failure_reaches_every_rank(tmp_path: Path) -> None:
    # single path: the reference refuses use_collectives=False (REF-17)
    def rank(comm: Any) -> str:
        sd: dict[str, Any] = {"w": torch.ones(2)}
        if comm.rank == 1:
            sd["bad"] = lambda: None
        with pytest.raises(CheckpointError) as err:
            refdcp.save(sd, checkpoint_id=tmp_path, comm=comm, use_collectives=False)
        return str(sorted(err.value.rank_failures))

    assert FakeWorld(2).run(rank) == ["[1]", "[1]"]


@pytest.mark.spec("API-11")
@pytest.mark.parametrize("kind", [AsyncCheckpointerType.THREAD, "thread"])
def test_async_save_takes_torchs_names(impl: ModuleType, tmp_path: Path, kind: Any) -> None:
    stager = refdcp.CpuStager(cache_staged_state_dict=True)
    handle = impl.async_save(
        {"w": torch.ones(3)},
        checkpoint_id=tmp_path,
        async_stager=stager,
        async_checkpointer_type=kind,
        no_dist=True,
    )
    handle.result()
    dest = {"w": torch.zeros(3)}
    impl.load(dest, checkpoint_id=tmp_path, no_dist=True)
    assert torch.equal(dest["w"], torch.ones(3))


@pytest.mark.spec("API-11")
def test_async_save_rejects_conflicting_spellings(impl: ModuleType, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="disagree"):
        impl.async_save(
            {"w": torch.ones(1)},
            checkpoint_id=tmp_path,
            executor="thread",
            async_checkpointer_type=AsyncCheckpointerType.PROCESS,
            no_dist=True,
        )
    with pytest.raises(ValueError, match="stager once"):
        impl.async_save(
            {"w": torch.ones(1)},
            checkpoint_id=tmp_path,
            stager=refdcp.CpuStager(),
            async_stager=refdcp.CpuStager(),
            no_dist=True,
        )
    with pytest.raises(ValueError, match="async_checkpointer_type"):
        impl.async_save(
            {"w": torch.ones(1)},
            checkpoint_id=tmp_path,
            async_checkpointer_type="gpu",
            no_dist=True,
        )


@pytest.mark.spec("API-10")
def test_unimplemented_torch_writer_options_are_refused(tmp_path: Path) -> None:
    # single path: the options of refdcp's own FileSystemWriter class (the fast path's storage)
    from torch.distributed.checkpoint.filesystem import SerializationFormat

    with pytest.raises(ValueError, match="TORCH_SAVE"):
        refdcp.FileSystemWriter(tmp_path, serialization_format=SerializationFormat.SAFETENSORS)
    with pytest.raises(ValueError, match="_extensions: object is not a stream transform"):
        refdcp.FileSystemWriter(tmp_path, _extensions=[object()])  # transforms: FMT-23
    refdcp.FileSystemWriter(tmp_path, serialization_format=SerializationFormat.TORCH_SAVE)
    with pytest.raises(ValueError, match="per_thread_copy_ahead"):
        refdcp.FileSystemWriter(tmp_path, per_thread_copy_ahead=1)
    with pytest.raises(ValueError, match="cache_staged_state_dict"):
        refdcp.FileSystemWriter(tmp_path, cache_staged_state_dict=True)
    # the default values, spelled out as a torch call site may, keep working
    w = refdcp.FileSystemWriter(
        tmp_path, per_thread_copy_ahead=10_000_000, cache_staged_state_dict=False
    )
    assert w.per_thread_copy_ahead == 10_000_000 and w.cache_staged_state_dict is False
