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
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch.distributed.checkpoint as tdcp
from torch.distributed.checkpoint import staging as tstaging
from torch.distributed.checkpoint.planner import LoadPlanner, SavePlanner
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter

import refdcp

#: (name, torch object) pairs: ``impl.<name>`` is documented as a drop-in for the torch object
DROP_INS: list[tuple[str, Any]] = [
    ("save", tdcp.save),
    ("load", tdcp.load),
    ("async_save", tdcp.async_save),
    ("DefaultSavePlanner", tdcp.DefaultSavePlanner),
    ("DefaultLoadPlanner", tdcp.DefaultLoadPlanner),
    ("FileSystemWriter", tdcp.FileSystemWriter),
    ("FileSystemReader", tdcp.FileSystemReader),
    ("CpuStager", tstaging.BlockingAsyncStager),
]

#: shared parameters whose default differs on purpose: (name, param) -> reason
DIFFERENT_DEFAULTS = {
    # torch's enum default, refdcp's None meaning "executor=" decides (default 'thread')
    ("async_save", "async_checkpointer_type"): "None defers to executor= (default 'thread')",
    # None means TORCH_SAVE, the only format refdcp writes
    ("FileSystemWriter", "serialization_format"): "None means TORCH_SAVE",
}

#: torch's ABCs and the names of the classes implementing them: their methods must match too
ABC_METHODS: list[tuple[str, type]] = [
    ("DefaultSavePlanner", SavePlanner),
    ("DefaultLoadPlanner", LoadPlanner),
    ("FileSystemWriter", StorageWriter),
    ("FileSystemReader", StorageReader),
    ("CpuStager", tstaging.AsyncStager),
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


#: the reference's own classes keep their own keyword options; their methods take torch's
#: parameters (REF-17's table; test_abc_methods_take_torchs_parameters checks them)
REFERENCE_OWN_OPTIONS = {
    "DefaultSavePlanner",
    "DefaultLoadPlanner",
    "FileSystemWriter",
    "FileSystemReader",
}
SIGNATURE_CASES = [
    pytest.param(which, name, theirs, id=f"{which}-{name}")
    for which in ("refdcp", "reference")
    for name, theirs in DROP_INS
    if not (which == "reference" and name in REFERENCE_OWN_OPTIONS)
]


@pytest.mark.spec("API-10", "REF-17")
@pytest.mark.parametrize("which,name,theirs", SIGNATURE_CASES)
def test_drop_in_takes_torchs_parameters(which: str, name: str, theirs: Any) -> None:
    impl = refdcp if which == "refdcp" else refdcp.reference
    assert signature_problems(name, getattr(impl, name), theirs) == []
    spec = (Path(refdcp.__file__).parents[1] / "spec" / "reference.md").read_text(encoding="utf-8")
    assert all(f"`{n}`" in spec for n in REFERENCE_OWN_OPTIONS)  # the difference is stated


@pytest.mark.spec("API-10")
@pytest.mark.parametrize("name,abc", ABC_METHODS, ids=[c[0] for c in ABC_METHODS])
def test_abc_methods_take_torchs_parameters(impl: ModuleType, name: str, abc: type) -> None:
    cls = getattr(impl, name)
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
    # single path: checks the default planner's policy attribute
    # torch: DefaultLoadPlanner(flatten_state_dict, flatten_sharded_tensors, allow_partial_load)
    strict = refdcp.DefaultLoadPlanner(True, True)
    assert strict.policy.strict
    partial = refdcp.DefaultLoadPlanner(True, True, True)
    assert not partial.policy.strict
    with pytest.raises(TypeError):
        refdcp.DefaultLoadPlanner(True, True, False, True)  # type: ignore[misc]


@pytest.mark.spec("API-10")
def test_save_planner_accepts_torchs_positionals() -> None:
    # single path: checks the default planner's flags and its FutureWarning
    p = refdcp.DefaultSavePlanner(True, True, None, True, True)
    assert p.dedup_save_to_lowest_rank and p.enable_plan_caching
    with pytest.warns(FutureWarning, match="dedup_replicated_tensors"):
        refdcp.DefaultSavePlanner(dedup_replicated_tensors=True)
    with pytest.raises(TypeError):
        refdcp.DefaultSavePlanner(True, True, None, False, False, True)  # type: ignore[misc]


# -- call forms: what torch accepts, refdcp accepts with the same meaning (API-22) -------------

#: an argument of a call form, by role; ``kw`` names the keyword it takes
_ROLES = ("sd", "storage", "id", "planner")


def _materials(fn: str, lib: Any, root: Any) -> dict[str, Any]:
    import torch

    if fn == "load":
        return {
            "sd": {"w": torch.zeros(2)},
            "storage": lib.FileSystemReader(root / "s"),
            "id": str(root / "c"),
            "planner": lib.DefaultLoadPlanner(),
        }
    return {
        "sd": {"w": torch.full((2,), 7.0)},
        "storage": lib.FileSystemWriter(root / "s"),
        "id": str(root / "c"),
        "planner": lib.DefaultSavePlanner(),
    }


def _keyword(fn: str, role: str) -> str:
    storage = "storage_reader" if fn == "load" else "storage_writer"
    return {"sd": "state_dict", "storage": storage, "id": "checkpoint_id", "planner": "planner"}[
        role
    ]


def _outcome(
    fn: str, lib: Any, root: Any, positional: tuple[str, ...], keywords: tuple[str, ...]
) -> tuple[bool, object, bool]:
    """(accepted, what it did, warned about the argument order) for one call form."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp

    root.mkdir()
    if fn == "load":  # two checkpoints, told apart by their values
        for name, value in (("s", 1.0), ("c", 2.0)):
            dcp.save({"w": torch.full((2,), value)}, checkpoint_id=root / name, no_dist=True)
    m = _materials(fn, lib, root)
    args = [m[r] for r in positional]
    kwargs = {_keyword(fn, r): m[r] for r in keywords} | {"no_dist": True}
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        try:
            result = getattr(lib, fn)(*args, **kwargs)
            if fn == "async_save":
                result.result()
        except (Exception, dcp.api.CheckpointException):  # torch's is a BaseException
            return False, None, False
    warned = any("argument order" in str(w.message) for w in seen)
    if fn == "load":
        dest = kwargs.get("state_dict", args[0] if args else None)
        return True, float(dest["w"][0]), warned
    return True, sorted(p.parent.name for p in root.glob("*/.metadata")), warned


@pytest.mark.spec("API-22", "API-10")
@pytest.mark.parametrize("fn", ["save", "load", "async_save"])
def test_call_forms_torch_accepts_refdcp_accepts_with_the_same_meaning(
    impl: ModuleType, fn: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    from hypothesis import example, given, settings
    from hypothesis import strategies as st

    # half the profile's examples (ci 12, thorough 200): the test runs once per implementation
    @settings(max_examples=max(5, settings().max_examples // 2), deadline=None)
    @given(
        positional=st.lists(st.sampled_from(_ROLES), max_size=3).map(tuple),
        keywords=st.sets(st.sampled_from(_ROLES)).map(lambda s: tuple(sorted(s))),
    )
    @example(positional=("sd", "storage"), keywords=())  # torch's older form
    @example(positional=("sd", "storage"), keywords=("planner",))
    @example(positional=("sd", "storage"), keywords=("id", "planner"))
    @example(positional=("sd", "storage"), keywords=("storage",))  # given twice
    @example(positional=("sd", "storage", "planner"), keywords=())
    @example(positional=("sd",), keywords=("storage", "planner"))
    @example(positional=(), keywords=("id", "sd"))
    @example(positional=("sd",), keywords=("id", "storage"))
    def check(positional: tuple[str, ...], keywords: tuple[str, ...]) -> None:
        import torch.distributed.checkpoint as dcp

        base = tmp_path_factory.mktemp(fn)
        theirs = _outcome(fn, dcp, base / "torch", positional, keywords)
        ours = _outcome(fn, impl, base / "refdcp", positional, keywords)
        assert ours == theirs, (positional, keywords)

    check()


@pytest.mark.spec("API-22")
def test_the_two_positional_form_maps_to_the_storage_keyword(
    impl: ModuleType, tmp_path: Any
) -> None:
    import torch

    writer = impl.FileSystemWriter(tmp_path)
    with pytest.warns(UserWarning, match="argument order of save has changed"):
        impl.save({"w": torch.ones(3)}, writer, no_dist=True)
    out = {"w": torch.zeros(3)}
    with pytest.warns(UserWarning, match="argument order of load has changed"):
        impl.load(out, impl.FileSystemReader(tmp_path), no_dist=True)
    assert torch.equal(out["w"], torch.ones(3))
    with pytest.raises(TypeError, match="multiple values for argument 'storage_reader'"):
        impl.load(out, impl.FileSystemReader(tmp_path), storage_reader=None, no_dist=True)
    with pytest.raises(TypeError):
        impl.async_save(out, impl.FileSystemWriter(tmp_path), no_dist=True)  # type: ignore[misc]
    assert inspect.signature(impl.save).parameters["state_dict"].kind == (
        inspect.Parameter.POSITIONAL_OR_KEYWORD
    )
