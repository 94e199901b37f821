"""Run the checks against one backend and collect a Result per check (CONF-41, CONF-42)."""

from __future__ import annotations

import json
import time
import traceback
from collections.abc import Iterable
from pathlib import Path

from conformance.backend import Backend
from conformance.registry import CHECKS, Check, CheckFailed, NotApplicable, Result, context

__all__ = ["levels", "run_checks", "failed_musts"]


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
    return {rid: r.level for rid, r in sorted(reqs.items()) if rid.startswith("CONF-")}


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


def run_checks(
    backend: Backend, *, only: Iterable[str] | None = None, examples: int = 10
) -> list[Result]:
    """Run every check (or those whose ID is in ``only``) in spec order; never raises."""
    wanted = set(only) if only is not None else None
    lv = levels()
    out: list[Result] = []
    for check in all_checks():
        if wanted is not None and check.id not in wanted:
            continue
        out.append(_run_one(backend, check, lv.get(check.id, "MUST"), examples))
    return out


def _run_one(backend: Backend, check: Check, level: str, examples: int) -> Result:
    missing = [c for c in check.needs if not getattr(backend.capabilities, c)]
    if missing:
        reason = f"backend does not declare {', '.join(missing)}"
        return Result(check.id, level, check.title, "n/a", reason, 0.0)
    start = time.perf_counter()
    status, reason = "pass", ""
    try:
        with context(backend, examples) as ctx:
            check.fn(ctx)
    except NotApplicable as exc:
        status, reason = "n/a", str(exc)
    except CheckFailed as exc:
        status, reason = "fail", str(exc)
    except Exception as exc:
        tb = traceback.extract_tb(exc.__traceback__)[-1]
        status = "fail"
        reason = f"{check.id}: {type(exc).__name__}: {exc} (at {tb.filename}:{tb.lineno})"
    return Result(check.id, level, check.title, status, reason, time.perf_counter() - start)


def failed_musts(results: Iterable[Result]) -> list[Result]:
    """Failed checks of MUST / MUST NOT requirements: these make the run fail (CONF-42)."""
    return [r for r in results if r.status == "fail" and r.level.startswith("MUST")]
