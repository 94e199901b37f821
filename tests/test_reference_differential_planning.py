"""The reference planners and rules against refdcp's (REF-3, REF-4): the dedup's problems for
plans that list a key twice or hold an object and a tensor under one key, the loads its
decision records name against the bytes the fast plans give each rank, the ranks the metadata
problems name, the planner data merged from every rank, replica checksums of objects, object
bytes handed out from their start, the same refusals (a reserved key, a chunk no value holds,
a load without metadata) and nested objects placed at the same moment.

Each case runs once per path and compares; the reference-only checks of the same behaviour are
in test_mut_reference_{dedup,metadata,save_planner,load_planner,sharded}.py.
"""

from __future__ import annotations

import dataclasses
import io
import random
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, SavePlan, WriteItem

import refdcp
import refdcp.reference
from refdcp.comm import FakeWorld, SingleRank
from refdcp.planning import DefaultLoadPlanner, DefaultSavePlanner, PlanValidationError
from refdcp.planning.dedup.classes import dedup_items
from refdcp.planning.flatten import RESERVED_KEY
from refdcp.planning.local_plan import chunk_nbytes
from refdcp.planning.metadata.build import build_state_dict_metadata
from refdcp.reference import ReferenceReader
from refdcp.reference.dedup import reference_dedup
from refdcp.reference.load_planner import ReferenceLoadPlanner
from refdcp.reference.metadata import build_metadata
from refdcp.reference.save_planner import ReferenceSavePlanner

from .test_mut_reference_sharded import one_rank_group, sharded
from .test_planning_dedup_reference import worlds
from .test_planning_metadata_reference import global_plans

__all__ = ["one_rank_group"]  # the fixture, used by name

PATHS: dict[str, Any] = {"fast": refdcp, "reference": refdcp.reference}
SAVE_PLANNERS: dict[str, Any] = {"fast": DefaultSavePlanner, "reference": ReferenceSavePlanner}
LOAD_PLANNERS: dict[str, Any] = {"fast": DefaultLoadPlanner, "reference": ReferenceLoadPlanner}


@st.composite
def damaged_worlds(draw: st.DrawFn) -> dict[str, Any]:
    """`worlds()` as a custom planner may damage them: a rank listing items twice, a rank
    holding a tensor under the key (no offsets) another rank holds an object under."""
    case: dict[str, Any] = draw(worlds())
    rng = random.Random(draw(st.integers(0, 10**6)))
    plans = [list(p) for p in case["plans"]]
    tensors = [i for p in plans for i in p if i.tensor_data is not None]
    for plan in plans:
        for n, item in enumerate(plan):
            if item.tensor_data is None and tensors and rng.random() < 0.15:
                plan[n] = dataclasses.replace(
                    rng.choice(tensors), index=MetadataIndex(item.index.fqn)
                )
        if plan and rng.random() < 0.3:
            for _ in range(rng.randint(1, 3)):
                plan.insert(rng.randrange(len(plan) + 1), rng.choice(plan))
    case["plans"] = plans
    return case


def _key(item: WriteItem) -> tuple[str, tuple[int, ...]]:
    return (item.index.fqn, tuple(int(o) for o in (item.index.offset or ())))


@pytest.mark.spec("DEDUP-9", "DEDUP-10", "DEDUP-15", "DEDUP-4")
@settings(max_examples=200)  # cheap examples; a world damaged both ways needs many
@given(damaged_worlds())
def test_dedup_problems_and_recorded_loads_equal_the_fast_dedup(case: dict[str, Any]) -> None:
    """The same plans and problems (every duplicate listing, every object beside a tensor under
    one key, worded alike); each "fewest bytes" record names, for every holder, the bytes the
    fast plans give that rank before the item: its unreplicated items and those decided
    earlier."""
    fast = dedup_items(**case)
    kept, problems, decisions = reference_dedup(**case)
    assert fast.problems == problems
    assert fast.plans == kept
    if problems:
        return
    decided = {(d.fqn, d.offsets) for d in decisions}
    before: set[tuple[str, tuple[int, ...]]] = set()
    for d in decisions:
        named = dict(re.findall(r"r(\d+)=(\d+)", d.reason.split("; ", 1)[-1]))
        if "fewest bytes" in d.reason:
            for r in d.holders:
                load = sum(
                    chunk_nbytes(i)
                    for i in fast.plans[r]
                    if _key(i) not in decided or _key(i) in before
                )
                assert int(named[str(r)]) == load
        before.add((d.fqn, d.offsets))


