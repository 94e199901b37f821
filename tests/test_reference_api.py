"""``refdcp.reference`` offers ``refdcp``'s public API and behaves the same through it (REF-1).

The reference drives the protocol tables with its own loop and step bodies
(``reference/run.py``); these tests hold it to the fast path's behaviour where
a user can see it: the signatures and torch's call forms, ``no_dist``, the
observer's records, the outcome of a fault or a departed rank at every action
of every rank (the same ``CheckpointError`` shape and commit status), a
``finish`` that raises after its commit point, and ``atomic=True``.
"""

from __future__ import annotations

import inspect
import tempfile
import warnings
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.distributed.checkpoint.planner import LoadPlanner, SavePlanner
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter

import refdcp
import refdcp.reference
from refdcp.comm import FakeWorld, SingleRank
from refdcp.errors import CheckpointError, InjectedFault, PeerLost
from refdcp.protocol.outcomes import mark
from tests.test_dropin_signatures import signature_problems

IMPLS: dict[str, ModuleType] = {"fast": refdcp, "reference": refdcp.reference}


def _params(fn: Any) -> list[tuple[str, Any, Any]]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


@pytest.mark.spec("REF-1", "API-1", "API-10")
@pytest.mark.parametrize("name", ["save", "load"])
def test_save_and_load_take_refdcps_parameters_and_torchs(name: str) -> None:
    import torch.distributed.checkpoint as tdcp

    ours = getattr(refdcp.reference, name)
    assert _params(ours) == _params(getattr(refdcp, name))
    assert signature_problems(name, ours, getattr(tdcp, name)) == []


@pytest.mark.spec("REF-1", "API-10")
@pytest.mark.parametrize(
    "alias,abc",
    [
        ("DefaultSavePlanner", SavePlanner),
        ("DefaultLoadPlanner", LoadPlanner),
        ("FileSystemWriter", StorageWriter),
        ("FileSystemReader", StorageReader),
    ],
)
def test_the_torch_names_are_the_reference_classes(alias: str, abc: type) -> None:
    cls = getattr(refdcp.reference, alias)
    assert cls.__module__.startswith("refdcp.reference.") and issubclass(cls, abc)
    methods = [n for n, v in vars(abc).items() if callable(v) and not n.startswith("_")]
    problems = [p for m in methods for p in signature_problems(m, getattr(cls, m), getattr(abc, m))]
    assert problems == []


@pytest.mark.spec("REF-1")
def test_the_error_classes_are_refdcps() -> None:
    for name in ("CheckpointError", "CommError", "CommTimeout", "CommAborted", "ProtocolError"):
        assert getattr(refdcp.reference, name) is getattr(refdcp, name)
    assert refdcp.reference.CorruptionError is refdcp.CorruptionError


def _call_forms(impl: ModuleType, path: Path) -> list[Any]:
    """What each of torch's call forms does: a warning's text, a TypeError, or a result."""
    sd = {"w": torch.arange(4.0)}
    seen: list[Any] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        frame = inspect.currentframe()
        line = (frame.f_lineno if frame else 0) + 1  # the warning names this very line
        impl.save(sd, impl.FileSystemWriter(path), no_dist=True)
        out = {"w": torch.zeros(4)}
        impl.load(out, impl.FileSystemReader(path), no_dist=True)
        seen.append(torch.equal(out["w"], sd["w"]))
        impl.load(state_dict=out, storage_reader=impl.FileSystemReader(path), no_dist=True)
    seen.append(sorted("argument order" in str(w.message) for w in caught))
    where = [(w.filename, w.lineno) for w in caught if "argument order" in str(w.message)]
    seen.append(where[0] == (__file__, line) and {f for f, _ in where} == {__file__})
    for bad in (
        lambda: impl.save(sd, impl.FileSystemWriter(path), None),
        lambda: impl.load(out, impl.FileSystemReader(path), storage_reader=None),
        lambda: impl.save(sd, impl.FileSystemWriter(path), storage_writer=None),
    ):
        with pytest.raises(TypeError) as info, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            bad()
        seen.append("storage" in str(info.value) or "positional" in str(info.value))
    return seen


