"""``refdcp conformance mypkg.module:backend``: run the suite, print the table (CONF-42)."""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from conformance.backend import Backend
from conformance.report import dumps, to_markdown
from conformance.runner import DEFAULT_TIMEOUT, failed_musts, run_checks

__all__ = ["add_arguments", "conformance_command", "exit_now", "load_backend", "main"]


def load_backend(target: str) -> Backend:
    """Import ``module:attr``; call it when it is a class or factory rather than a backend."""
    module_name, sep, attr = target.partition(":")
    if not sep or not attr:
        raise ValueError(f"expected 'module:attribute', got {target!r}")
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # as `python -m` does: find the author's module (CONF-45)
    obj: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    if not isinstance(obj, Backend) and callable(obj):
        obj = obj()
    if not isinstance(obj, Backend):
        raise TypeError(f"{target} is not a conformance Backend (see conformance/README.md)")
    return obj


def conformance_command(
    target: str,
    *,
    json_path: str | None = None,
    markdown: bool = False,
    examples: int = 10,
    timeout: float = DEFAULT_TIMEOUT,
    exit_when_abandoned: bool = False,
    only: Sequence[str] | None = None,
    profile: str | None = None,
) -> int:
    """Run every check; print a table (markdown with ``markdown=True``).

    Exit status: 0 conforms, 1 a MUST failed (CONF-42), 2 the target could not be loaded (CONF-45).
    Each check is abandoned after ``timeout`` seconds (CONF-51); with
    ``exit_when_abandoned`` (the command line) the process then exits at once with
    the status, as an abandoned check's threads may never return.
    """
    try:
        backend = load_backend(target)
    except Exception as exc:
        sys.stderr.write(
            f"refdcp conformance: cannot load {target!r}: {type(exc).__name__}: {exc}\n"
        )
        return 2
    if profile is not None:
        from conformance.profiles import Profiled

        backend = Profiled(backend, profile)
    results = run_checks(backend, examples=examples, timeout=timeout, only=only)
    if json_path is not None:  # first: the report exists whatever happens next (CONF-50)
        Path(json_path).write_text(dumps(backend.name, results), encoding="utf-8")
    if markdown:
        sys.stdout.write(to_markdown(backend.name, results))
    else:
        for r in results:
            sys.stdout.write(
                f"{r.id:<8} {r.level:<10} {r.status:<5} {r.seconds:7.2f} s  {r.title}\n"
            )
            if r.reason:
                sys.stdout.write(f"         {r.reason}\n")
    bad = failed_musts(results)
    sys.stdout.write(
        f"{backend.name}: {len(bad)} failed MUST requirement(s)\n"
        if bad
        else f"{backend.name}: conforms\n"
    )
    if any(r.timed_out for r in results):
        sys.stdout.write(
            f"{backend.name}: {sum(r.timed_out for r in results)} check(s) timed out "
            "and were abandoned\n"
        )
        if exit_when_abandoned:
            exit_now(1 if bad else 0)
    return 1 if bad else 0


def add_arguments(p: Any) -> None:
    """The command-line options, shared with ``refdcp conformance``."""
    p.add_argument("target")
    p.add_argument("--json", dest="json_path")
    p.add_argument("--markdown", action="store_true")
    p.add_argument("--examples", type=int, default=10)
    p.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT,
        help=f"seconds a check may run before it fails as timed out (default {DEFAULT_TIMEOUT:g})",
    )
    p.add_argument("--only", default=None, help="comma-separated requirement IDs to check")
    p.add_argument(
        "--profile",
        choices=["full", "safetensors"],
        default=None,
        help="lay a format's profile over the backend's capabilities (CONF-69)",
    )


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m conformance.cli")
    add_arguments(p)
    a = p.parse_args(argv)
    return conformance_command(
        a.target,
        json_path=a.json_path,
        markdown=a.markdown,
        examples=a.examples,
        timeout=a.timeout,
        exit_when_abandoned=True,
        only=a.only.split(",") if a.only else None,
        profile=a.profile,
    )


def exit_now(rc: int) -> None:
    """Exit with ``rc`` even when an abandoned check's thread never returns (CONF-51)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


if __name__ == "__main__":
    sys.exit(main())