def _named_ranks(problems: list[str]) -> dict[str, set[int]]:
    """The ranks each key's problems name."""
    out: dict[str, set[int]] = {}
    for p in problems:
        fqn = p.split("'")[1]
        ranks = out.setdefault(fqn, set())
        for group in re.findall(r"\branks \[([\d, ]*)\]", p):
            ranks.update(int(r) for r in group.split(",") if r.strip())
        ranks.update(int(r) for r in re.findall(r"\brank (\d+)\b", p))
    return out


@pytest.mark.spec("META-6", "META-5", "REF-3")
@settings(max_examples=200)  # cheap examples; rare shapes need many
@given(global_plans())
def test_metadata_problems_name_the_ranks_the_fast_check_names(
    case: tuple[list[list[WriteItem]], dict[str, Any]],
) -> None:
    """Every rank the fast check names for a key (the ranks of the items at fault) is among
    those the reference names for it (every rank holding the key); equal metadata when fine."""
    plans, without_chunks = case
    fast_md, fast_problems = build_state_dict_metadata(plans, without_chunks)
    ref_md, ref_problems = build_metadata(plans, without_chunks)
    fast_named, ref_named = _named_ranks(fast_problems), _named_ranks(ref_problems)
    assert set(fast_named) == set(ref_named)
    for fqn, ranks in fast_named.items():
        assert ranks <= ref_named[fqn], (fqn, fast_problems, ref_problems)
    if not ref_problems:
        assert fast_md == ref_md


def _save_outcome(api: Any, sds: list[dict[str, Any]], where: Path) -> Any:
    try:
        md = FakeWorld(len(sds)).run(lambda c: api.save(sds[c.rank], checkpoint_id=where, comm=c))
    except refdcp.CheckpointError as exc:
        return sorted(
            (r, type(f.exception).__name__, tuple(getattr(f.exception, "problems", ())))
            for r, f in exc.rank_failures.items()
        )
    return md[0].planner_data


_REPLICAS: dict[str, tuple[Any, Any]] = {
    "equal ints": (3, 3),
    "ints": (3, 4),
    "strings": ("a", "b"),
    "sets": ({1, 2}, {1, 3}),
    "equal sets": ({1, 2, 3}, {3, 2, 1}),
    "frozensets": (frozenset({1}), frozenset({2})),
    "dicts in a tuple": (({"a": 1},), ({"a": 2},)),  # a tuple holding a dict is one value
    "equal dicts in a tuple": (({"a": 1, "b": 2},), ({"b": 2, "a": 1},)),
    "tuples": ((1, 2), (1, 3)),
}


@pytest.mark.spec("REF-3", "DEDUP-6", "DEDUP-13")
@pytest.mark.parametrize("case", sorted(_REPLICAS))
def test_replicas_of_objects_fail_or_pass_alike(case: str, tmp_path: Path) -> None:
    """Two ranks holding one key: the same problems, checksums included, or the same
    planner data."""
    a, b = _REPLICAS[case]
    sds = [{"k": a, "w": torch.ones(2)}, {"k": b, "w": torch.ones(2)}]
    got = {impl: _save_outcome(api, sds, tmp_path / impl) for impl, api in PATHS.items()}
    assert got["fast"] == got["reference"]
    assert isinstance(got["fast"], dict) == case.startswith("equal")


@pytest.mark.spec("REF-3", "FLAT-6", "FLAT-2")
def test_planner_data_merged_from_every_rank_equals_the_fast_planners(tmp_path: Path) -> None:
    """Ranks with keys of their own, nested through lists and tuples, and empty containers,
    some on every rank."""

    def sd(r: int) -> dict[str, Any]:
        return {
            "w": torch.ones(2),
            "cfg": {"lr": [0.1, (1, "x")], "none": []},
            f"own{r}": {"k": [r, {"z": ()}], "e": {}, 7: (r, "t")},
            "shared_empty": {},
        }

    got = {
        impl: _save_outcome(api, [sd(r) for r in range(3)], tmp_path / impl)
        for impl, api in PATHS.items()
    }
    assert got["fast"] == got["reference"]
    record = got["fast"][RESERVED_KEY]
    assert record["rich"] and record["empties"]


def _planner(impl: str, sd: dict[str, Any]) -> Any:
    planner = SAVE_PLANNERS[impl]()
    planner.set_up_planner(sd, None, True)
    return planner


def _outcome(run: Any) -> Any:
    try:
        run()
    except Exception as exc:  # the class is what is compared
        return type(exc).__name__
    return "ok"