@pytest.mark.spec("REF-1", "API-22")
def test_torchs_call_forms_mean_the_same(tmp_path: Path) -> None:
    got = {name: _call_forms(impl, tmp_path / name) for name, impl in IMPLS.items()}
    assert got["reference"] == got["fast"] == [True, [True, True], True, True, True, True]


@pytest.mark.spec("REF-1", "API-4")
def test_no_dist_runs_one_rank_without_the_warning(impl: ModuleType, tmp_path: Path) -> None:
    sd = {"w": torch.ones(3)}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no_dist=True says it is meant: no warning
        impl.save(sd, checkpoint_id=tmp_path, no_dist=True)
        impl.load({"w": torch.zeros(3)}, checkpoint_id=tmp_path, no_dist=True)
    with pytest.warns(UserWarning, match="not initialized") as caught:
        impl.load({"w": torch.zeros(3)}, checkpoint_id=tmp_path)
    if impl is refdcp.reference:  # it names the caller's line (refdcp's names its call_forms)
        assert caught[0].filename == __file__


def _state(rank: int, world: int, zeros: bool = False) -> dict[str, Any]:
    table = torch.arange(24.0).reshape(6, 4) * (0 if zeros else 1)
    rows = -(-6 // world)
    lo, hi = min(rank * rows, 6), min(rank * rows + rows, 6)
    return {
        "w": torch.full((3,), 0.0 if zeros else 2.0),
        "rows": refdcp.LocalShards((6, 4), [((lo, 0), table[lo:hi].clone())], dtype=torch.float32),
        "opt": {"step": 0 if zeros else 5, "lr": [0.0 if zeros else 0.1]},
    }


def _outcome(result: Any) -> Any:
    """What a user sees of a rank's call: the error's shape, or that it returned."""
    if isinstance(result, CheckpointError):
        failures = tuple(
            (r, f.step, type(f.exception).__name__) for r, f in result.rank_failures.items()
        )
        return ("CheckpointError", result.step, result.committed, failures)
    if isinstance(result, BaseException):
        return (type(result).__name__, str(result))
    return ("returned", type(result).__name__)


class _Leave(Exception):
    """Raised by an observer: the rank leaves the protocol after that action."""


def _hooks(rank: int, mode: str, at: int, target: int) -> dict[str, Any]:
    def fault(i: int, action: Any) -> None:
        if mode == "fault" and rank == target and i == at:
            raise InjectedFault(f"fault before action {i}")
        if mode == "interrupt" and rank == target and i == at:  # ERR-10
            raise KeyboardInterrupt(f"interrupted before action {i}")

    def observer(record: Any) -> None:
        if mode == "leave" and rank == target and record.index == at:
            raise _Leave(f"rank {rank} leaves after action {at}")

    return {"fault": fault, "observer": observer}


def _run_save(impl: ModuleType, world: int, path: str, mode: str, at: int, target: int) -> Any:
    def one(c: Any) -> Any:
        hooks = _hooks(c.rank, mode, at, target)
        return impl.save(_state(c.rank, world), checkpoint_id=path, comm=c, **hooks)

    return FakeWorld(world, timeout=20).run(one, return_exceptions=True)


def _run_load(impl: ModuleType, world: int, path: str, mode: str, at: int, target: int) -> Any:
    def one(c: Any) -> Any:
        hooks = _hooks(c.rank, mode, at, target)
        return impl.load(_state(c.rank, world, True), checkpoint_id=path, comm=c, **hooks)

    return FakeWorld(world, timeout=20).run(one, return_exceptions=True)


@pytest.mark.spec(
    "REF-1", "ERR-1", "ERR-10", "PROTO-7", "SAVE-9", "SAVE-15", "COMM-5", "COMM-61", "REF-18"
)
@given(
    world=st.integers(1, 4),
    target=st.integers(0, 3),
    at=st.integers(0, 11),
    mode=st.sampled_from(["fault", "leave", "interrupt"]),
)
def test_a_fault_or_a_departure_at_any_save_action_ends_alike(
    world: int, target: int, at: int, mode: str
) -> None:
    """A fault or an interrupt before, or a rank leaving after, action ``at`` of rank ``target``: every rank's
    outcome (error class, step, commit status, failing ranks and their steps) is the same on
    both paths, and a save that did not commit leaves no file of its own (STORE-31)."""
    got = {}
    for name, impl in IMPLS.items():
        with tempfile.TemporaryDirectory() as path:
            results = _run_save(impl, world, path, mode, at, target % world)
            got[name] = [_outcome(r) for r in results]
            if all(isinstance(r, CheckpointError) and r.committed is False for r in results):
                assert not list(Path(path).iterdir()), name
    assert got["reference"] == got["fast"]


@pytest.mark.spec("REF-1", "ERR-1", "PROTO-7", "LOAD-5", "COMM-5")
@given(
    world=st.integers(1, 4),
    target=st.integers(0, 3),
    at=st.integers(0, 11),
    mode=st.sampled_from(["fault", "leave"]),
)
def test_a_fault_or_a_departure_at_any_load_action_ends_alike(
    world: int, target: int, at: int, mode: str
) -> None:
    with tempfile.TemporaryDirectory() as path:
        FakeWorld(2).run(lambda c: refdcp.save(_state(c.rank, 2), checkpoint_id=path, comm=c))
        got = {
            name: [_outcome(r) for r in _run_load(impl, world, path, mode, at, target % world)]
            for name, impl in IMPLS.items()
        }
    assert got["reference"] == got["fast"]
    if mode == "leave":  # a rank that waited for the departed one names it (COMM-61)
        for error in (r for r in got["reference"] if r[0] == "CheckpointError"):
            assert (target % world, error[1], PeerLost.__name__) in error[3]


#: the slot the last collective of a save and of a load sends
LAST = ("metadata", "apply_outcome")


def _records(impl: ModuleType, path: str, save_world: int, load_world: int) -> list[Any]:
    def save(c: Any) -> list[Any]:
        seen: list[Any] = []
        impl.save(_state(c.rank, save_world), checkpoint_id=path, comm=c, observer=seen.append)
        return seen

    def load(c: Any) -> list[Any]:
        seen: list[Any] = []
        dest = _state(c.rank, load_world, True)
        impl.load(dest, checkpoint_id=path, comm=c, observer=seen.append)
        return seen

    runs = FakeWorld(save_world).run(save) + FakeWorld(load_world).run(load)
    return [[(r.rank, r.index, r.phase, r.kind, r.step, r.outcome) for r in run] for run in runs]


@pytest.mark.spec("REF-1", "PROTO-2", "REF-18")
@pytest.mark.parametrize("save_world,load_world", [(1, 1), (4, 3), (2, 4)])
def test_the_observer_sees_the_same_actions(save_world: int, load_world: int) -> None:
    got = {}
    for name, impl in IMPLS.items():
        with tempfile.TemporaryDirectory() as path:
            got[name] = _records(impl, path, save_world, load_world)
    assert got["reference"] == got["fast"]
    for run in got["reference"]:  # every action up to the last collective, in order
        assert [r[1] for r in run] == list(range(len(run))) and run[-1][4] in LAST


class _FinishRaises(refdcp.reference.FileSystemWriter):
    """Commits, then raises from ``finish`` (a failed directory fsync, say), declaring
    ``status`` when it is not None (SAVE-16)."""

    status: bool | None = None

    def finish(self, metadata: Any, results: Any) -> None:
        super().finish(metadata, results)
        exc = OSError("fsync of the directory failed")
        if self.status is not None:
            mark(exc, self.status)
        raise exc


@pytest.mark.spec("REF-1", "SAVE-16", "SAVE-15")
@pytest.mark.parametrize("status", [None, True])
@pytest.mark.parametrize("world", [1, 3])
def test_a_finish_that_raises_after_committing_reports_the_same_status(
    world: int, status: bool | None, tmp_path: Path
) -> None:
    got = {}
    for name, impl in IMPLS.items():

        def one(c: Any, impl: ModuleType = impl, name: str = name) -> Any:
            writer = _FinishRaises(tmp_path / name)
            writer.status = status
            return impl.save(_state(c.rank, world), storage_writer=writer, comm=c)

        got[name] = [_outcome(r) for r in FakeWorld(world).run(one, return_exceptions=True)]
    assert got["reference"] == got["fast"]
    # committed or maybe committed: the reference keeps the files and the checkpoint loads (REF-8).
    # (refdcp.save calls the writer's abort_save whatever the status, which removes them here.)
    dest = _state(0, 1, True)
    refdcp.reference.load(dest, checkpoint_id=tmp_path / "reference", no_dist=True)
    assert dest["opt"] == {"step": 5, "lr": [0.1]}
    assert {o[2] for o in got["reference"]} == {status}


class _Interrupts:
    """A ``Stateful`` whose ``state_dict`` is interrupted (Ctrl-C during set_up)."""

    def state_dict(self) -> dict[str, Any]:
        raise KeyboardInterrupt("interrupted in state_dict")

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        raise AssertionError("never applied")


@pytest.mark.spec("REF-1", "ERR-10")
@pytest.mark.parametrize("world,target", [(1, 0), (3, 0), (3, 2)])
def test_an_interrupted_step_reaches_the_peers_then_the_caller(world: int, target: int) -> None:
    got = {}
    for name, impl in IMPLS.items():
        with tempfile.TemporaryDirectory() as path:

            def one(c: Any, impl: ModuleType = impl, path: str = path) -> Any:
                sd = _state(c.rank, world)
                if c.rank == target:
                    sd["x"] = _Interrupts()
                return impl.save(sd, checkpoint_id=path, comm=c)

            got[name] = [_outcome(r) for r in FakeWorld(world).run(one, return_exceptions=True)]
    assert got["reference"] == got["fast"]
    assert got["reference"][target][0] == "KeyboardInterrupt"


class _Counter:
    """A ``Stateful`` with a tensor and a count; ``fail`` refuses every load."""

    def __init__(self, fail: bool = False) -> None:
        self.t = torch.full((4,), -7.0)
        self.count = 0
        self.fail = fail

    def state_dict(self) -> dict[str, Any]:
        return {"t": self.t, "count": self.count}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        if self.fail:
            raise RuntimeError("refused")
        self.t.copy_(sd["t"])
        self.count = sd["count"]


def _dest(rank: int, world: int, fail: bool) -> dict[str, Any]:
    sd = _state(rank, world, True)
    sd["w"].fill_(-1.0)
    sd["rows"].chunks[0][1].fill_(-3.0)
    sd["a"] = _Counter()
    sd["b"] = _Counter(fail)
    return sd


def _snapshot(sd: dict[str, Any]) -> Any:
    return (
        sd["w"].clone(),
        sd["rows"].chunks[0][1].clone(),
        repr(sd["opt"]),
        sd["a"].t.clone(),
        sd["a"].count,
        sd["b"].t.clone(),
    )


def _same(a: Any, b: Any) -> bool:
    return all(torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y for x, y in zip(a, b))


@pytest.mark.spec("REF-1", "LOAD-21", "LOAD-6", "REF-20")
@pytest.mark.parametrize("name", ["reference", "fast"])
@given(world=st.integers(1, 3), target=st.integers(0, 2), at=st.integers(0, 10))
def test_an_atomic_load_that_fails_leaves_everything_as_it_was(
    name: str, world: int, target: int, at: int
) -> None:
    """A fault before any action of one rank, or the last rank's second ``Stateful``
    refusing its values (``at == 10``): every destination, container and ``Stateful``
    of every rank that raised as it was, on both paths."""
    impl = IMPLS[name]
    with tempfile.TemporaryDirectory() as path:

        def save(c: Any) -> None:
            sd = _state(c.rank, world)
            sd["a"], sd["b"] = _Counter(), _Counter()
            sd["a"].count = sd["b"].count = 3
            impl.save(sd, checkpoint_id=path, comm=c)

        FakeWorld(world).run(save)
        refuse = at == 10
        dests = [_dest(r, world, refuse and r == world - 1) for r in range(world)]
        before = [_snapshot(d) for d in dests]
        rows = [d["rows"] for d in dests]

        def load(c: Any) -> Any:
            hooks = _hooks(c.rank, "fault" if not refuse else "none", at, target % world)
            return impl.load(dests[c.rank], checkpoint_id=path, comm=c, atomic=True, **hooks)

        results = FakeWorld(world).run(load, return_exceptions=True)
        errors = [r for r in results if isinstance(r, CheckpointError)]
        causes = {type(f.exception).__name__ for e in errors for f in e.rank_failures.values()}
        assert causes == ({"RuntimeError"} if refuse else {"InjectedFault"} if errors else set())
        actions = 11 if target % world == 0 else 10  # a coordinator's load has one more
        assert refuse or at >= actions or isinstance(results[target % world], CheckpointError)
        for r, result in enumerate(results):
            if isinstance(result, CheckpointError):  # this rank raised: all as it was
                assert _same(_snapshot(dests[r]), before[r]) and dests[r]["rows"] is rows[r]
            else:  # it returned: it holds what was saved
                assert dests[r]["a"].count == 3 and dests[r]["opt"]["step"] == 5


@pytest.mark.spec("REF-1", "LOAD-21")
def test_a_plain_load_failing_at_apply_keeps_what_it_applied(impl: ModuleType) -> None:
    """Without ``atomic=True`` the first ``Stateful`` keeps its loaded values: what the
    atomic test restores is the snapshot's doing, not the load's (LOAD-6)."""
    with tempfile.TemporaryDirectory() as path:
        sd = _state(0, 1)
        sd["a"], sd["b"] = _Counter(), _Counter()
        sd["a"].count = 3
        impl.save(sd, checkpoint_id=path, comm=SingleRank())
        dest = _dest(0, 1, True)
        with pytest.raises(CheckpointError):
            impl.load(dest, checkpoint_id=path, comm=SingleRank())
        assert dest["a"].count == 3


@pytest.mark.spec("REF-1", "REF-17", "ONCE-6")
@pytest.mark.parametrize("read_once", [True, False, "auto", None])
def test_read_once_loads_the_same_values(read_once: Any, tmp_path: Path) -> None:
    """``read_once`` is a speed knob: the reference checks it and loads what the fast path
    loads with it (REF-17)."""
    FakeWorld(2).run(lambda c: refdcp.save(_state(c.rank, 2), checkpoint_id=tmp_path, comm=c))
    got = {}
    for name, impl in IMPLS.items():

        def one(c: Any, impl: ModuleType = impl) -> Any:
            dest = _state(c.rank, 3, True)
            impl.load(dest, checkpoint_id=tmp_path, comm=c, read_once=read_once)
            return repr(dest), dest["rows"].chunks[0][1].tolist()

        got[name] = FakeWorld(3).run(one)
    assert got["reference"] == got["fast"]
    for impl in IMPLS.values():
        with pytest.raises(ValueError, match="read_once"):
            impl.load(_state(0, 1, True), checkpoint_id=tmp_path, no_dist=True, read_once="x")


@pytest.mark.spec("REF-17", "API-9")
def test_use_collectives_false_is_refused_by_the_reference(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="use_collectives"):
        refdcp.reference.save({"w": torch.ones(2)}, checkpoint_id=tmp_path, use_collectives=False)
    assert not list(tmp_path.iterdir())


@pytest.mark.spec("REF-17", "API-5")
def test_a_url_needs_a_storage_object_on_the_reference(tmp_path: Path) -> None:
    for call in (refdcp.reference.save, refdcp.reference.load):
        with pytest.raises(ValueError, match="directory"):
            call({"w": torch.ones(2)}, checkpoint_id="memory://x", no_dist=True)


@pytest.mark.spec("REF-17", "STORE-2")
def test_the_reference_writes_one_data_file_per_rank(tmp_path: Path) -> None:
    """Visible difference: file names (``__{rank}_0.{8 hex}.distcp``), loadable by both."""
    import re

    for name, impl in IMPLS.items():
        FakeWorld(3).run(
            lambda c, impl=impl, name=name: impl.save(
                _state(c.rank, 3), checkpoint_id=tmp_path / name, comm=c
            )
        )
    ref = sorted(p.name for p in (tmp_path / "reference").glob("*.distcp"))
    assert [re.fullmatch(r"__(\d)_0\.[0-9a-f]{8}\.distcp", n)[1] for n in ref] == ["0", "1", "2"]  # type: ignore[index]
    fast = [p.name for p in (tmp_path / "fast").glob("*.distcp")]
    assert fast and not any(re.fullmatch(r"__\d_0\.[0-9a-f]{8}\.distcp", n) for n in fast)
    for name, impl in IMPLS.items():  # each loads the other's
        other = tmp_path / ("fast" if name == "reference" else "reference")
        dest = _state(0, 1, True)
        impl.load(dest, checkpoint_id=other, no_dist=True)
        assert dest["opt"] == {"step": 5, "lr": [0.1]} and torch.equal(
            dest["w"], torch.full((3,), 2.0)
        )


@pytest.mark.spec("REF-17", "REF-8", "LOAD-23")
def test_only_the_fast_path_compares_the_metadata_its_ranks_read(tmp_path: Path) -> None:
    """Visible difference: a save committed between two ranks' metadata reads fails a
    ``refdcp.load`` (``CheckpointReplacedError``), while a reference load goes on."""
    import threading

    from refdcp.storage.errors import CheckpointReplacedError

    got = {}
    for name, impl in IMPLS.items():
        path = tmp_path / name
        impl.save({"w": torch.ones(3)}, checkpoint_id=path, no_dist=True)
        read = threading.Event()

        def one(c: Any, impl: ModuleType = impl, path: Path = path, read: Any = read) -> Any:
            def observer(record: Any) -> None:
                if c.rank == 0 and record.index == 0:  # rank 0 has read .metadata: a new save
                    impl.save({"w": torch.full((3,), 2.0)}, checkpoint_id=path, no_dist=True)
                    read.set()

            def fault(i: int, action: Any) -> None:
                if c.rank == 1 and i == 0:
                    assert read.wait(20)  # rank 1 reads it after that save committed

            dest = {"w": torch.zeros(3)}
            impl.load(dest, checkpoint_id=path, comm=c, observer=observer, fault=fault)
            return dest["w"].tolist()

        got[name] = FakeWorld(2).run(one, return_exceptions=True)
    assert all(isinstance(r, CheckpointError) for r in got["fast"])
    cause = got["fast"][0].rank_failures
    assert any(isinstance(f.exception, CheckpointReplacedError) for f in cause.values())
    assert got["reference"] == [[1.0] * 3, [2.0] * 3]  # each rank loaded what it read


@pytest.mark.spec("REF-17", "REF-2", "FMT-3")
def test_the_framing_differs_only_in_the_zip_crc_of_the_data(tmp_path: Path) -> None:
    """Visible difference: a tensor item's data member carries the real zip CRC-32 on the
    reference (``torch.save``'s framing), 0 on the fast path (FMT-3); the data is the same."""
    import io
    import zipfile

    members = {}
    for name, impl in IMPLS.items():
        md = impl.save({"w": torch.arange(5.0)}, checkpoint_id=tmp_path / name, no_dist=True)
        (info,) = md.storage_data.values()
        blob = (tmp_path / name / info.relative_path).read_bytes()
        item = zipfile.ZipFile(io.BytesIO(blob[info.offset : info.offset + info.length]))
        members[name] = {
            i.filename.split("/", 1)[1]: (i.CRC, item.read(i) if i.CRC else None)
            for i in item.infolist()
        }
    data_crc, data = members["reference"]["data/0"]
    assert data == torch.arange(5.0).numpy().tobytes() and data_crc != 0
    assert members["fast"]["data/0"] == (0, None)
    for member in ("data.pkl", "byteorder", "version"):
        assert members["fast"][member] == members["reference"][member]


class _Opaque:
    """A class no allow-list names: it loads only through ``safe_globals``."""

    def __init__(self, n: int = 1) -> None:
        self.n = n

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Opaque) and other.n == self.n

    __hash__ = None  # type: ignore[assignment]


