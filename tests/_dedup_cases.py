"""What the dedup property tests draw beside the plans: checksums and options (DEDUP-9, DEDUP-14)."""

from __future__ import annotations

import random
from typing import Any

from hypothesis import strategies as st
from torch.distributed.checkpoint.planner import WriteItem

from refdcp.planning.local_plan import item_key


def checksums_and_options(
    draw: st.DrawFn,
    rng: random.Random,
    plans: list[list[WriteItem]],
    *,
    missing: float,
    values: list[int],
) -> dict[str, Any]:
    """The case for ``dedup_items``/``reference_dedup``: per rank, maybe no checksums (with
    probability ``missing``), else one of ``values`` per item; the options drawn."""
    checksums: list[dict[Any, int] | None] | None = None
    if draw(st.booleans()):
        checksums = [
            None if rng.random() < missing else {item_key(i): rng.choice(values) for i in p}
            for p in plans
        ]
    return {
        "plans": plans,
        "checksums": checksums,
        "coordinator_rank": rng.randrange(len(plans)),
        "bytes_on_coordinator": draw(st.booleans()),
        "lowest_rank": draw(st.booleans()),
    }