@pytest.mark.spec("REF-3", "PLAN-6")
def test_both_planners_hand_out_an_object_s_bytes_from_their_start() -> None:
    sd = {"o": "a string", "w": torch.ones(2)}
    got = {}
    for impl in PATHS:
        planner = _planner(impl, sd)
        item = next(i for i in planner.create_local_plan().items if i.index.fqn == "o")
        data = planner.resolve_data(item)
        got[impl] = torch.load(io.BytesIO(data.read()), weights_only=True)
    assert got["fast"] == got["reference"] == sd["o"]


@pytest.mark.spec("REF-3", "PLAN-1", "PLAN-6")
def test_both_planners_refuse_a_chunk_of_an_object() -> None:
    """A tensor item whose key holds an object (a custom planner's item)."""
    sd = {"o": "text", "w": torch.ones(2)}
    got = {}
    for impl in PATHS:
        planner = _planner(impl, sd)
        (w,) = [i for i in planner.create_local_plan().items if i.index.fqn == "w"]
        bad = dataclasses.replace(w, index=MetadataIndex("o", w.index.offset))
        got[impl] = _outcome(lambda planner=planner, bad=bad: planner.resolve_data(bad))
    assert got["fast"] == got["reference"] != "ok"


@pytest.mark.spec("REF-3", "PLAN-1", "PLAN-6")
@pytest.mark.usefixtures("one_rank_group")
def test_both_planners_refuse_a_shard_this_rank_does_not_hold() -> None:
    sd = {"s": sharded([(0, 2)], width=1)}
    got = {}
    for impl in PATHS:
        planner = _planner(impl, sd)
        item = planner.create_local_plan().items[0]
        bad = dataclasses.replace(item, index=MetadataIndex("s", torch.Size([2, 0])))
        got[impl] = _outcome(lambda planner=planner, bad=bad: planner.resolve_data(bad))
    assert got["fast"] == got["reference"] != "ok"


@pytest.mark.spec("REF-3", "FLAT-6")
def test_both_coordinators_refuse_the_reserved_key_in_a_plan_they_are_sent() -> None:
    got = {}
    for impl in PATHS:
        planner = _planner(impl, {"w": torch.ones(2)})
        plan = planner.create_local_plan()
        (item,) = plan.items
        bad = dataclasses.replace(item, index=MetadataIndex(RESERVED_KEY, item.index.offset))
        try:
            planner.create_global_plan([SavePlan([bad], planner_data=plan.planner_data)])
            got[impl] = "ok"
        except PlanValidationError as exc:
            got[impl] = [RESERVED_KEY in p and "reserved" in p for p in exc.problems]
    assert got["fast"] == got["reference"] == [True]


def _saved(tmp_path: Path, sd: dict[str, Any]) -> Metadata:
    refdcp.save(sd, checkpoint_id=tmp_path, comm=SingleRank())
    return ReferenceReader(tmp_path).read_metadata()


@pytest.mark.spec("REF-3", "LOAD-19", "PLAN-7")
@pytest.mark.parametrize("defer", [None, False, True])
def test_both_load_planners_place_objects_at_the_same_moment(
    defer: bool | None, tmp_path: Path
) -> None:
    """The planners alone (no driver): an object at depth 1, 2 and 3, placed as it is read or,
    nested and deferred, only when the load applies; `None` leaves the planner's default."""
    saved = {"top": 1, "cfg": {"lr": 2, "deep": {"x": 3}}}
    md = _saved(tmp_path, saved)
    got = {}
    for impl in PATHS:
        sd: dict[str, Any] = {"top": 0, "cfg": {"lr": 0, "deep": {"x": 0}}}
        planner = LOAD_PLANNERS[impl]()
        planner.set_up_planner(sd, md, True)
        if defer is not None:
            planner.defer_nested_values = defer
        reader = ReferenceReader(tmp_path)
        reader.set_up_storage_reader(md, True)
        steps = []
        for item in planner.create_local_plan().items:
            assert item.type == LoadItemType.BYTE_IO
            blob = reader._read_item(item.storage_index)
            planner.load_bytes(item, io.BytesIO(blob))
            steps.append((item.dest_index.fqn, repr(sd)))
        planner.apply_loaded_values()
        got[impl] = (steps, repr(sd))
    assert got["fast"] == got["reference"]
    assert got["fast"][1] == repr(saved)


@pytest.mark.spec("REF-3", "LOAD-1")
def test_both_load_planners_need_the_metadata() -> None:
    got = {
        impl: _outcome(lambda impl=impl: LOAD_PLANNERS[impl]().set_up_planner({"w": 1}, None, True))
        for impl in PATHS
    }
    assert got["fast"] == got["reference"] == "ValueError"
