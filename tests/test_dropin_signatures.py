"""Every refdcp name that is a drop-in for a torch name takes torch's parameters (API-10).

The signatures are compared with ``inspect.signature`` against the installed
torch: each of torch's positional parameters is at the same position under the
same name, refdcp adds positional parameters of its own nowhere (its own
options are keyword-only), every keyword-only parameter of torch exists, and
shared parameters have the same default unless listed below with the reason.
"""

from __future__ import annotations

import enum
import inspect
from collections.abc import Callable
from typing import Any

import pytest
import torch.distributed.checkpoint as tdcp
from torch.distributed.checkpoint import staging as tstaging
from torch.distributed.checkpoint.planner import LoadPlanner, SavePlanner
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter

import refdcp

#: (refdcp object, torch object) pairs refdcp documents as drop-ins
DROP_INS: list[tuple[str, Any, Any]] = [
    ("save", refdcp.save, tdcp.save),
    ("load", refdcp.load, tdcp.load),
    ("async_save", refdcp.async_save, tdcp.async_save),
    ("DefaultSavePlanner", refdcp.DefaultSavePlanner, tdcp.DefaultSavePlanner),
    ("DefaultLoadPlanner", refdcp.DefaultLoadPlanner, tdcp.DefaultLoadPlanner),
    ("FileSystemWriter", refdcp.FileSystemWriter, tdcp.FileSystemWriter),
    ("FileSystemReader", refdcp.FileSystemReader, tdcp.FileSystemReader),
    ("CpuStager", refdcp.CpuStager, tstaging.BlockingAsyncStager),
]

#: shared parameters whose default differs on purpose: (name, param) -> reason
DIFFERENT_DEFAULTS = {
    # torch's enum default, refdcp's None meaning "executor=" decides (default 'thread')
    ("async_save", "async_checkpointer_type"): "None defers to executor= (default 'thread')",
    # None means TORCH_SAVE, the only format refdcp writes
    ("FileSystemWriter", "serialization_format"): "None means TORCH_SAVE",
}

#: torch's ABCs and the refdcp classes implementing them: their methods must match too
ABC_METHODS: list[tuple[type, type]] = [
    (refdcp.DefaultSavePlanner, SavePlanner),
    (refdcp.DefaultLoadPlanner, LoadPlanner),
    (refdcp.FileSystemWriter, StorageWriter),
    (refdcp.FileSystemReader, StorageReader),
    (refdcp.CpuStager, tstaging.AsyncStager),
]

_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def _params(fn: Callable[..., Any]) -> list[inspect.Parameter]:
    return [p for p in inspect.signature(fn).parameters.values() if p.name != "self"]


def signature_problems(
    name: str, ours: Callable[..., Any], theirs: Callable[..., Any]
) -> list[str]:
    """Every way ``ours`` cannot be called like ``theirs``."""
    mine, torch_ = _params(ours), _params(theirs)
    problems: list[str] = []
    pos_mine = [p.name for p in mine if p.kind in _POSITIONAL]
    pos_torch = [p.name for p in torch_ if p.kind in _POSITIONAL]
    if pos_mine != pos_torch:
        problems.append(f"{name}: positional parameters {pos_mine}, torch's are {pos_torch}")
    by_name = {p.name: p for p in mine}
    kinds = {p.kind for p in mine}
    for p in torch_:
        if p.kind == inspect.Parameter.VAR_POSITIONAL or p.kind == inspect.Parameter.VAR_KEYWORD:
            if p.kind not in kinds:
                problems.append(f"{name}: torch takes {p}, refdcp does not")
            continue
        q = by_name.get(p.name)
        if q is None:
            if inspect.Parameter.VAR_KEYWORD not in kinds:
                problems.append(f"{name}: torch's parameter {p.name!r} is missing")
            continue
        if p.kind == inspect.Parameter.KEYWORD_ONLY and q.kind not in (
            inspect.Parameter.KEYWORD_ONLY,
            inspect.Parameter.POSITIONAL_OR_KEYWORD,
        ):
            problems.append(f"{name}: {p.name!r} cannot be passed by keyword")
        if (p.default is inspect.Parameter.empty) != (q.default is inspect.Parameter.empty):
            problems.append(f"{name}: {p.name!r} is required in one and optional in the other")
        elif (name, p.name) not in DIFFERENT_DEFAULTS and not _same_default(p.default, q.default):
            problems.append(
                f"{name}: {p.name!r} defaults to {q.default!r}, torch's to {p.default!r}"
            )
    return problems


