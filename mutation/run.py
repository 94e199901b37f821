"""`make mutation`: mutate the modules that decide correctness, judge each mutant by the
tests that cite the module's spec IDs and ran the mutated line (spec/harness.md, HARN-1..9).

One parent process imports torch, refdcp and every test module once (pytest
collection), then forks one child per mutant: the child patches the mutant in
(``function.__code__`` swap, or re-executed module-level assignments), runs
pytest in-process on the selected tests with ``-x`` and reports the first failing
test. A child that runs past its time limit is killed and the mutant counts as
killed (timeout) once a second run, after every other mutant, with four times the limit also
passes it (HARN-27). Nothing is written to the source tree except the report.

Environment (all optional):
  MUTATION_SAMPLE   mutants to run, sampled per package in proportion (default 200; 0 = all)
  MUTATION_SEED     seed of the sample (default 1)
  MUTATION_MODULES  comma-separated substrings: only modules whose path contains one
  MUTATION_JOBS     children run at once (default 1: the machine has 2 shared cores)
  MUTATION_RERUN    a JSON report: run only the mutants that survived in it (after new tests),
                    and its timeouts that no second, longer run confirmed (HARN-27; not with
                    MUTATION_RERUN_TIMEOUTS=0);
                    with MUTATION_MERGE=1 their new verdicts replace the old ones in that report;
                    with MUTATION_RERUN_SUITES=1 also the reference mutants one suite left alive
  MUTATION_RESUME   a JSON report of an earlier, stopped run of the same source: its judged
                    mutants are kept as they are and only the others are run
  MUTATION_REPORT   where the JSON report goes (default mutation/last-run.json; the
                    Markdown summary goes beside it with the suffix .md)

Speed without changing a verdict (a mutant is killed iff one of its selected tests fails or
the run passes its time limit): the parent freezes its heap for the garbage collector before
forking (a child's collections then skip torch's and the tests' objects), parses each target
module once, and orders each mutant's tests at fork time: tests citing the mutated function's
own IDs first, among them the tests that last killed a mutant of the same function, then of the
same module, then the fastest (HARN-25).

Mutants of the reference path (``[reference]`` in mutation/config.toml) are run twice, against
the tests that run the reference and, separately, against the differential tests that compare it
with the fast path; both verdicts are recorded (HARN-26).
"""

from __future__ import annotations

import ast
import contextlib
import functools
import gc
import importlib
import json
import os
import random
import re
import select
import signal
import subprocess
import sys
import threading
import time
import types
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import tomllib

from mutation.operators import MODULE_STMTS, Mutant, apply_mutant, enumerate_mutants

# Tests run in children forked from this process, which has imported torch. A torch op that
# used OpenMP threads here (a large tensor built at a test module's import, during collection)
# leaves libgomp's thread team behind, and the first parallel op in a forked child then waits
# on threads it does not have, forever. One intra-op thread keeps the forks safe.
os.environ.setdefault("OMP_NUM_THREADS", "1")

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "mutation" / "config.toml"
EQUIVALENT = ROOT / "mutation" / "equivalent.toml"
DEFAULT_REPORT = ROOT / "mutation" / "last-run.json"

_ID = re.compile(r"\b([A-Z][A-Z0-9]*)-(\d+)(?:\.\.(?:\1-)?(\d+))?")


# ---------------------------------------------------------------- spec IDs (HARN-3)


def cited_ids(text: str, known: set[str]) -> set[str]:
    """Spec IDs a piece of source cites; ``DEDUP-1..7`` / ``STAGE-6..STAGE-10`` expand."""
    out: set[str] = set()
    for m in _ID.finditer(text):
        area, lo = m.group(1), int(m.group(2))
        hi = int(m.group(3)) if m.group(3) else lo
        for n in range(lo, min(hi, lo + 50) + 1):
            rid = f"{area}-{n}"
            if rid in known:
                out.add(rid)
    return out


def module_ids(source: str, extra: list[str], known: set[str]) -> set[str]:
    return cited_ids(source, known) | (set(extra) & known)


def scope_ids(
    source: str, tree: ast.Module, scope: str, fallback: set[str], known: set[str]
) -> set[str]:
    """IDs the mutated function/statement (or its class) cites; the module's when none."""
    from mutation.operators import scope_of

    node = scope_of(tree, scope)
    seg = ast.get_source_segment(source, node) or ""
    ids = cited_ids(seg, known)
    if not ids and "." in scope and not scope.startswith("<module>"):
        cls_name = scope.split(".")[0]
        for st in tree.body:
            if isinstance(st, ast.ClassDef) and st.name == cls_name:
                doc = ast.get_docstring(st) or ""
                ids = cited_ids(doc, known)
    return ids or set(fallback)


# ---------------------------------------------------------------- sampling (HARN-4)


def package_of(relpath: str) -> str:
    parts = relpath.split("/")
    return parts[1] if len(parts) > 2 else parts[0]


