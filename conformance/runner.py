"""Run the checks against one backend and collect a Result per check (CONF-41, CONF-42)."""

from __future__ import annotations

import json
import threading
import time
import traceback
from collections.abc import Iterable
from pathlib import Path

from conformance.backend import Backend
from conformance.registry import (
    CHECKS,
    Check,
    CheckFailed,
    NotApplicable,
    Progress,
    Result,
    context,
    describe,
    plain,
    watch,
)

__all__ = ["DEFAULT_TIMEOUT", "failed_musts", "levels", "run_checks"]


#: The CONF requirement levels as shipped with the package, for installs without
#: ``spec/`` (a wheel); a test keeps it equal to spec/conformance.md (CONF-45).
LEVELS_FILE = Path(__file__).with_name("levels.json")


def spec_levels() -> dict[str, str] | None:
    """Requirement ID -> MUST / SHOULD / ..., read from spec/ when it is there."""
    from refdcp.tools.spec_report import load_spec, repo_root

    spec_dir = repo_root() / "spec"
    if not (spec_dir / "conformance.md").is_file():
        return None
    reqs, _ = load_spec(spec_dir)
    return {
        rid: r.level
        for rid, r in sorted(reqs.items())
        if rid.startswith("CONF-") and r.level != "WITHDRAWN"  # a withdrawn ID has no check
    }


def levels() -> dict[str, str]:
    """Requirement levels: from spec/ in a checkout, else the copy shipped in the package."""
    found = spec_levels()
    if found is not None:
        return found
    loaded: dict[str, str] = json.loads(LEVELS_FILE.read_text(encoding="utf-8"))
    return loaded


def all_checks() -> list[Check]:
    import conformance.checks  # noqa: F401  (registers the checks)

    return sorted(CHECKS, key=lambda c: int(c.id.rpartition("-")[2]))


#: Seconds a check may run before it is reported as timed out (CONF-51).
DEFAULT_TIMEOUT = 120.0


def run_checks(
    backend: Backend,
    *,
    only: Iterable[str] | None = None,
    examples: int = 10,
    timeout: float = DEFAULT_TIMEOUT,
    profile: str | None = None,
) -> list[Result]:
    """Run every check (or those whose ID is in ``only``) in spec order; never raises.

    ``profile`` (a name in ``conformance.profiles.PROFILES``) lays that profile over the
    backend's declared capabilities (CONF-69).

    Each check runs in its own daemon thread and is abandoned once the backend made no
    progress for ``timeout`` seconds (CONF-51); whatever backend code raises is that check's result (CONF-50).
    """
    if profile is not None:
        from conformance.profiles import PROFILES, Profiled

        if profile not in PROFILES:
            raise ValueError(f"unknown profile {profile!r}; known: {', '.join(sorted(PROFILES))}")
        backend = Profiled(backend, profile)
    wanted = set(only) if only is not None else None
    lv = levels()
    out: list[Result] = []
    for check in all_checks():
        if wanted is not None and check.id not in wanted:
            continue
        out.append(_run_one(backend, check, lv.get(check.id, "MUST"), examples, timeout))
    return out


def _outcome(backend: Backend, check: Check, examples: int) -> tuple[str, str]:
    """Run one check in the calling thread; any exception becomes (status, reason)."""
    notes: list[str] = []
    try:
        with context(backend, examples) as ctx:
            notes = ctx.notes
            check.fn(ctx)
    except NotApplicable as exc:
        return "n/a", str(exc)
    except CheckFailed as exc:
        return "fail", str(exc)
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # CheckpointException, SystemExit, ...: a result (CONF-50)
        frames = traceback.extract_tb(exc.__traceback__)
        where = f" (at {_short(frames[-1].filename)}:{frames[-1].lineno})" if frames else ""
        return "fail", f"{check.id}: {describe(exc)}{where}"
    return "pass", "; ".join(notes)


def _short(filename: str) -> str:
    """``filename`` relative to the working directory when it lies below it."""
    try:
        return str(Path(filename).resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return filename


def _run_one(backend: Backend, check: Check, level: str, examples: int, timeout: float) -> Result:
    caps = backend.capabilities
    missing = [c for c in check.needs if not getattr(caps, c)]
    if missing:
        reason = f"backend does not declare {', '.join(missing)}"
        why = [caps.reason(c) for c in missing if caps.reason(c)]
        if why:
            reason += f" ({'; '.join(why)})"
        return Result(check.id, level, check.title, "n/a", reason, 0.0)
    box: list[tuple[str, str]] = []
    interrupted: list[KeyboardInterrupt] = []
    progress = Progress()

    def body() -> None:
        watch(progress)
        try:
            box.append(_outcome(backend, check, examples))
        except KeyboardInterrupt as exc:
            interrupted.append(exc)

    start = time.perf_counter()
    worker = threading.Thread(target=body, name=f"conformance {check.id}", daemon=True)
    worker.start()
    # the limit runs from the backend's last sign of progress (a call into it started or
    # returned), not from the check's start: a slow backend whose calls all return is
    # never failed for its speed, a call that never returns is (CONF-51)
    while worker.is_alive():
        left = progress.last + timeout - time.monotonic()
        if left <= 0:
            break
        worker.join(left)
    seconds = time.perf_counter() - start
    if interrupted:
        raise interrupted[0]
    if worker.is_alive() or not box:
        reason = (
            f"{check.id}: timed out after {timeout:g} s without progress (no call into the "
            f"backend started or returned; the check had run {seconds:.1f} s and was "
            "abandoned; the remaining checks ran)"
        )
        return Result(check.id, level, check.title, "fail", reason, seconds, timed_out=True)
    status, reason = box[0]
    return Result(check.id, level, check.title, status, plain(reason), seconds)


def failed_musts(results: Iterable[Result]) -> list[Result]:
    """Failed checks of MUST / MUST NOT requirements: these make the run fail (CONF-42)."""
    return [r for r in results if r.status == "fail" and r.level.startswith("MUST")]