@pytest.mark.spec("REF-1", "LOAD-8", "API-1")
def test_safe_globals_extend_the_reference_planners_allow_list(
    impl: ModuleType, tmp_path: Path
) -> None:
    saver = impl.DefaultSavePlanner(safe_globals=[_Opaque])
    impl.save({"o": _Opaque(3)}, checkpoint_id=tmp_path, no_dist=True, planner=saver)
    with pytest.raises(CheckpointError):  # not allowed: refused
        impl.load({"o": None}, checkpoint_id=tmp_path, no_dist=True)
    planner = impl.DefaultLoadPlanner()
    dest: dict[str, Any] = {"o": None}
    impl.load(dest, checkpoint_id=tmp_path, no_dist=True, safe_globals=[_Opaque], planner=planner)
    assert dest["o"] == _Opaque(3) and _Opaque in planner.safe_globals
    import torch.distributed.checkpoint as tdcp

    plain: dict[str, Any] = {"w": torch.zeros(1)}  # torch's planner, no safe_globals: fine
    impl.save({"w": torch.ones(1)}, checkpoint_id=tmp_path / "w", no_dist=True)
    impl.load(plain, checkpoint_id=tmp_path / "w", no_dist=True, planner=tdcp.DefaultLoadPlanner())
    assert plain["w"].tolist() == [1.0]
    with pytest.raises(ValueError, match="safe_globals"):  # torch's planner unpickles itself
        impl.load(
            dest,
            checkpoint_id=tmp_path,
            no_dist=True,
            safe_globals=[_Opaque],
            planner=tdcp.DefaultLoadPlanner(),
        )


