"""Local plans, LocalShards and the load policy (PLAN-*, POLICY-*)."""

from __future__ import annotations

import io
import pickle
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import (
    LoadPlanner,
    SavePlanner,
    WriteItemType,
)

from refdcp.planning import (
    DefaultLoadPlanner,
    DefaultSavePlanner,
    LoadPolicyError,
    LocalShards,
)
from refdcp.planning.local_plan import save_items
from refdcp.planning.simulate import simulate_load, simulate_save


class Point:
    """A picklable non-tensor object that weights-only loading refuses."""

    def __init__(self, x: int) -> None:
        self.x = x


@pytest.mark.spec("PLAN-1")
def test_local_plan_item_kinds() -> None:
    sd = {
        "t": torch.zeros(2, 3),
        "ls": LocalShards(
            (6,), [((0,), torch.zeros(2)), ((4,), torch.zeros(0)), ((2,), torch.zeros(3))]
        ),
        "o": {"lr": 0.1},
    }
    items = save_items(sd)
    kinds = [(i.index.fqn, i.type, i.index.offset) for i in items]
    assert kinds == [
        ("t", WriteItemType.TENSOR, torch.Size([0, 0])),
        ("ls", WriteItemType.SHARD, torch.Size([0])),
        ("ls", WriteItemType.SHARD, torch.Size([2])),
        ("o", WriteItemType.BYTE_IO, None),
    ]
    assert isinstance(DefaultSavePlanner(), SavePlanner)
    assert isinstance(DefaultLoadPlanner(), LoadPlanner)


@pytest.mark.spec("PLAN-3", "PLAN-5")
def test_local_shards_protocol() -> None:
    a, b = torch.arange(4.0).reshape(2, 2), torch.zeros(0, 2)
    ls = LocalShards((3, 2), [((0, 0), a), ((2, 0), b)])
    assert ls.shape == torch.Size([3, 2]) and ls.dtype == torch.float32
    assert isinstance(ls, torch.Tensor)
    assert [tuple(c.offsets) for c in ls.__create_chunk_list__()] == [(0, 0), (2, 0)]
    assert len(ls.__create_write_items__("x", ls)) == 1  # the empty chunk holds no data
    assert ls.__get_tensor_shard__(MetadataIndex("x", torch.Size([0, 0]))) is a
    with pytest.raises(TypeError, match="not supported"):
        ls.sum()
    again = pickle.loads(pickle.dumps(ls))
    assert torch.equal(again.chunks[0][1], a)


