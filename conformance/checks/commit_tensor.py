"""The reader calls ``planner.commit_tensor`` for every tensor it fills (CONF-49)."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

from conformance.checks.common import blank_dest, save_at
from conformance.drive import load_ranks
from conformance.registry import CheckFailed, Context, spec
from conformance.truth import assert_same, bits, finite_tensor, rand_tensor


def _key(item: ReadItem) -> str:
    return f"{item.dest_index.fqn}@{tuple(item.dest_offsets)}"


class RecordingPlanner(DefaultLoadPlanner):
    """Hands the reader a temporary per read item and copies it into place only in
    ``commit_tensor``, recording every call, as torch's contract allows a planner to do."""

    def __init__(self) -> None:
        super().__init__()
        self.items: list[ReadItem] = []
        self.temps: dict[str, torch.Tensor] = {}
        self.commits: dict[str, list[torch.Tensor]] = {}
        self.early: list[str] = []

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        plan = super().finish_plan(central_plan)
        self.items = [i for i in plan.items if i.type == LoadItemType.TENSOR]
        return plan

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        dest = super().resolve_tensor(read_item)
        temp = torch.zeros(dest.shape, dtype=dest.dtype)
        self.temps[_key(read_item)] = temp
        return temp

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        key = _key(read_item)
        if key not in self.temps:
            self.early.append(key)
            return
        self.commits.setdefault(key, []).append(tensor)
        super().resolve_tensor(read_item).copy_(tensor)


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr())


@spec("CONF-49", title="read_data calls planner.commit_tensor for every tensor it fills")
def commits_every_tensor(ctx: Context) -> None:
    gen = torch.Generator().manual_seed(49)
    sd: dict[str, Any] = {
        "w": finite_tensor((6, 5), torch.float32, gen),
        "ids": rand_tensor((9,), torch.int64, gen),
        "half": finite_tensor((4, 4), torch.bfloat16, gen),
    }
    loc = ctx.location()
    (truth,) = save_at(ctx, loc, [sd])
    planner = RecordingPlanner()
    dest = blank_dest(truth)
    load_ranks([ctx.backend.reader(loc)], [dest], checkpoint_id=loc, planners=[planner])
    if planner.early:
        raise CheckFailed(
            f"CONF-49: read_data called commit_tensor for {planner.early[:3]} before "
            "resolve_tensor returned the tensor to fill"
        )
    missing = [_key(i) for i in planner.items if _key(i) not in planner.commits]
    if missing:
        raise CheckFailed(
            f"CONF-49: read_data never called planner.commit_tensor for {len(missing)} of "
            f"{len(planner.items)} tensor read items (first: {missing[:3]})"
        )
    for key, calls in planner.commits.items():
        if len(calls) != 1:
            raise CheckFailed(
                f"CONF-49: read_data called commit_tensor {len(calls)} times for {key}"
            )
        temp = planner.temps[key]
        if not _same_storage(calls[0], temp):
            raise CheckFailed(
                f"CONF-49: commit_tensor for {key} received a tensor other than the one "
                "resolve_tensor returned (a different storage)"
            )
        if bits(calls[0]) != bits(temp):
            raise CheckFailed(f"CONF-49: the tensor committed for {key} is not the one filled")
    assert_same(dest, truth, "CONF-49")
