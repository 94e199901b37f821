"""Crash consistency: a save killed with SIGKILL leaves the old or the new checkpoint (CONF-48).

The suite forks a child that saves the new checkpoint over the old one and
kills itself (SIGKILL) just before its K-th call of a C function (where every
write, rename, flush and socket send happens), counted on all its threads by
a profile hook. K runs over points spread across the whole save and densely
across the coordinator's ``finish``. Afterwards the parent must load the
location bit-exact as either checkpoint.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from types import FrameType
from typing import Any

from conformance.checks.common import load_error, read_metadata, save_at
from conformance.checks.failures import exact_state, new_state, old_state
from conformance.drive import save_ranks
from conformance.registry import (
    CheckFailed,
    Context,
    NotApplicable,
    Progress,
    describe,
    spec,
    tick,
    watch,
)

#: Kill points: every C call of ``finish`` up to this many, else this many spread evenly.
FINISH_POINTS = 40
#: Kill points spread evenly over the save before ``finish``.
SAVE_POINTS = 12
#: Seconds a child save may take before it counts as hung; ten times the time of the
#: save without a kill when that is longer (a slow backend is not a hung one).
CHILD_TIMEOUT = 60.0


class _Counter:
    """Counts C calls on every thread; SIGKILLs the process at call ``kill_at``."""

    def __init__(self, kill_at: int | None) -> None:
        self.n = 0
        self.kill_at = kill_at

    def hook(self, frame: FrameType, event: str, arg: Any) -> None:
        if event == "c_call":
            self.n += 1
            if self.n == self.kill_at:
                os.kill(os.getpid(), signal.SIGKILL)

    def install(self) -> None:
        threading.setprofile(self.hook)
        sys.setprofile(self.hook)

    def uninstall(self) -> None:
        sys.setprofile(None)
        threading.setprofile(None)


@dataclass(frozen=True)
class ChildRun:
    """How a child save ended: ``ok`` (with its C-call counts), ``killed``, ``error``, ``hung``."""

    outcome: str
    calls: int = 0
    finish_at: int = 0
    detail: str = ""


class _Heartbeat(Progress):
    """The child's clock: each tick writes a byte the parent reads as progress (CONF-51)."""

    def __init__(self, fd: int) -> None:
        super().__init__()
        self.fd = fd

    def tick(self) -> None:
        with contextlib.suppress(OSError):
            os.write(self.fd, b".")


def _child(ctx: Context, loc: Any, sd: dict[str, Any], kill_at: int | None, out: int) -> None:
    counter = _Counter(kill_at)
    marks: list[int] = []
    try:
        writer = ctx.backend.writer(loc, rank=0)
        counter.install()
        save_ranks([writer], [sd], checkpoint_id=loc, before_finish=lambda: marks.append(counter.n))
        counter.uninstall()
        msg, code = f"ok {counter.n} {marks[0] if marks else counter.n}", 0
    except BaseException as exc:
        counter.uninstall()
        msg, code = f"error {describe(exc)}", 3
    os.write(out, msg.encode("utf-8", "replace")[:60000])
    os._exit(code)


def child_save(
    ctx: Context, loc: Any, sd: dict[str, Any], kill_at: int | None, limit: float = CHILD_TIMEOUT
) -> ChildRun:
    """Save ``sd`` at ``loc`` in a forked child, killed at C call ``kill_at`` (if reached);
    a child still running after ``limit`` seconds is hung."""
    tick()  # a child save that ends is the backend's progress (CONF-51)
    read_end, write_end = os.pipe()
    beat_read, beat_write = os.pipe()
    if pid := os.fork():
        os.close(beat_write)
    else:  # the child: never returns
        os.close(read_end)
        os.close(beat_read)
        watch(_Heartbeat(beat_write))  # the child's calls into the backend are progress too
        _child(ctx, loc, sd, kill_at, write_end)
    os.close(write_end)
    os.set_blocking(beat_read, False)
    deadline = time.monotonic() + limit
    status = None
    while status is None:
        with contextlib.suppress(BlockingIOError):
            if os.read(beat_read, 4096):
                tick()
        done, st = os.waitpid(pid, os.WNOHANG)
        tick()  # a child within its own limit is progress; ``limit`` is what catches a hang
        if done:
            status = st
        elif time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            os.close(read_end)
            os.close(beat_read)
            return ChildRun("hung", detail=f"no result within {limit:g} s")
        else:
            time.sleep(0.002)
    os.close(beat_read)
    chunks = []
    while chunk := os.read(read_end, 65536):
        chunks.append(chunk)
    os.close(read_end)
    tick()
    text = b"".join(chunks).decode("utf-8", "replace")
    if os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL:
        return ChildRun("killed")
    if text.startswith("ok "):
        calls, finish_at = (int(x) for x in text.split()[1:3])
        return ChildRun("ok", calls, finish_at)
    return ChildRun("error", detail=text.removeprefix("error ") or f"exit status {status}")


