"""The load policy reports every problem at once, against an oracle (POLICY-1..POLICY-6)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    TensorProperties,
    TensorStorageMetadata,
)

from refdcp.planning.load_policy import LoadPolicy, check_load

KINDS = [
    "ok_tensor",
    "ok_object",
    "missing",
    "unexpected",
    "obj_in_ckpt",
    "tensor_in_ckpt",
    "shape",
    "dtype",
]


def _tensor_md(shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> TensorStorageMetadata:
    return TensorStorageMetadata(
        TensorProperties(dtype=dtype),
        torch.Size(shape),
        [ChunkStorageMetadata(torch.Size([0] * len(shape)), torch.Size(shape))],
    )


@pytest.mark.spec("POLICY-1", "POLICY-2", "POLICY-3", "POLICY-4", "POLICY-5", "POLICY-6")
@given(
    st.lists(st.sampled_from(KINDS), min_size=1, max_size=8),
    st.booleans(),
    st.booleans(),
    st.booleans(),
)
def test_every_problem_is_reported_and_only_clean_keys_are_planned(
    kinds: list[str], strict: bool, reject_unexpected: bool, allow_cast: bool
) -> None:
    dest: dict[str, object] = {}
    saved: dict[str, object] = {}
    expect_problem: dict[str, bool] = {}
    expect_key: dict[str, bool] = {}
    for i, kind in enumerate(kinds):
        k = f"k{i}"
        if kind == "ok_tensor":
            dest[k], saved[k] = torch.zeros(2, 3), _tensor_md((2, 3))
        elif kind == "ok_object":
            dest[k], saved[k] = 5, BytesStorageMetadata()
        elif kind == "missing":
            dest[k] = torch.zeros(1)
        elif kind == "unexpected":
            saved[k] = BytesStorageMetadata()
        elif kind == "obj_in_ckpt":
            dest[k], saved[k] = torch.zeros(1), BytesStorageMetadata()
        elif kind == "tensor_in_ckpt":
            dest[k], saved[k] = "text", _tensor_md((1,))
        elif kind == "shape":
            dest[k], saved[k] = torch.zeros(2, 3), _tensor_md((3, 2))
        else:
            dest[k], saved[k] = torch.zeros(4, dtype=torch.int32), _tensor_md((4,))
        expect_problem[k] = (
            kind in ("obj_in_ckpt", "tensor_in_ckpt", "shape")
            or (kind == "missing" and strict)
            or (kind == "unexpected" and reject_unexpected)
            or (kind == "dtype" and not allow_cast)
        )
        expect_key[k] = kind in ("ok_tensor", "ok_object", "shape", "dtype")
    policy = LoadPolicy(strict=strict, reject_unexpected=reject_unexpected, allow_cast=allow_cast)
    keys, problems = check_load(dest, saved, policy)  # type: ignore[arg-type]
    named = [k for k in expect_problem if any(f"'{k}'" in p for p in problems)]
    assert sorted(named) == sorted(k for k, bad in expect_problem.items() if bad), problems
    assert keys == [k for k in dest if expect_key.get(k, False)]


@pytest.mark.spec("POLICY-1", "POLICY-6")
def test_a_kind_mismatch_does_not_hide_the_problems_after_it() -> None:
    dest = {"a": torch.zeros(1), "b": torch.zeros(2), "c": 1}
    saved = {"a": BytesStorageMetadata(), "b": _tensor_md((3,)), "c": _tensor_md((1,))}
    keys, problems = check_load(dest, saved, LoadPolicy())  # type: ignore[arg-type]
    assert len(problems) == 3 and keys == ["b"]
    assert "'a'" in problems[0] and "'b'" in problems[1] and "'c'" in problems[2]