@pytest.mark.spec("PLAN-4")
@pytest.mark.parametrize(
    "args,kwargs,match",
    [
        (((4,), [((3,), torch.zeros(2))]), {}, "exceeds"),
        (((4,), [((0,), torch.zeros(3)), ((2,), torch.zeros(2))]), {}, "overlap"),
        (((4,), [((0,), torch.zeros(2)), ((2,), torch.zeros(2, dtype=torch.int8))]), {}, "mix"),
        (((4,), []), {}, "dtype="),
        (((4,), [((0,), torch.zeros(2))]), {"dtype": torch.int8}, "differs"),
    ],
)
def test_local_shards_rejects_bad_chunks(args: Any, kwargs: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        LocalShards(*args, **kwargs)


@pytest.mark.spec("PLAN-6")
def test_resolve_data() -> None:
    sd = {"t": torch.arange(3), "o": [1, "a"]}
    p = DefaultSavePlanner()
    p.set_up_planner(sd, None, True)
    plan = p.create_local_plan()
    tensor_item, obj_item = plan.items
    assert p.resolve_data(tensor_item) is not None
    assert torch.equal(p.resolve_data(tensor_item), sd["t"])  # type: ignore[arg-type]
    data = p.resolve_data(obj_item)
    assert isinstance(data, io.BytesIO) and torch.load(data) == [1, "a"]


@pytest.mark.spec("PLAN-7")
def test_objects_load_weights_only_unless_opted_in() -> None:
    ckpt = simulate_save([{"p": Point(3)}], lambda: DefaultSavePlanner(safe_globals=[Point]))
    with pytest.raises(pickle.UnpicklingError):
        simulate_load([{"p": None}], ckpt, DefaultLoadPlanner)
    dest: dict[str, Any] = {"p": None}
    simulate_load([dest], ckpt, lambda: DefaultLoadPlanner(allow_pickle=True))
    assert isinstance(dest["p"], Point) and dest["p"].x == 3


def _ckpt() -> Any:
    return simulate_save(
        [{"a": torch.ones(2, 2), "b": torch.ones(3), "c": 1, "d": torch.ones(1)}],
        DefaultSavePlanner,
    )


@pytest.mark.spec("POLICY-1", "POLICY-2", "POLICY-3", "POLICY-4", "POLICY-5", "POLICY-6")
def test_all_problems_reported_together_and_nothing_loaded() -> None:
    dest = {
        "a": torch.zeros(2, 3),  # shape
        "b": torch.zeros(3, dtype=torch.float16),  # dtype
        "c": torch.zeros(1),  # tensor where an object was saved
        "missing": torch.zeros(1),
    }
    with pytest.raises(LoadPolicyError) as err:
        simulate_load([dest], _ckpt(), lambda: DefaultLoadPlanner(reject_unexpected=True))
    text = "\n".join(err.value.problems)
    assert len(err.value.problems) == 5
    for needle in (
        "Missing key in checkpoint state_dict: missing.",
        "unexpected keys",
        "['d']",
        "'a': shape",
        "'b': dtype",
        "'c'",
    ):
        assert needle in text
    assert not dest["b"].any() and not dest["c"].any()  # nothing loaded


@pytest.mark.spec("POLICY-3")
def test_subset_loads_by_default_and_unexpected_keys_can_be_rejected() -> None:
    dest = {"a": torch.zeros(2, 2), "b": torch.zeros(3)}
    simulate_load([dest], _ckpt(), DefaultLoadPlanner)  # "c" and "d" are not asked for
    assert torch.equal(dest["a"], torch.ones(2, 2)) and torch.equal(dest["b"], torch.ones(3))
    with pytest.raises(LoadPolicyError, match=r"unexpected keys .*\['c', 'd'\]"):
        simulate_load(
            [{"a": torch.zeros(2, 2), "b": torch.zeros(3)}],
            _ckpt(),
            lambda: DefaultLoadPlanner(reject_unexpected=True),
        )


@pytest.mark.spec("POLICY-2", "POLICY-3")
def test_non_strict_skips_missing_and_unexpected() -> None:
    dest = {"a": torch.zeros(2, 2), "missing": torch.zeros(1)}
    simulate_load([dest], _ckpt(), lambda: DefaultLoadPlanner(allow_partial_load=True))
    assert torch.equal(dest["a"], torch.ones(2, 2)) and not dest["missing"].any()
    dest2 = {"a": torch.zeros(2, 2)}
    simulate_load([dest2], _ckpt(), lambda: DefaultLoadPlanner(strict=False))
    assert torch.equal(dest2["a"], torch.ones(2, 2))


@pytest.mark.spec("POLICY-5")
def test_allow_cast() -> None:
    dest = {"a": torch.zeros(2, 2, dtype=torch.float64), "b": torch.zeros(3, dtype=torch.int32)}
    simulate_load([dest], _ckpt(), lambda: DefaultLoadPlanner(strict=False, allow_cast=True))
    assert dest["a"].dtype == torch.float64 and torch.equal(
        dest["a"], torch.ones(2, 2, dtype=torch.float64)
    )
    assert torch.equal(dest["b"], torch.ones(3, dtype=torch.int32))


@pytest.mark.spec("POLICY-6")
def test_object_where_tensor_saved() -> None:
    with pytest.raises(LoadPolicyError, match="'a': the checkpoint holds a tensor"):
        simulate_load([{"a": "text"}], _ckpt(), lambda: DefaultLoadPlanner(strict=False))