def _kill_points(run: ChildRun) -> list[int]:
    before = range(1, run.finish_at + 1)
    inside = range(run.finish_at + 1, run.calls + 1)
    points = {before[len(before) * i // SAVE_POINTS] for i in range(SAVE_POINTS) if before}
    if len(inside) <= FINISH_POINTS:
        points.update(inside)
    else:
        points.update(inside[len(inside) * i // FINISH_POINTS] for i in range(FINISH_POINTS))
    return sorted(points)


def _which(ctx: Context, loc: Any, old: dict[str, Any], new: dict[str, Any]) -> str:
    keys = set(read_metadata(ctx, loc).state_dict_metadata)
    if keys == set(new):
        return "new"
    if keys == set(old):
        return "old"
    return f"neither: keys {sorted(keys)[:6]}"


@spec(
    "CONF-48",
    title="a save killed with SIGKILL at any point leaves the old or the new checkpoint",
    needs=("overwrite", "atomic_overwrite"),
)
def killed_save_leaves_old_or_new(ctx: Context) -> None:
    if not hasattr(os, "fork"):
        raise NotApplicable("os.fork is not available on this platform")
    loc = ctx.location()
    (old,) = save_at(ctx, loc, [old_state()])
    new = new_state()
    started = time.monotonic()
    baseline = child_save(ctx, loc, new, None)
    # a slow backend's saves take long: a child is hung only at ten times the baseline's time
    limit = max(CHILD_TIMEOUT, 10 * (time.monotonic() - started))
    if baseline.outcome != "ok":
        raise NotApplicable(
            f"CONF-48 cannot be judged: a save in a forked child process without a kill "
            f"ended {baseline.outcome}: {baseline.detail}"
        )
    seen = load_error(ctx, loc)
    if seen is not None:
        raise NotApplicable(
            "CONF-48 cannot be judged: after a save completed in a forked child process, "
            f"read_metadata raised {describe(seen)}"
        )
    if _which(ctx, loc, old, new) == "old":
        raise NotApplicable(
            "a save completed in a forked child process is not visible to its parent: the "
            "storage is not shared between processes"
        )
    exact_state(ctx, loc, new, "CONF-48")
    for point in _kill_points(baseline):
        where = "inside finish" if point > baseline.finish_at else "before finish"
        when = f"C call {point} of {baseline.calls} ({where})"
        loc = ctx.location()
        save_at(ctx, loc, [old_state()])
        run = child_save(ctx, loc, new, point, limit)
        ending = {"killed": f"killed with SIGKILL at {when}", "ok": "completed"}.get(
            run.outcome, f"ended {run.outcome} ({run.detail}) before {when}"
        )
        err = load_error(ctx, loc)
        if err is not None:
            raise CheckFailed(
                f"CONF-48: after the save over a committed checkpoint was {ending}, "
                f"read_metadata raised {describe(err)}"
            )
        state = _which(ctx, loc, old, new)
        if state.startswith("neither"):
            raise CheckFailed(
                f"CONF-48: after the save was {ending}, the metadata lists {state[9:]}: "
                "neither the old checkpoint's keys nor the new one's"
            )
        try:
            exact_state(ctx, loc, old if state == "old" else new, "CONF-48")
        except CheckFailed as exc:
            raise CheckFailed(
                f"{exc} (the {state} checkpoint, after the save was {ending})"
            ) from exc
