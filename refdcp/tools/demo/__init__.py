"""``make demo`` / ``refdcp demo`` / ``python -m refdcp.tools.demo``: the main job (TOOL-24..26).

On embedded defaults, under one temporary directory that is removed at the
end: a 4-rank fake-world save to the filesystem, a resharded load at 3 ranks
(checked against the values saved), the step-by-step trace of that save and
load, ``refdcp verify`` and ``refdcp inspect`` on the checkpoint, and the
storage conformance suite against refdcp's own filesystem backend; then a
summary, one line per step. The exit status is 1 when any step failed.
"""

from __future__ import annotations

import contextlib
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

__all__ = ["DEFAULT_STEPS", "Demo", "StepResult", "demo_command", "main", "run_demo"]

#: Hypothesis examples per conformance check: enough to exercise every check, fast on 2 cores.
CONFORMANCE_EXAMPLES = 5


@dataclass
class Demo:
    """What the steps share: the worlds, the working directory, the output stream."""

    save_world: int
    load_world: int
    workdir: Path
    out: TextIO

    @property
    def checkpoint(self) -> Path:
        return self.workdir / "checkpoint"


@dataclass
class StepResult:
    name: str
    ok: bool
    seconds: float
    detail: str


Step = tuple[str, Callable[[Demo], str]]


def _save(demo: Demo) -> str:
    """Every rank saves its shard of a model (a row-sharded embedding, a replicated head)."""
    import refdcp
    from refdcp.comm import FakeWorld
    from refdcp.tools.trace import model_state

    def rank_main(comm: Any) -> Any:
        state = model_state(comm.rank, demo.save_world, "rows")
        return refdcp.save(state, checkpoint_id=str(demo.checkpoint), comm=comm)

    metadatas = FakeWorld(demo.save_world).run(rank_main)
    keys = sorted(metadatas[0].state_dict_metadata)
    return f"{demo.save_world} ranks saved {len(keys)} keys ({', '.join(keys)})"


def _load(demo: Demo) -> str:
    """A different number of ranks loads the checkpoint; each checks its values."""
    import refdcp
    from refdcp.comm import FakeWorld
    from refdcp.tools.trace import _same, empty_model_state, model_state

    def rank_main(comm: Any) -> bool:
        state = empty_model_state(comm.rank, demo.load_world, "rows")
        refdcp.load(state, checkpoint_id=str(demo.checkpoint), comm=comm)
        return _same(state, model_state(comm.rank, demo.load_world, "rows"))

    equal = FakeWorld(demo.load_world).run(rank_main)
    if not all(equal):
        bad = [r for r, ok in enumerate(equal) if not ok]
        raise AssertionError(f"rank(s) {bad} loaded values that differ from the saved ones")
    return f"{demo.load_world} ranks loaded the {demo.save_world}-rank checkpoint; values equal"


def _trace(demo: Demo) -> str:
    """The same save and load, step by step, replayed in the deterministic simulator."""
    from refdcp.tools.trace import render_text, run_trace

    res = run_trace(demo.save_world, demo.load_world, "rows")
    demo.out.write(render_text(res))
    if not res.verified:
        raise AssertionError("the traced load did not return the saved values")
    return f"{len(res.save_steps)} save and {len(res.load_steps)} load steps shown"


def _verify(demo: Demo) -> str:
    from refdcp.tools.verify import verify_command

    with contextlib.redirect_stdout(demo.out):
        code = verify_command(str(demo.checkpoint), json=False)
    if code != 0:
        raise AssertionError(f"refdcp verify exited with {code}")
    return "every item's checksum matches"


def _inspect(demo: Demo) -> str:
    from refdcp.tools.inspect import inspect_command

    with contextlib.redirect_stdout(demo.out):
        code = inspect_command(str(demo.checkpoint), as_json=False)
    if code != 0:
        raise AssertionError(f"refdcp inspect exited with {code}")
    return "committed; keys, chunks and files listed"