def sample_mutants(population: list[Mutant], n: int, seed: int) -> list[Mutant]:
    """``n`` mutants drawn per package in proportion to its size; 0 or >= size: all."""
    pop = sorted(population, key=lambda m: (m.file, m.line, m.col, m.op))
    if n <= 0 or n >= len(pop):
        return pop
    rng = random.Random(seed)
    by_pkg: dict[str, list[Mutant]] = defaultdict(list)
    for m in pop:
        by_pkg[package_of(m.file)].append(m)
    out: list[Mutant] = []
    for pkg in sorted(by_pkg):
        group = by_pkg[pkg]
        k = max(1, round(n * len(group) / len(pop)))
        out.extend(rng.sample(group, min(k, len(group))))
    return sorted(out, key=lambda m: (m.file, m.line, m.col, m.op))


# ---------------------------------------------------------------- test collection


@dataclass
class TestInfo:
    nodeid: str
    ids: set[str]
    duration: float = 0.0
    passed: bool = True


class _Collector:
    def __init__(self) -> None:
        self.tests: dict[str, TestInfo] = {}

    def pytest_collection_finish(self, session: Any) -> None:
        for item in session.items:
            ids: set[str] = set()
            for mark in item.iter_markers("spec"):
                ids.update(a for a in mark.args if isinstance(a, str))
            self.tests[item.nodeid] = TestInfo(item.nodeid, ids)


def collect_tests(exclude_markers: list[str]) -> dict[str, TestInfo]:
    import pytest

    col = _Collector()
    expr = " and ".join(f"not {m}" for m in exclude_markers) or "not nothing"
    args = ["--collect-only", "-q", "-p", "no:randomly", "-p", "no:xdist", "-m", expr, "tests"]
    with open(os.devnull, "w") as null:
        old = sys.stdout
        sys.stdout = null
        try:
            rc = pytest.main(args, plugins=[col])
        finally:
            sys.stdout = old
    if rc not in (0, 5):
        raise SystemExit(f"mutation: test collection failed (pytest exit {rc})")
    return {k: v for k, v in col.tests.items() if v.ids}


# ---------------------------------------------------------------- children