def _same_default(a: Any, b: Any) -> bool:
    if isinstance(a, enum.Enum) or isinstance(b, enum.Enum):
        return getattr(a, "value", a) == getattr(b, "value", b)
    return bool(a is b or a == b)


@pytest.mark.spec("API-10")
@pytest.mark.parametrize("name,ours,theirs", DROP_INS, ids=[d[0] for d in DROP_INS])
def test_drop_in_takes_torchs_parameters(name: str, ours: Any, theirs: Any) -> None:
    assert signature_problems(name, ours, theirs) == []


@pytest.mark.spec("API-10")
@pytest.mark.parametrize("cls,abc", ABC_METHODS, ids=[c[0].__name__ for c in ABC_METHODS])
def test_abc_methods_take_torchs_parameters(cls: type, abc: type) -> None:
    problems: list[str] = []
    methods = [n for n, v in vars(abc).items() if callable(v) and not n.startswith("_")]
    assert methods
    for m in methods:
        problems += signature_problems(f"{cls.__name__}.{m}", getattr(cls, m), getattr(abc, m))
    assert problems == []


@pytest.mark.spec("API-10")
def test_the_checker_catches_missing_renamed_and_moved_parameters() -> None:
    def torch_fn(a: int, b: bool = True, c: bool = False, *, d: int = 0) -> None: ...

    def missing(a: int, b: bool = True, *, d: int = 0) -> None: ...

    def renamed(a: int, bb: bool = True, c: bool = False, *, d: int = 0) -> None: ...

    def moved(a: int, c: bool = False, b: bool = True, *, d: int = 0) -> None: ...

    def extra_positional(
        a: int, b: bool = True, x: int = 0, c: bool = False, *, d: int = 0
    ) -> None: ...

    def other_default(a: int, b: bool = False, c: bool = False, *, d: int = 0) -> None: ...

    def fine(a: int, b: bool = True, c: bool = False, *, x: int = 1, d: int = 0) -> None: ...

    for bad in (missing, renamed, moved, extra_positional, other_default):
        assert signature_problems("f", bad, torch_fn), bad.__name__
    assert signature_problems("f", fine, torch_fn) == []


@pytest.mark.spec("API-10")
def test_load_planner_positionals_mean_what_torchs_mean() -> None:
    # torch: DefaultLoadPlanner(flatten_state_dict, flatten_sharded_tensors, allow_partial_load)
    strict = refdcp.DefaultLoadPlanner(True, True)
    assert strict.policy.strict
    partial = refdcp.DefaultLoadPlanner(True, True, True)
    assert not partial.policy.strict
    with pytest.raises(TypeError):
        refdcp.DefaultLoadPlanner(True, True, False, True)  # type: ignore[misc]


@pytest.mark.spec("API-10")
def test_save_planner_accepts_torchs_positionals() -> None:
    p = refdcp.DefaultSavePlanner(True, True, None, True, True)
    assert p.dedup_save_to_lowest_rank and p.enable_plan_caching
    with pytest.warns(FutureWarning, match="dedup_replicated_tensors"):
        refdcp.DefaultSavePlanner(dedup_replicated_tensors=True)
    with pytest.raises(TypeError):
        refdcp.DefaultSavePlanner(True, True, None, False, False, True)  # type: ignore[misc]