class _OldPlanner(refdcp.reference.DefaultSavePlanner):
    """A planner written before torch added ``storage_meta``."""

    def set_up_planner(self, state_dict: Any, is_coordinator: bool = False) -> None:  # type: ignore[override]
        super().set_up_planner(state_dict, None, is_coordinator)
        self.seen = ("old", is_coordinator)


class _PlainWriter(refdcp.reference.FileSystemWriter):
    """A writer whose ``set_up_storage_writer`` takes no ``**kwargs``: torch 2.13 passes it
    the coordinator flag alone."""

    def set_up_storage_writer(self, is_coordinator: bool) -> None:  # type: ignore[override]
        super().set_up_storage_writer(is_coordinator, rank=-1)
        self.seen = ("plain", is_coordinator)


class _KwargsReader(refdcp.reference.FileSystemReader):
    def set_up_storage_reader(self, metadata: Any, is_coordinator: bool, **kwargs: Any) -> None:
        super().set_up_storage_reader(metadata, is_coordinator)
        self.seen = (is_coordinator, kwargs)


@pytest.mark.spec("REF-1", "API-3", "SAVE-1", "LOAD-1")
def test_planners_and_storage_are_called_as_torch_calls_them(tmp_path: Path) -> None:
    got = {}
    for name, impl in IMPLS.items():

        def one(c: Any, impl: ModuleType = impl, name: str = name) -> Any:
            planner, writer = _OldPlanner(), _PlainWriter(tmp_path / name)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                impl.save({"w": torch.ones(2)}, storage_writer=writer, planner=planner, comm=c)
            reader = _KwargsReader(tmp_path / name)
            dest = {"w": torch.zeros(2)}
            impl.load(dest, storage_reader=reader, comm=c)
            return planner.seen, writer.seen, reader.seen, dest["w"].tolist()

        got[name] = FakeWorld(2).run(one)
    assert got["reference"] == got["fast"]
    assert got["reference"][1] == (
        ("old", False),
        ("plain", False),
        (False, {"rank": 1, "use_collectives": True}),
        [1.0, 1.0],
    )