def _fork(job: Any, timeout: float) -> tuple[int, int, float, float]:
    """Fork a child that runs ``job()`` and writes its JSON result to a pipe."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        os.close(r)
        os.setpgid(0, 0)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        result: dict[str, Any]
        try:
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, 1)
            os.dup2(null, 2)
            result = job()
        except BaseException as e:  # report, never raise out of a forked child
            result = {"status": "error", "error": f"{type(e).__name__}: {e}"}
        data = json.dumps(result).encode()
        view = memoryview(data)
        while view:
            view = view[os.write(w, view) :]
        os.close(w)
        os._exit(0)
    os.close(w)
    return pid, r, time.monotonic(), timeout


def _finish(pid: int, fd: int, chunks: list[bytes], timed_out: bool) -> dict[str, Any]:
    if timed_out:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
    os.close(fd)
    os.waitpid(pid, 0)
    if timed_out:
        return {"status": "timeout"}
    try:
        res: dict[str, Any] = json.loads(b"".join(chunks).decode() or "{}")
    except json.JSONDecodeError:
        res = {}
    return res or {"status": "error", "error": "the child died without a result"}


def run_jobs(jobs: list[tuple[Any, float]], parallel: int, on_done: Any) -> None:
    """Run ``(job, timeout)`` pairs in forked children, at most ``parallel`` at once."""
    running: dict[int, tuple[int, int, float, float, list[bytes]]] = {}
    try:
        _run_jobs(jobs, parallel, on_done, running)
    except BaseException:  # stopped: no child outlives the run
        for fd, (_, pid, _, _, chunks) in list(running.items()):
            _finish(pid, fd, chunks, True)
        raise


#: a run past its time limit is run again, last, with this many times the limit; only a
#: second timeout counts as a kill, so a machine slowed by other work cannot fake one (HARN-27)
CONFIRM_FACTOR = 4.0


def _run_jobs(
    jobs: list[tuple[Any, float]],
    parallel: int,
    on_done: Any,
    running: dict[int, tuple[int, int, float, float, list[bytes]]],
) -> None:
    pending = list(enumerate(jobs))[::-1]
    first_try: dict[int, float] = {}  # job -> seconds of its first run, which timed out
    while pending or running:
        while pending and len(running) < parallel:
            i, (job, timeout) = pending.pop()
            pid, fd, t0, lim = _fork(job, timeout)
            running[fd] = (i, pid, t0, lim, [])
        now = time.monotonic()
        wait = min(t0 + lim - now for (_, _, t0, lim, _) in running.values())
        ready, _, _ = select.select(list(running), [], [], max(0.0, wait))
        for fd in ready:
            i, pid, t0, lim, chunks = running[fd]
            data = os.read(fd, 1 << 16)
            if data:
                chunks.append(data)
                continue
            del running[fd]
            res = _finish(pid, fd, chunks, False)
            res["seconds"] = round(time.monotonic() - t0 + first_try.get(i, 0.0), 2)
            on_done(i, res)
        now = time.monotonic()
        for fd, (i, pid, t0, lim, chunks) in list(running.items()):
            if now - t0 > lim:
                del running[fd]
                res = _finish(pid, fd, chunks, True)
                if i not in first_try:  # confirm it, after every other job (HARN-27)
                    first_try[i] = now - t0
                    pending.insert(0, (i, (jobs[i][0], lim * CONFIRM_FACTOR)))
                    continue
                res["seconds"] = round(now - t0 + first_try[i], 2)
                on_done(i, res)


class _Outcomes:
    """pytest plugin: outcome and duration of each test; the first failure."""

    def __init__(self) -> None:
        self.failed: list[str] = []
        self.durations: dict[str, float] = {}
        self.current = ""

    def pytest_runtest_logstart(self, nodeid: str, location: Any) -> None:
        self.current = nodeid

    def pytest_runtest_logreport(self, report: Any) -> None:
        self.durations[report.nodeid] = self.durations.get(report.nodeid, 0.0) + report.duration
        if report.failed and report.nodeid not in self.failed:
            self.failed.append(report.nodeid)


def _pytest_args(tests: list[str]) -> list[str]:
    return [
        "-x",
        "-q",
        "-p",
        "no:randomly",
        "-p",
        "no:xdist",
        "-p",
        "no:cacheprovider",
        "-o",
        "timeout=120",
        *tests,
    ]


def baseline_job(tests: list[str], files: set[str]) -> Any:
    """Run every selected test once, unmutated, recording which test ran which target line."""

    def job() -> dict[str, Any]:
        import pytest

        out = _Outcomes()
        hits: dict[str, dict[int, set[str]]] = defaultdict(lambda: defaultdict(set))

        def local(frame: types.FrameType, event: str, arg: Any) -> Any:
            if event == "line":
                hits[frame.f_code.co_filename][frame.f_lineno].add(out.current)
            return local

        def glob(frame: types.FrameType, event: str, arg: Any) -> Any:
            if frame.f_code.co_filename in files:
                hits[frame.f_code.co_filename][frame.f_lineno].add(out.current)
                return local
            return None

        class _Rearm:
            """A test may switch tracing off (refdcp.tools.learner_path traces a save itself):
            every test starts with this run's tracer installed again, so the lines of the tests
            after it are still recorded (HARN-3)."""

            def pytest_runtest_setup(self, item: Any) -> None:
                threading.settrace(glob)
                sys.settrace(glob)

        threading.settrace(glob)
        sys.settrace(glob)
        args = [a for a in _pytest_args(tests) if a != "-x"]
        rc = pytest.main(args, plugins=[out, _Rearm()])
        sys.settrace(None)
        threading.settrace(None)
        return {
            "status": "ok",
            "rc": int(rc),
            "failed": out.failed,
            "durations": out.durations,
            "hits": {f: {str(ln): sorted(t) for ln, t in d.items()} for f, d in hits.items()},
        }

    return job


def _no_shrinking() -> None:
    """In a mutant's child: hypothesis stops at the first failing example instead of shrinking
    it (a failure is a failure; a smaller example would not change the verdict, HARN-25)."""
    from hypothesis import Phase, settings

    current = settings.default
    if current is None or Phase.shrink not in current.phases:
        return
    phases = tuple(p for p in current.phases if p not in (Phase.shrink, Phase.explain))
    settings.register_profile("mutation-child", settings(current, phases=phases))
    settings.load_profile("mutation-child")


def mutant_job(m: Mutant, tests: list[str], order: Any = None) -> Any:
    """A child's job: patch ``m`` in and run ``tests`` with ``-x``; ``order`` (called in the
    child, so at fork time) may reorder the tests, never add or drop one."""

    def job() -> dict[str, Any]:
        import pytest

        nonlocal tests
        if order is not None:
            ordered = order(tests)
            assert sorted(ordered) == sorted(tests)
            tests = ordered

        try:
            patch(m)
        except ImportTimeFailure as e:  # the mutated module would not even import
            return {"status": "killed", "killed_by": "<import>", "error": str(e)}
        except Exception as e:
            return {"status": "error", "error": f"not patchable: {type(e).__name__}: {e}"}
        _no_shrinking()
        out = _Outcomes()
        rc = int(pytest.main(_pytest_args(tests), plugins=[out]))
        if rc == 0:
            return {"status": "survived"}
        if rc == 1 and out.failed:
            return {"status": "killed", "killed_by": out.failed[0]}
        return {"status": "error", "error": f"pytest exit {rc}", "failed": out.failed}

    return job


# ---------------------------------------------------------------- patching (HARN-2)


def _module_name(relpath: str) -> str:
    name = relpath[:-3].replace("/", ".")
    return name[: -len(".__init__")] if name.endswith(".__init__") else name


def _functions(obj: Any, modname: str, seen: set[int]) -> list[types.FunctionType]:
    """Every function object reachable from a module or class namespace."""
    out: list[types.FunctionType] = []
    for v in list(vars(obj).values()):
        cands = [v]
        if isinstance(v, (staticmethod, classmethod)):
            cands = [v.__func__]
        elif isinstance(v, property):
            cands = [f for f in (v.fget, v.fset, v.fdel) if f is not None]
        for f in cands:
            while hasattr(f, "__wrapped__") and not isinstance(f, types.FunctionType):
                f = f.__wrapped__
            if isinstance(f, types.FunctionType):
                inner = f
                out.append(f)
                while hasattr(inner, "__wrapped__"):
                    inner = inner.__wrapped__
                    if isinstance(inner, types.FunctionType):
                        out.append(inner)
            elif isinstance(f, type) and id(f) not in seen and f.__module__ == modname:
                seen.add(id(f))
                out.extend(_functions(f, modname, seen))
    return out


def _codes(code: types.CodeType) -> list[types.CodeType]:
    out = [code]
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            out.extend(_codes(c))
    return out


def _rebind(changed: dict[int, Any], package: str) -> None:
    """Point every global (in the mutated package, tests, conformance) that held an old
    object at the new one."""
    if not changed:
        return
    for name, mod in list(sys.modules.items()):
        if mod is None or not name.startswith((package, "tests", "conformance")):
            continue
        d = vars(mod)
        for k, v in list(d.items()):
            new = changed.get(id(v))
            if new is not None:
                d[k] = new


class Stopped(Exception):
    """SIGTERM or SIGINT reached the parent: write what was judged so far, then stop."""


def _stop(signum: int, frame: Any) -> None:
    raise Stopped(signal.Signals(signum).name)


class ImportTimeFailure(Exception):
    """Module-level code of the mutant raised: any import of the module fails (killed)."""


def _reexec(module: types.ModuleType, tree: ast.Module, start: int, path: str) -> None:
    stmts: list[ast.stmt] = [st for st in tree.body[start:] if isinstance(st, MODULE_STMTS)]
    d = vars(module)
    before = dict(d)
    try:
        exec(compile(ast.Module(body=stmts, type_ignores=[]), path, "exec"), d)
    except Exception as e:
        raise ImportTimeFailure(f"importing the mutant raises {type(e).__name__}: {e}") from e
    changed = {id(before[k]): v for k, v in d.items() if k in before and before[k] is not v}
    _rebind(changed, module.__name__.split(".")[0])


def patch(m: Mutant, root: Path = ROOT, targets: list[str] | None = None) -> None:
    """Apply ``m`` to the imported module (HARN-2): swap the function's ``__code__``, or
    re-execute the module-level assignments from the mutated one on."""
    path = root / m.file
    module = importlib.import_module(_module_name(m.file))
    source = path.read_text(encoding="utf-8")
    tree = apply_mutant(source, m)
    if m.scope.startswith("<module>"):
        _reexec(module, tree, int(m.scope.split(":")[1]), str(path))
        return
    codes = [c for c in _codes(compile(tree, str(path), "exec")) if c.co_qualname == m.scope]
    fns = [
        f
        for f in _functions(module, module.__name__, set())
        if f.__code__.co_qualname == m.scope and f.__code__.co_filename == str(path)
    ]
    done = 0
    for f in fns:
        for c in codes:
            if (
                c.co_firstlineno == f.__code__.co_firstlineno
                and c.co_freevars == f.__code__.co_freevars
            ):
                f.__code__ = c
                done += 1
    if not done:
        raise LookupError(f"no function object for {m.scope} in {m.file}")
    # tables built at import through the patched function are rebuilt (protocol rows)
    for rel, i in import_time_uses(m, root, TARGETS if targets is None else targets):
        mod = sys.modules.get(_module_name(rel))
        if mod is not None:
            _reexec(mod, _parsed(root / rel), i, str(root / rel))


@functools.cache
def _parsed(path: Path) -> ast.Module:
    """A target module's tree, parsed once per process (the source does not change during a run)."""
    return ast.parse(path.read_text(encoding="utf-8"))


