"""The small-item fast paths of local planning build exactly what the general paths build
(PLAN-1, FLAT-6, META-8)."""

from __future__ import annotations

import pickle
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from refdcp.planning.flatten import _plain_rich, encode_structure, flatten_state_dict
from refdcp.planning.local_plan import (
    _FAST_RECORDS,
    PlanShare,
    _signature,
    plain_tensor_item,
    plan_digest,
    save_items,
    tensors_without_chunks,
)


def _torch_item(fqn: str, t: torch.Tensor) -> WriteItem:
    """What the general path (torch's constructors) builds for a plain tensor."""
    off = torch.Size([0] * t.dim())
    return WriteItem(
        index=MetadataIndex(fqn, off),
        type=WriteItemType.TENSOR,
        tensor_data=TensorWriteData(
            chunk=ChunkStorageMetadata(offsets=off, sizes=t.size()),
            properties=TensorProperties.create_from_tensor(t),
            size=t.size(),
        ),
    )


VALUES = [
    torch.zeros(()),
    torch.arange(6.0).reshape(2, 3),
    torch.ones(4, dtype=torch.bfloat16).requires_grad_(),
    torch.nn.Parameter(torch.ones(2, 2)),
    torch.zeros(0, 3, dtype=torch.int64),
    torch.arange(12).reshape(3, 4).t(),  # not contiguous: still one item of the whole tensor
]


@pytest.mark.spec("PLAN-1")
@pytest.mark.parametrize("value", VALUES, ids=lambda v: f"{v.dtype}{tuple(v.shape)}")
def test_plain_tensor_item_equals_torchs_records(value: torch.Tensor) -> None:
    assert _FAST_RECORDS  # this torch's records are the ones the fast path knows
    fast, slow = plain_tensor_item("a.b", value), _torch_item("a.b", value)
    assert fast == slow
    assert hash(fast.index) == hash(slow.index)
    assert vars(fast.index) == vars(slow.index)
    assert list(vars(fast.index)) == list(vars(slow.index))  # pickled in the same field order
    assert pickle.loads(pickle.dumps(fast)) == slow
    assert _signature(fast) == _signature(slow)


@pytest.mark.spec("META-8", "API-26")
def test_equal_values_share_offsets_and_properties() -> None:
    share = PlanShare()
    a = plain_tensor_item("a", torch.zeros(2, 3), share)
    b = plain_tensor_item("b", torch.ones(5, 1), share)
    assert a.tensor_data is not None and b.tensor_data is not None
    assert a.index.offset is b.index.offset is a.tensor_data.chunk.offsets
    assert a.tensor_data.properties is b.tensor_data.properties
    # one plan's records are its own: another plan gets new ones (API-26)
    c = plain_tensor_item("c", torch.zeros(2, 3), PlanShare())
    assert c.tensor_data is not None and c.tensor_data.properties is not a.tensor_data.properties


@pytest.mark.spec("PLAN-1")
def test_plan_digest_digests_the_repr_of_the_signatures() -> None:
    import hashlib

    sd: dict[str, Any] = {f"p{i}": torch.zeros(i % 3 + 1, dtype=torch.float16) for i in range(20)}
    sd["obj"] = {"x": 1}
    sd["q"] = torch.ones(2, 2).t()
    items = save_items(flatten_state_dict(sd).items)
    expected = hashlib.blake2b(repr([_signature(i) for i in items]).encode(), digest_size=16)
    assert plan_digest(items) == expected.hexdigest()
    sums = {("p1", torch.Size([0])): 5}
    expected.update(repr(sorted(sums.items(), key=repr)).encode())
    assert plan_digest(items, sums) == expected.hexdigest()


@pytest.mark.spec("FLAT-6")
@given(
    st.dictionaries(
        st.one_of(st.text(max_size=3), st.integers(-3, 3)),
        st.one_of(
            st.just(torch.zeros(1)),
            st.integers(),
            st.lists(st.just(torch.ones(1)), max_size=2),
            st.dictionaries(st.text(max_size=2), st.just(torch.zeros(1)), max_size=2),
        ),
        max_size=6,
    )
)
def test_encode_structure_keeps_exactly_the_non_plain_paths(sd: dict[Any, Any]) -> None:
    flat = flatten_state_dict(sd)
    expected = {f: rp for f, rp in flat.rich.items() if rp != _plain_rich(flat.paths[f])}
    assert encode_structure(flat)["rich"] == expected


@pytest.mark.spec("META-1")
def test_chunkless_tensors_lists_only_unplanned_tensors() -> None:
    flat = flatten_state_dict({"a": torch.zeros(2), "b": torch.ones(3, dtype=torch.int8), "c": 1})
    items = save_items(flat.items)
    assert tensors_without_chunks(flat.items, items) == {}
    only_a = [i for i in items if i.index.fqn == "a"]
    assert tensors_without_chunks(flat.items, only_a) == {
        "b": (TensorProperties(dtype=torch.int8), torch.Size([3]))
    }


@pytest.mark.spec("DEDUP-8", "DEDUP-13", "DEDUP-22")
def test_the_coordinator_digests_its_plan_only_beside_other_ranks() -> None:
    from refdcp.planning import DefaultSavePlanner
    from refdcp.planning.flatten import RESERVED_KEY

    sd = {"w": torch.ones(3), "b": torch.zeros(2)}
    solo = DefaultSavePlanner()
    solo.set_up_planner(sd, None, True)
    plan = solo.create_local_plan()
    assert plan.planner_data[RESERVED_KEY]["digest"] is None  # one rank: never needed
    (final,), md = solo.create_global_plan([plan])
    assert len(final.items) == 2 and set(md.state_dict_metadata) == {"w", "b"}

    planners = [DefaultSavePlanner() for _ in range(2)]
    for rank, p in enumerate(planners):
        p.set_up_planner(sd, None, rank == 0)
    plans = [p.create_local_plan() for p in planners]
    coordinator_extra = plans[0].planner_data[RESERVED_KEY]
    assert coordinator_extra["digest"] is None
    finals, _ = planners[0].create_global_plan(plans)
    assert coordinator_extra["digest"] == plan_digest(plans[0].items)  # as its local plan had it
    assert sorted(len(f.items) for f in finals) == [1, 1]  # the replicated items split (DEDUP-2)