class _OnePlanTooMany(refdcp.reference.DefaultLoadPlanner):
    def create_global_plan(self, global_plan: list[Any]) -> list[Any]:
        return [*global_plan, global_plan[0]]


@pytest.mark.spec("REF-1", "PROTO-6", "API-23", "API-6")
def test_refusals_at_set_up_and_planning_end_alike(tmp_path: Path) -> None:
    """A global plan step returning the wrong number of plans (PROTO-6), a key missing from
    the checkpoint (named with the checkpoint, API-23), ``verify=True`` with a reader that
    cannot check (API-6): the same outcome on both paths."""
    import torch.distributed.checkpoint as tdcp

    refdcp.save({"w": torch.ones(2)}, checkpoint_id=tmp_path, no_dist=True)
    cases: dict[str, Any] = {
        "PROTO-6": lambda: ({}, {"planner": _OnePlanTooMany()}),
        str(tmp_path): lambda: ({"missing": torch.zeros(1)}, {}),
        "verify=True": lambda: (
            {},
            {"verify": True, "storage_reader": tdcp.FileSystemReader(str(tmp_path))},
        ),
    }
    for expected, case in cases.items():
        got = {}
        for name, impl in IMPLS.items():
            extra, kwargs = case()
            with pytest.raises(CheckpointError) as info:
                impl.load(
                    {"w": torch.zeros(2), **extra},
                    checkpoint_id=tmp_path,
                    comm=SingleRank(),
                    **kwargs,
                )
            got[name] = (_outcome(info.value), str(info.value.rank_failures[0].exception))
        assert got["reference"] == got["fast"]
        assert expected in got["reference"][1]