@functools.cache
def _called_names_cached(tree: ast.Module) -> list[tuple[set[str], set[str]]]:
    callers: list[tuple[set[str], set[str]]] = []  # (names it stands for, names it calls)
    for st in tree.body:
        if isinstance(st, (ast.FunctionDef, ast.AsyncFunctionDef)):
            callers.append(({st.name}, _called_names(st)))
        elif isinstance(st, ast.ClassDef):
            for sub in st.body:
                if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    ctor = sub.name in ("__init__", "__post_init__", "__new__")
                    callers.append(
                        ({sub.name, st.name} if ctor else {sub.name}, _called_names(sub))
                    )
    return callers


@functools.cache
def _module_calls(tree: ast.Module) -> list[tuple[int, set[str]]]:
    return [
        (i, _called_names(st)) for i, st in enumerate(tree.body) if isinstance(st, MODULE_STMTS)
    ]


def _called_names(node: ast.AST) -> set[str]:
    out = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Call):
            name = getattr(n.func, "id", None) or getattr(n.func, "attr", None)
            if name:
                out.add(name)
    return out


def import_time_uses(m: Mutant, root: Path, targets: list[str]) -> list[tuple[str, int]]:
    """(module, first statement) of module-level assignments that run ``m``'s function at
    import, directly or through functions, methods or classes that call it."""
    if m.scope.startswith("<module>"):
        return []
    return _import_time_uses(m.file, m.scope, root, tuple(targets))


