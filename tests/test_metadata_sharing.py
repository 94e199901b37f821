"""Equal metadata values are shared objects, pickled once (spec/planning.md META-8)."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as tdcp

import refdcp
from refdcp.storage.metadata.safe import load_metadata


@pytest.mark.spec("META-8")
def test_equal_properties_and_sizes_are_one_object(tmp_path: Path) -> None:
    sd = {f"t{i}": torch.full((8, 4), float(i)) for i in range(50)}
    sd["h"] = torch.ones(3, dtype=torch.float16)
    md = refdcp.save(sd, checkpoint_id=tmp_path, no_dist=True)
    entries = [md.state_dict_metadata[f"t{i}"] for i in range(50)]
    assert all(e.properties is entries[0].properties for e in entries)  # type: ignore[union-attr]
    assert all(e.size is entries[0].size for e in entries)  # type: ignore[union-attr]
    chunk_sizes = {id(e.chunks[0].sizes) for e in entries}  # type: ignore[union-attr]
    assert len(chunk_sizes) == 1
    half = md.state_dict_metadata["h"]
    assert half.properties.dtype == torch.float16  # type: ignore[union-attr]
    assert half.properties is not entries[0].properties  # type: ignore[union-attr]
    # the file keeps the sharing, and both readers load the values back exactly
    back = load_metadata((tmp_path / ".metadata").read_bytes())
    got = [back.state_dict_metadata[f"t{i}"] for i in range(50)]
    assert all(g.properties is got[0].properties for g in got)  # type: ignore[union-attr]
    for reader in (refdcp.load, tdcp.load):
        out = {k: torch.zeros_like(v) for k, v in sd.items()}
        reader(out, checkpoint_id=str(tmp_path), no_dist=True)
        assert all(torch.equal(out[k], sd[k]) for k in sd)


@pytest.mark.spec("META-8")
def test_sharing_makes_the_pickle_smaller(tmp_path: Path) -> None:
    sd = {f"t{i}": torch.full((16,), float(i)) for i in range(200)}
    md = refdcp.save(sd, checkpoint_id=tmp_path, no_dist=True)
    shared = len(pickle.dumps(md.state_dict_metadata))
    for e in md.state_dict_metadata.values():  # unshare: a copy per entry
        e.properties = pickle.loads(pickle.dumps(e.properties))  # type: ignore[union-attr]
        e.size = torch.Size(list(e.size))  # type: ignore[union-attr]
    assert shared < len(pickle.dumps(md.state_dict_metadata))
