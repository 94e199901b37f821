"""Survivors of the planning full run: the plan cache's replica check and flatten's refusals.

``GlobalPlanCache.replicas_agree`` is called directly here (the save-path tests run it in
FakeWorld's threads, where the mutation runner's line tracing does not follow).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from refdcp.planning.flatten import RESERVED_KEY, flatten_state_dict
from refdcp.planning.plan_cache import GlobalPlanCache

_KEYS = [("w", (0,)), ("w", (4,)), ("b", None)]


def _cache(ref: list[int], cross: dict[tuple[int, ...], list[Any]]) -> GlobalPlanCache:
    # only ``ref`` and ``cross`` are read by replicas_agree
    return GlobalPlanCache(
        all_plans=[],
        fingerprint_ids=[],
        global_plans=[],
        metadata=None,  # type: ignore[arg-type]
        ref=ref,
        cross=cross,
    )


def _model(
    ref: list[int], cross: dict[tuple[int, ...], list[Any]], sums: list[dict[Any, int] | None]
) -> bool:
    """DEDUP-13 as a plain statement: every rank's digests equal its class rep's, and every
    key held across classes has one digest (a missing one counts as differing)."""
    if any(sums[r] != sums[ref[r]] for r in range(len(ref))):
        return False
    for reps, keys in cross.items():
        for k in keys:
            vals = {(sums[r] or {}).get(k) if sums[r] is not None else None for r in reps}
            if len(vals) > 1:
                return False
    return True


@st.composite
def _cases(draw: st.DrawFn) -> tuple[list[int], dict[tuple[int, ...], list[Any]], list[Any]]:
    world = draw(st.integers(1, 4))
    ref: list[int] = []
    for r in range(world):  # each rank is a class rep or a member of an earlier rep's class
        reps_so_far = [q for q in range(r) if ref[q] == q]
        ref.append(draw(st.sampled_from([r, *reps_so_far])))
    reps = [r for r in range(world) if ref[r] == r]
    cross: dict[tuple[int, ...], list[Any]] = {}
    if len(reps) > 1:
        for _ in range(draw(st.integers(0, 2))):
            group = tuple(sorted(draw(st.sets(st.sampled_from(reps), min_size=2))))
            cross.setdefault(group, []).extend(
                draw(st.lists(st.sampled_from(_KEYS), min_size=1, max_size=2, unique=True))
            )
    digest = st.dictionaries(st.sampled_from(_KEYS), st.integers(0, 2), max_size=3)
    base = [draw(digest) for _ in range(world)]
    sums: list[Any] = []
    for r in range(world):
        if draw(st.booleans()):  # usually equal to the rep's, as replicas should be
            sums.append(None if ref[r] == r and draw(st.integers(0, 9)) == 0 else base[ref[r]])
        else:
            sums.append(base[r])
    return ref, cross, sums


@pytest.mark.spec("DEDUP-13")
@settings(max_examples=200)
@given(_cases())
def test_replicas_agree_matches_the_rule(
    case: tuple[list[int], dict[tuple[int, ...], list[Any]], list[Any]],
) -> None:
    ref, cross, sums = case
    # ranks whose rep has no digests copy None too: equal, so agreeing
    sums = [sums[ref[r]] if sums[ref[r]] is None else sums[r] for r in range(len(ref))]
    assert bool(_cache(ref, cross).replicas_agree(sums)) == _model(ref, cross, sums)


@pytest.mark.spec("DEDUP-13")
@pytest.mark.parametrize("value", [0, 7])
def test_a_rank_differing_from_its_class_rep_disagrees(value: int) -> None:
    """Ranks 0 and 1 are one class; rank 1's digest of 'w' differs (or matches)."""
    key = ("w", (0,))
    sums = [{key: 7}, {key: value}, {("b", None): 1}]
    agree = _cache([0, 0, 2], {}).replicas_agree(sums)
    assert bool(agree) == (value == 7)


@pytest.mark.spec("DEDUP-13")
@pytest.mark.parametrize("third", [3, 4, None])
def test_a_key_held_across_classes_with_two_digests_disagrees(third: int | None) -> None:
    """Three classes (reps 0, 1, 2) hold 'w' at offset 4; the third's digest differs, matches,
    or is missing (a digest present on one holder only also sends the save down the full path)."""
    key = ("w", (4,))
    sums: list[dict[Any, int] | None] = [{key: 3}, {key: 3}, {} if third is None else {key: third}]
    agree = _cache([0, 1, 2], {(0, 1, 2): [key]}).replicas_agree(sums)
    assert bool(agree) == (third == 3)


@pytest.mark.spec("FLAT-1")
@pytest.mark.parametrize("bad", [[torch.ones(2)], (1, 2), "w", 3, None])
def test_flatten_refuses_a_state_dict_that_is_not_a_mapping(bad: Any) -> None:
    with pytest.raises(TypeError, match="a state_dict must be a mapping"):
        flatten_state_dict(bad)


@pytest.mark.spec("FLAT-6", "FLAT-1")
@pytest.mark.parametrize("value", [torch.ones(2), 3, "text"], ids=str)
def test_flatten_refuses_the_reserved_key_as_a_top_level_fqn(value: Any) -> None:
    """A top-level tensor (the fast path) or any other value under the reserved key is refused;
    the same state dict under another key flattens to that FQN (FLAT-1)."""
    with pytest.raises(ValueError, match="reserved"):
        flatten_state_dict({"a": torch.zeros(1), RESERVED_KEY: value})
    flat = flatten_state_dict({"a": torch.zeros(1), "x": value})
    assert "a" in flat.items and any(k == "x" or k.startswith("x.") for k in flat.items)
    assert RESERVED_KEY not in flat.items