@functools.cache
def _import_time_uses(
    file: str, scope: str, root: Path, targets: tuple[str, ...]
) -> list[tuple[str, int]]:
    parts = scope.split(".")
    names = {parts[-1]}
    if len(parts) > 1 and parts[-1] in ("__init__", "__post_init__", "__new__"):
        names.add(parts[-2])
    callers = _called_names_cached(_parsed(root / file))
    grew = True
    while grew:
        grew = False
        for stands_for, calls in callers:
            if calls & names and not stands_for <= names:
                names |= stands_for
                grew = True
    out = []
    for rel in targets:
        for i, calls in _module_calls(_parsed(root / rel)):
            if calls & names:
                out.append((rel, i))
                break
    return out


def tests_for_mutant(
    m: Mutant,
    module_tests: list[str],
    ids: set[str],
    tests: dict[str, TestInfo],
    hits: dict[str, list[str]],
    durations: dict[str, float],
    import_time: bool = False,
) -> list[str]:
    """The tests that judge ``m`` (HARN-3): those citing the module's IDs (``module_tests``)
    that ran a line of the mutated node in the baseline (``hits``: line -> tests);
    every one of them for a module-level mutant or one whose function runs at import. Tests citing the mutated function's own
    IDs run first, then the fastest, so ``-x`` stops early and credits the right requirement."""
    pool = list(module_tests)
    if not m.scope.startswith("<module>") and not import_time:
        ran: set[str] = set()
        for ln in range(m.line, m.end_line + 1):
            ran.update(hits.get(str(ln), ()))
        pool = [t for t in pool if t in ran]
    pool.sort(key=lambda t: (not (tests[t].ids & ids), durations.get(t, 0.0), t))
    return pool


class Killers:
    """The tests that most recently killed a mutant, per function and per module (HARN-25):
    a mutant's tests are reordered at fork time so these run first, after no test citing the
    function's own IDs; the set of tests and so the verdict stay the same."""

    KEEP = 3

    def __init__(self) -> None:
        self.recent: dict[str, list[str]] = defaultdict(list)

    def record(self, m: Mutant, test: str) -> None:
        for key in (f"{m.file}::{m.scope}", m.file):
            lst = self.recent[key]
            if test in lst:
                lst.remove(test)
            lst.insert(0, test)
            del lst[self.KEEP :]

    def order(
        self, m: Mutant, pool: list[str], ids: set[str], tests: dict[str, TestInfo]
    ) -> list[str]:
        first = self.recent.get(f"{m.file}::{m.scope}", []) + self.recent.get(m.file, [])
        rank = {}
        for i, t in enumerate(first):
            rank.setdefault(t, i)
        pos = {t: i for i, t in enumerate(pool)}
        return sorted(
            pool, key=lambda t: (not (tests[t].ids & ids), rank.get(t, len(first)), pos[t])
        )


# ---------------------------------------------------------------- the reference path (HARN-26)


@dataclass
class Suites:
    """``[reference]`` of mutation/config.toml: which modules are the reference path and which
    tests are its differential suite (the rest of a mutant's tests run the reference)."""

    prefix: str = ""
    run_files: tuple[str, ...] = ()
    differential_files: tuple[str, ...] = ()
    differential_ids: frozenset[str] = frozenset()

    def covers(self, rel: str) -> bool:
        return bool(self.prefix) and rel.startswith(self.prefix)

    def member(self, nodeid: str, info: TestInfo) -> bool:
        """Whether a test may judge a reference mutant at all (beyond citing its IDs)."""
        f = nodeid.split("::")[0]
        return f in self.run_files or self.differential(nodeid, info)

    def differential(self, nodeid: str, info: TestInfo) -> bool:
        return nodeid.split("::")[0] in self.differential_files or bool(
            info.ids & self.differential_ids
        )

    def split(self, pool: list[str], tests: dict[str, TestInfo]) -> dict[str, list[str]]:
        diff = [t for t in pool if self.differential(t, tests[t])]
        return {"reference": [t for t in pool if t not in diff], "differential": diff}


def combine_suites(suites: dict[str, str]) -> str:
    """The overall verdict of a reference mutant from its per-suite verdicts: killed when a
    suite killed it, unjudged (error) when a suite could not run, else survived."""
    vals = set(suites.values())
    if "killed" in vals:
        return "killed"
    if "timeout" in vals:
        return "timeout"
    if "error" in vals:
        return "error"
    return "survived"


# ---------------------------------------------------------------- the run


@dataclass
class Record:
    id: str
    file: str
    line: int
    op: str
    description: str
    scope: str
    ids: list[str]
    tests: int
    status: str
    killed_by: str = ""
    killed_by_ids: list[str] = field(default_factory=list)
    seconds: float = 0.0
    note: str = ""
    suites: dict[str, str] = field(default_factory=dict)  # reference mutants: verdict per suite