def _conformance(demo: Demo) -> str:
    import warnings

    from conformance.cli import load_backend
    from conformance.runner import failed_musts, run_checks

    backend = load_backend("conformance.backends:refdcp_fs")
    with _tempdir_under(demo.workdir / "conformance"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        results = run_checks(backend, examples=CONFORMANCE_EXAMPLES)
    for r in results:
        demo.out.write(f"{r.id:<8} {r.level:<10} {r.status:<5} {r.title}\n")
        if r.reason:
            demo.out.write(f"         {r.reason}\n")
    bad = failed_musts(results)
    if bad:
        raise AssertionError(
            f"{len(bad)} failed MUST requirement(s): {', '.join(r.id for r in bad)}"
        )
    passed = sum(r.status == "pass" for r in results)
    return f"{backend.name}: conforms ({passed} pass of {len(results)} checks)"


@contextlib.contextmanager
def _tempdir_under(path: Path) -> Iterator[None]:
    """Keep the suite's scratch under ``path``: ``tempfile``'s directories and hypothesis's
    example database (which otherwise goes to ``.hypothesis/`` in the working directory)."""
    from hypothesis import configuration

    path.mkdir(parents=True, exist_ok=True)
    saved = tempfile.tempdir
    tempfile.tempdir = str(path)
    configuration.set_hypothesis_home_dir(path / "hypothesis")
    try:
        yield
    finally:
        tempfile.tempdir = saved
        configuration.set_hypothesis_home_dir(None)


DEFAULT_STEPS: list[Step] = [
    ("save", _save),
    ("load (resharded)", _load),
    ("trace", _trace),
    ("verify", _verify),
    ("inspect", _inspect),
    ("conformance", _conformance),
]


def run_demo(
    *,
    save_world: int = 4,
    load_world: int = 3,
    out: TextIO | None = None,
    keep: str | None = None,
    steps: list[Step] | None = None,
) -> list[StepResult]:
    """Run every step (a failed step does not stop the others) and print the summary (TOOL-24, TOOL-25)."""
    stream = out or sys.stdout
    workdir = Path(keep) if keep else Path(tempfile.mkdtemp(prefix="refdcp-demo-"))
    workdir.mkdir(parents=True, exist_ok=True)
    demo = Demo(save_world, load_world, workdir, stream)
    results: list[StepResult] = []
    try:
        for n, (name, fn) in enumerate(steps or DEFAULT_STEPS, 1):
            stream.write(f"\n=== {n}. {name} ===\n")
            stream.flush()
            start = time.perf_counter()
            try:
                detail, ok = fn(demo), True
            except Exception as exc:
                detail, ok = f"{type(exc).__name__}: {exc}".splitlines()[0], False
                stream.write(traceback.format_exc())
            results.append(StepResult(name, ok, time.perf_counter() - start, detail))
            stream.write(f"--> {'ok' if ok else 'FAILED'}: {detail}\n")
    finally:
        if keep is None:
            shutil.rmtree(workdir, ignore_errors=True)
    failed = [r for r in results if not r.ok]
    stream.write("\n=== summary ===\n")
    for r in results:
        stream.write(
            f"  {'ok    ' if r.ok else 'FAILED'} {r.name:<18} {r.seconds:6.2f} s  {r.detail}\n"
        )
    where = f"kept in {workdir}" if keep else f"worked in {workdir} (removed)"
    verdict = f"{len(failed)} of {len(results)} step(s) FAILED" if failed else "all steps passed"
    stream.write(f"refdcp demo: {verdict}; {where}\n")
    stream.flush()
    return results


def demo_command(
    *, save_world: int = 4, load_world: int = 3, keep: str | None = None, out: TextIO | None = None
) -> int:
    results = run_demo(save_world=save_world, load_world=load_world, keep=keep, out=out)
    return 0 if results and all(r.ok for r in results) else 1
