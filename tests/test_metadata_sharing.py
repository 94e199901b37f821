"""Equal metadata values are shared objects, pickled once (spec/planning.md META-8)."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as tdcp

import refdcp
from refdcp.storage.metadata.safe import load_metadata

SINGLE_PATH = "META-8's shared metadata objects are the default path's pickle-size optimisation"


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
    # plain tensors of equal properties and shape: one whole-tensor chunk object
    assert all(e.chunks[0] is entries[0].chunks[0] for e in entries)  # type: ignore[union-attr]
    half = md.state_dict_metadata["h"]
    assert half.properties.dtype == torch.float16  # type: ignore[union-attr]
    assert half.properties is not entries[0].properties  # type: ignore[union-attr]
    assert half.chunks[0] is not entries[0].chunks[0]  # type: ignore[union-attr]
    assert list(half.chunks[0].sizes) == [3]  # type: ignore[union-attr]
    # the file keeps the sharing, and both readers load the values back exactly
    back = load_metadata((tmp_path / ".metadata").read_bytes())
    got = [back.state_dict_metadata[f"t{i}"] for i in range(50)]
    assert all(g.properties is got[0].properties for g in got)  # type: ignore[union-attr]
    assert all(g.chunks[0] is got[0].chunks[0] for g in got)  # type: ignore[union-attr]
    assert back.state_dict_metadata == md.state_dict_metadata
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
        e.chunks = pickle.loads(pickle.dumps(e.chunks))  # type: ignore[union-attr]
    assert shared < len(pickle.dumps(md.state_dict_metadata))


@pytest.mark.spec("META-8", "PLAN-1")
def test_a_plans_plain_items_share_tensor_data_per_value() -> None:
    """One TensorWriteData per (properties, shape) in a plan, never across plans; every item
    still equals the one torch's constructors build (PLAN-1)."""
    from refdcp.planning.local_plan import save_items

    sd = {
        "a": torch.zeros(2, 3),
        "b": torch.ones(2, 3),
        "c": torch.ones(3, 2),
        "d": torch.ones(2, 3, dtype=torch.float64),
        "e": torch.ones(2, 3).requires_grad_(),
        "f": torch.full((2, 3), 7.0),
    }
    items = {i.index.fqn: i for i in save_items(sd)}
    td = {k: i.tensor_data for k, i in items.items()}
    assert td["a"] is td["b"] is td["f"]
    assert len({id(td[k]) for k in "acde"}) == 4
    again = save_items(sd)
    assert again[0].tensor_data is not td["a"]  # a fresh object per plan
    for k, v in sd.items():
        assert td[k] is not None
        assert td[k].size == v.size() and td[k].chunk.sizes == v.size()
        assert list(td[k].chunk.offsets) == [0] * v.dim()
        assert td[k].properties.dtype == v.dtype
        assert td[k].properties.requires_grad == v.requires_grad