def load_config() -> tuple[dict[str, list[str]], list[str]]:
    cfg = tomllib.loads(CONFIG.read_text(encoding="utf-8"))
    return dict(cfg["modules"]), list(cfg["tests"]["exclude_markers"])


def load_suites() -> Suites:
    ref = tomllib.loads(CONFIG.read_text(encoding="utf-8")).get("reference", {})
    return Suites(
        str(ref.get("prefix", "")),
        tuple(ref.get("run_files", ())),
        tuple(ref.get("differential_files", ())),
        frozenset(ref.get("differential_ids", ())),
    )


def load_equivalent() -> dict[str, str]:
    if not EQUIVALENT.exists():
        return {}
    data = tomllib.loads(EQUIVALENT.read_text(encoding="utf-8"))
    return {e["id"]: e["reason"] for e in data.get("equivalent", [])}


TARGETS: list[str] = []


def rerun_ids(report: dict[str, Any], suites_too: bool = False, timeouts: bool = True) -> set[str]:
    """The mutants ``MUTATION_RERUN`` runs again from ``report``: its survivors, with
    ``timeouts`` its timeouts that no second, longer run confirmed (HARN-27) and, with
    ``suites_too``, the reference mutants one suite left alive (HARN-26)."""
    return {
        r["id"]
        for r in report["mutants"]
        if r["status"] == "survived"
        or (timeouts and r["status"] == "timeout" and "then past" not in r.get("note", ""))
        or (suites_too and any(v in ("survived", "no test") for v in r.get("suites", {}).values()))
    }