class _RefusesTwice(_Counter):
    """Takes the loaded state, then refuses the old one when an atomic load restores it."""

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        if self.count:
            raise RuntimeError("refuses its old state")
        super().load_state_dict(sd)


@pytest.mark.spec("REF-1", "LOAD-21")
def test_a_stateful_refusing_its_old_state_is_named_on_the_error(impl: ModuleType) -> None:
    with tempfile.TemporaryDirectory() as path:
        sd = {"a": _Counter(), "b": _Counter()}
        sd["a"].count = 3
        impl.save(sd, checkpoint_id=path, comm=SingleRank())
        dest = {"a": _RefusesTwice(), "b": _Counter(fail=True)}
        with pytest.raises(CheckpointError) as info:
            impl.load(dest, checkpoint_id=path, comm=SingleRank(), atomic=True)
        assert any("restoring 'a' failed" in note for note in info.value.__notes__)
        assert torch.equal(dest["a"].t, torch.full((4,), -7.0))  # its tensor restored anyway


@pytest.mark.spec("REF-5")
def test_the_learner_path_runs_only_the_reference_and_what_it_shares() -> None:
    """One save and one load through the reference, the caller building its state inside the
    trace: modules of ``reference/``, the protocol, the communicators and errors only."""
    from refdcp.tools.learner_path import MAX_CODE_LINES, MAX_MODULES, learner_path

    path = learner_path("reference")
    shared = [p for p in path if p.parts[0] != "reference"]
    assert all(p.parts[0] in ("protocol", "comm") or "errors" in p.name for p in shared), shared
    assert Path("reference/run.py") in path and Path("reference/local_shards.py") in path
    assert len(path) <= MAX_MODULES and sum(path.values()) <= MAX_CODE_LINES