def main() -> int:
    sys.path.insert(0, str(ROOT))
    os.chdir(ROOT)
    os.environ.setdefault("HYPOTHESIS_PROFILE", "ci")
    sample = int(os.environ.get("MUTATION_SAMPLE", "200"))
    seed = int(os.environ.get("MUTATION_SEED", "1"))
    jobs = max(1, int(os.environ.get("MUTATION_JOBS", "1")))
    only = [s for s in os.environ.get("MUTATION_MODULES", "").split(",") if s]
    report_path = Path(os.environ.get("MUTATION_REPORT", str(DEFAULT_REPORT)))
    t_start = time.monotonic()
    commit_at_start = _commit()  # the code measured, even if HEAD moves during the run

    import torch

    from refdcp.tools.spec_report import load_spec

    torch.set_num_threads(1)  # see OMP_NUM_THREADS above: forked children must not need OpenMP

    known = set(load_spec(ROOT / "spec")[0])
    modules, exclude = load_config()
    TARGETS[:] = list(modules)
    if only:
        modules = {k: v for k, v in modules.items() if any(s in k for s in only)}
    equivalent = load_equivalent()
    suites = load_suites()

    population: list[Mutant] = []
    mod_ids: dict[str, set[str]] = {}
    sources: dict[str, str] = {}
    trees: dict[str, ast.Module] = {}
    for rel, extra in modules.items():
        src = (ROOT / rel).read_text(encoding="utf-8")
        sources[rel], trees[rel] = src, ast.parse(src)
        mod_ids[rel] = module_ids(src, extra, known)
        population.extend(enumerate_mutants(src, rel))
    chosen = sample_mutants(population, sample, seed)
    rerun = os.environ.get("MUTATION_RERUN")
    if rerun:
        old = json.loads(Path(rerun).read_text(encoding="utf-8"))
        again = rerun_ids(
            old,
            suites_too=os.environ.get("MUTATION_RERUN_SUITES") == "1",
            timeouts=os.environ.get("MUTATION_RERUN_TIMEOUTS", "1") != "0",
        )
        chosen = [m for m in population if m.id in again]
    print(
        f"mutation: {len(population)} mutants in {len(modules)} modules; running {len(chosen)} (seed {seed})"
    )

    tests = collect_tests(exclude)
    selected = {
        rel: sorted(
            t
            for t, info in tests.items()
            if info.ids & ids or (suites.covers(rel) and suites.member(t, info))
        )
        for rel, ids in mod_ids.items()
    }
    union = sorted({t for ts in selected.values() for t in ts})
    print(f"mutation: baseline run of {len(union)} spec-citing tests (tracing the mutated modules)")
    files = {str(ROOT / rel) for rel in modules}
    base: dict[str, Any] = {}

    def keep_base(_: int, res: dict[str, Any]) -> None:
        base.update(res)

    run_jobs([(baseline_job(union, files), 3600.0)], 1, keep_base)
    if base.get("status") != "ok":
        raise SystemExit(f"mutation: baseline run failed: {base}")
    if base.get("rc") not in (0, 1):  # 2-5: interrupted, internal/usage error, none collected
        raise SystemExit(
            f"mutation: the baseline pytest run exited {base.get('rc')} (a test id it could not "
            "select?); refusing to judge mutants by a run that did not run the tests"
        )
    failing = set(base["failed"])
    if failing:
        print(
            f"mutation: {len(failing)} test(s) fail without any mutant and are left out: {sorted(failing)}"
        )
    durations: dict[str, float] = base["durations"]
    hits: dict[str, dict[str, list[str]]] = base["hits"]

    resumed: dict[str, dict[str, Any]] = {}
    if os.environ.get("MUTATION_RESUME"):
        prev = json.loads(Path(os.environ["MUTATION_RESUME"]).read_text(encoding="utf-8"))
        resumed = {
            r["id"]: r
            for r in prev["mutants"]
            if r["status"]
            and r["status"] != "equivalent"
            and (not suites.covers(r["file"]) or len(r.get("suites", {})) == 2)
        }
        print(f"mutation: {len(resumed)} judged mutants kept from {os.environ['MUTATION_RESUME']}")
    records: list[Record] = []
    job_list: list[tuple[Any, float]] = []
    job_records: list[tuple[Record, Mutant, str]] = []  # (record, mutant, suite or "")
    killers = Killers()
    for m in chosen:
        src, tree = sources[m.file], trees[m.file]
        ids = scope_ids(src, tree, m.scope, mod_ids[m.file], known)
        pool = tests_for_mutant(
            m,
            [t for t in selected[m.file] if t not in failing],
            ids,
            tests,
            hits.get(str(ROOT / m.file), {}),
            durations,
            bool(import_time_uses(m, ROOT, TARGETS)),
        )
        rec = Record(m.id, m.file, m.line, m.op, m.description, m.scope, sorted(ids), len(pool), "")
        records.append(rec)
        if m.id in equivalent:
            rec.status, rec.note = "equivalent", equivalent[m.id]
            continue
        if m.id in resumed:
            records[-1] = Record(**resumed[m.id])
            continue
        if not pool:
            rec.status, rec.note = "survived", "no test citing the module's IDs runs this line"
            continue
        parts = suites.split(pool, tests) if suites.covers(m.file) else {"": pool}
        for suite, part in parts.items():
            if not part:
                rec.suites[suite] = "no test"
                continue
            limit = 20.0 + 3.0 * sum(durations.get(t, 1.0) for t in part)
            order = functools.partial(killers.order, m, ids=ids, tests=tests)
            job_list.append((mutant_job(m, part, order), limit))
            job_records.append((rec, m, suite))

    done = [0]

    def partial(note: str) -> None:
        write_reports(
            [r for r in records if r.status],
            report_path,
            sample,
            seed,
            len(population),
            time.monotonic() - t_start,
            sorted(failing),
            commit=commit_at_start,
            note=note,
        )

    def keep(i: int, res: dict[str, Any]) -> None:
        rec, m, suite = job_records[i]
        status = res.get("status", "error")
        killed_by = res.get("killed_by", "")
        if killed_by in tests:
            killers.record(m, killed_by)
        rec.seconds = round(rec.seconds + float(res.get("seconds", 0.0)), 2)
        note = res.get("error", "") or (
            f"ran past its time limit, then past {CONFIRM_FACTOR:g} times it"
            if status == "timeout"
            else ""
        )
        if suite:
            rec.suites[suite] = status
            status = combine_suites(rec.suites)
            if note:
                note = f"{suite}: {note}"
        if killed_by and not rec.killed_by:
            rec.killed_by = killed_by
        if note:
            rec.note = f"{rec.note}; {note}" if rec.note else note
        rec.status = status
        if rec.killed_by:
            rec.killed_by_ids = sorted(tests[rec.killed_by].ids) if rec.killed_by in tests else []
        done[0] += 1
        if done[0] % 25 == 0 and not rerun:
            partial(f"in progress: {done[0]} of {len(job_list)} runs done")
        print(
            f"  [{done[0]}/{len(job_list)}] {res.get('status', 'error'):<9} "
            f"{float(res.get('seconds', 0.0)):5.1f}s {rec.id}{' [' + suite + ']' if suite else ''} "
            f"{rec.description}",
            flush=True,
        )

    # The children's garbage collections then skip every object the parent holds (torch, the
    # test modules): the same collections, over the objects the tests make (HARN-25).
    stopped = ""
    gc.collect()
    gc.freeze()
    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    try:
        run_jobs(job_list, jobs, keep)
    except Stopped as e:
        stopped = f"stopped by {e} after {done[0]} of {len(job_list)} runs; only the mutants judged are listed"
        print(f"mutation: {stopped}", flush=True)
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        gc.unfreeze()
    elapsed = time.monotonic() - t_start
    if rerun and os.environ.get("MUTATION_MERGE") == "1":
        # re-judge the survivors of a report in place (new tests, same source)
        new = {r.id: r for r in records if r.status}
        merged = [new.get(r["id"]) or Record(**r) for r in old["mutants"]]
        meta = dict(old["meta"])
        note = f"survivors re-judged at {commit_at_start} on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} ({elapsed:.0f} s)"
        write_reports(
            merged,
            report_path,
            meta["sample"],
            meta["seed"],
            meta["population"],
            float(meta["seconds"]),
            list(meta.get("baseline_failures", [])),
            commit=str(meta["commit"]),
            date=str(meta["date"]),
            note=note,
        )
    else:
        partial(stopped)
    print(
        f"mutation: report in {report_path} and {report_path.with_suffix('.md')} ({elapsed:.0f} s)"
    )
    return 0