@pytest.mark.spec("PROTO-10", "REF-1")
def test_the_reference_steps_are_exactly_the_tables_steps() -> None:
    from refdcp.protocol import LOAD, SAVE
    from refdcp.reference.run import LoadSteps, SaveSteps

    for steps, table in ((SaveSteps, SAVE), (LoadSteps, LOAD)):
        assert set(steps.HANDLERS) == set(table.steps)
        assert all(handler.__name__ == step.value for step, handler in steps.HANDLERS.items())


@pytest.mark.spec("REF-1", "API-5")
def test_a_storage_object_is_reset_to_the_checkpoint_id(impl: ModuleType, tmp_path: Path) -> None:
    """A storage object and a ``checkpoint_id``: the storage is reset to the id (API-5)."""
    writer = impl.FileSystemWriter(tmp_path / "elsewhere")
    impl.save(
        {"w": torch.ones(2)}, storage_writer=writer, checkpoint_id=tmp_path / "a", no_dist=True
    )
    assert (tmp_path / "a" / ".metadata").exists() and not (tmp_path / "elsewhere").exists()
    dest = {"w": torch.zeros(2)}
    reader = impl.FileSystemReader(tmp_path / "elsewhere")
    impl.load(dest, storage_reader=reader, checkpoint_id=tmp_path / "a", no_dist=True)
    assert dest["w"].tolist() == [1.0, 1.0]


class _Marks(_RefusesTwice):
    """Also writes into a dict of the caller's state dict when it loads."""

    def __init__(self, shared: dict[str, Any]) -> None:
        super().__init__()
        self.shared = shared

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        super().load_state_dict(sd)
        self.shared["marked"] = True


@pytest.mark.spec("REF-1", "LOAD-21")
def test_an_atomic_load_leaves_no_key_it_added(impl: ModuleType) -> None:
    """A container gets exactly its old contents back: a key added during the load is gone."""
    with tempfile.TemporaryDirectory() as path:
        saved = {"a": _Counter(), "b": _Counter(), "shared": {"n": 1}}
        saved["a"].count = 3  # _Marks refuses its old state once it holds this one
        impl.save(saved, checkpoint_id=path, comm=SingleRank())
        shared = {"n": 0}
        dest = {"a": _Marks(shared), "b": _Counter(fail=True), "shared": shared}
        with pytest.raises(CheckpointError):
            impl.load(dest, checkpoint_id=path, comm=SingleRank(), atomic=True)
        assert dest["shared"] is shared and shared == {"n": 0}