# ---------------------------------------------------------------- reports (HARN-5, HARN-6)


def scores(records: list[Record]) -> dict[str, dict[str, int]]:
    """Per package: killed (timeouts included), survived, equivalent, error."""
    out: dict[str, dict[str, int]] = {}
    for r in records:
        s = out.setdefault(
            package_of(r.file), {"killed": 0, "survived": 0, "equivalent": 0, "error": 0}
        )
        key = "killed" if r.status in ("killed", "timeout") else r.status
        s[key if key in s else "error"] += 1
    return out


def suite_counts(records: list[Record]) -> dict[str, int]:
    """Reference mutants (not equivalent, judged): how many each suite killed (HARN-26)."""
    judged = [r for r in records if r.suites and r.status not in ("equivalent", "error")]
    kill = ("killed", "timeout")
    ref = {r.id for r in judged if r.suites.get("reference") in kill}
    diff = {r.id for r in judged if r.suites.get("differential") in kill}
    return {
        "mutants": len(judged),
        "reference": len(ref),
        "differential": len(diff),
        "both": len(ref & diff),
        "neither": len(judged) - len(ref | diff),
    }


def score_percent(s: dict[str, int]) -> float | None:
    n = s["killed"] + s["survived"]
    return None if n == 0 else 100.0 * s["killed"] / n


def _commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def write_reports(
    records: list[Record],
    path: Path,
    sample: int,
    seed: int,
    population: int,
    elapsed: float,
    failing: list[str],
    *,
    commit: str | None = None,
    date: str | None = None,
    note: str = "",
) -> None:
    sc = scores(records)
    meta = {
        "commit": commit or _commit(),
        "date": date or time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "sample": sample,
        "seed": seed,
        "population": population,
        "seconds": round(elapsed, 1),
        "baseline_failures": failing,
        "note": note,
    }
    suites = suite_counts(records)
    body: dict[str, Any] = {"meta": meta, "scores": sc}
    if suites["mutants"]:
        body["reference_suites"] = suites
    body["mutants"] = [asdict(r) for r in records]
    path.write_text(json.dumps(body, indent=1) + "\n", encoding="utf-8")
    lines = [
        "# Mutation run",
        "",
        f"commit {meta['commit']}, {meta['date']}; {len(records)} of {population} mutants "
        f"(MUTATION_SAMPLE={sample}, MUTATION_SEED={seed}); {elapsed:.0f} s."
        + (f" {note}." if note else ""),
        "",
        "| package | killed | survived | equivalent | error | score (killed / non-equivalent) |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for pkg in sorted(sc):
        s = sc[pkg]
        pct = score_percent(s)
        lines.append(
            f"| {pkg} | {s['killed']} | {s['survived']} | {s['equivalent']} | {s['error']} | "
            + ("n/a" if pct is None else f"{pct:.0f} %")
            + " |"
        )
    timeouts = [r for r in records if r.status == "timeout"]
    if timeouts:
        unconfirmed = sum("then past" not in r.note for r in timeouts)
        lines += [
            "",
            f"Timeouts, counted as killed: {len(timeouts)}; {unconfirmed} of them unconfirmed "
            "(one run past its limit, with no second, longer run: HARN-27).",
        ]
    if suites["mutants"]:
        lines += [
            "",
            f"Reference mutants, each run against both suites (HARN-26): of {suites['mutants']} judged, "
            f"the tests that run the reference kill {suites['reference']}, the differential tests "
            f"kill {suites['differential']}, both {suites['both']}, neither {suites['neither']}.",
        ]
        one = [
            r
            for r in records
            if r.suites
            and r.status in ("killed", "timeout")
            and any(v not in ("killed", "timeout") for v in r.suites.values())
        ]
        if one:
            lines += ["", "### Reference mutants killed by one suite only", ""]
            lines += [
                f"- `{r.file}:{r.line}` ({r.scope}) {r.description}: "
                + ", ".join(f"{k} {v}" for k, v in sorted(r.suites.items()))
                for r in one
            ]
    lines += ["", "## Surviving mutants", ""]
    surv = [r for r in records if r.status == "survived"]
    lines += [
        f"- `{r.file}:{r.line}` ({r.scope}) {r.description} [{', '.join(r.ids)}]; {r.tests} test(s)"
        + (f"; {r.note}" if r.note else "")
        for r in surv
    ] or ["none"]
    errs = [r for r in records if r.status == "error"]
    if errs:
        lines += ["", "## Mutants that could not be judged (left out of the score)", ""]
        lines += [f"- `{r.file}:{r.line}` {r.description}: {r.note}" for r in errs]
    eq = [r for r in records if r.status == "equivalent"]
    if eq:
        lines += ["", "## Equivalent mutants (mutation/equivalent.toml)", ""]
        lines += [f"- `{r.file}:{r.line}` {r.description}: {r.note}" for r in eq]
    path.with_suffix(".md").write_text("\n".join(lines) + "\n", encoding="utf-8")


if __name__ == "__main__":
    sys.exit(main())
