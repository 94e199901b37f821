"""Spawned torch.distributed process groups for tests (spec/comm.md, COMM-20..COMM-23).

``run_gloo(world_size, fn, *args)`` starts ``world_size`` fresh processes, joins
them in a process group over loopback TCP and calls ``fn(rank, world_size,
*args)`` in each. Results come back in rank order. A failing rank, a rank that
dies without reporting, or the overall timeout terminates every child and
raises :class:`SpawnError` carrying every failing rank's traceback text; the
parent never waits longer than ``timeout`` (plus a short kill grace).

The rendezvous store is a ``TCPStore`` server owned by the parent and bound to
an OS-chosen port on 127.0.0.1, so there is no free-port race between picking
a port and binding it (COMM-21).

Gloo's full-mesh connect on a loaded loopback occasionally fails with
"Connection closed by peer". No rank calls ``fn`` before every rank has joined
the group (a gate in the store), so a group whose only failures are such
connect errors before that gate is started again, on a fresh store, at most
``_RENDEZVOUS_RETRIES`` times within the same timeout (COMM-25).
"""

from __future__ import annotations

import os
import pickle
import re
import signal
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

from refdcp.errors import SpawnError

__all__ = ["SpawnError", "run_gloo"]

_LOOPBACK = "127.0.0.1"
# Seconds to keep collecting other ranks' reports after the first failure,
# so the error shows every rank that failed, not only the fastest.
_FAILURE_GRACE_S = 1.0
_KILL_GRACE_S = 5.0
_RENDEZVOUS_RETRIES = 2
# Store keys of the gate every rank passes before calling fn (COMM-25).
_JOINED_KEY = "refdcp_spawn/joined"
_GO_KEY = "refdcp_spawn/go"
# Transport errors of a group's connect step that say nothing about fn or the
# code under test; only these are retried (COMM-25).
_TRANSIENT_CONNECT = re.compile(
    r"connectFullMesh failed|Connection closed by peer|Connection reset by peer"
    r"|Connection refused"
)
# Test hook: "<attempts>" makes rank 0 fail its first <attempts> connects.
_INJECT_ENV = "REFDCP_SPAWN_INJECT_CONNECT_FAILURES"


def _child(
    rank: int,
    world_size: int,
    port: int,
    backend: str,
    timeout: float,
    context: tuple[list[str], dict[str, str], str],
    payload: bytes,
    results: Any,
    attempt: int = 0,
) -> None:
    """Entry point of one spawned rank; always reports exactly one message.

    A message is ``(rank, ok, data, gated)``: ``gated`` is false for a failure
    raised before this rank joined the gate, so before any rank called ``fn``.
    """
    gated = False
    # A fork server started while its parent ignored SIGINT hands that on to every child,
    # where Ctrl-C (or _thread.interrupt_main) would then do nothing: a rank takes Python's
    # usual KeyboardInterrupt handler, as a process started from a shell has.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    # A fork server keeps the sys.path, environment and working directory of
    # its own start; give the child the caller's as they are now.
    sys_path, environ, cwd = context
    sys.path[:0] = [p for p in sys_path if p not in sys.path]
    os.environ.clear()
    os.environ.update(environ)
    os.environ["OMP_NUM_THREADS"] = "1"
    # The variables torchrun sets, for code that reads them.
    for name, value in (("RANK", rank), ("LOCAL_RANK", rank), ("WORLD_SIZE", world_size)):
        os.environ[name] = str(value)
    os.environ["LOCAL_WORLD_SIZE"] = str(world_size)
    inject = int(os.environ.get(_INJECT_ENV, "0") or "0")
    try:
        os.chdir(cwd)
        import datetime

        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        fn, args = pickle.loads(payload)
        store = dist.TCPStore(  # type: ignore[attr-defined]
            _LOOPBACK,
            port,
            world_size=world_size,
            is_master=False,
            timeout=datetime.timedelta(seconds=timeout),
        )
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        if rank == 0 and attempt < inject:
            raise RuntimeError(
                "Gloo connectFullMesh failed with [injected by "
                f"{_INJECT_ENV}] Connection closed by peer (attempt {attempt})"
            )
        dist.init_process_group(
            backend,
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout),
        )
        # The gate: fn runs only once every rank is in the group (COMM-25).
        gated = True
        if store.add(_JOINED_KEY, 1) == world_size:
            store.set(_GO_KEY, "1")
        store.wait([_GO_KEY])
        try:
            value = fn(rank, world_size, *args)
            data = pickle.dumps(value)
        finally:
            dist.destroy_process_group()
    except BaseException as exc:
        text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        results.put((rank, False, text.encode(), gated))
        return
    results.put((rank, True, data, True))


def run_gloo(
    world_size: int,
    fn: Callable[..., Any],
    *args: Any,
    timeout: float = 120.0,
    backend: str = "gloo",
    start_method: str = "forkserver",
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` fresh ranks (COMM-20).

    ``fn`` and ``args`` must pickle (``fn`` a top-level function). Returns the
    per-rank return values in rank order; raises :class:`SpawnError` on any
    failure or when ``timeout`` seconds pass (COMM-22, COMM-23).

    Each child sees the caller's current ``sys.path``, environment and working
    directory, plus ``OMP_NUM_THREADS=1`` and torchrun's ``RANK``,
    ``LOCAL_RANK``, ``WORLD_SIZE`` and ``LOCAL_WORLD_SIZE``; NCCL children use
    CUDA device ``rank % device_count``.

    ``start_method`` is ``"forkserver"`` (default) or ``"spawn"``. Both start
    children from a clean interpreter, never by forking the (threaded) caller.
    The fork server imports torch once per calling process, so later groups
    start in about 0.1 s instead of 2-3 s per rank for ``"spawn"`` (COMM-24).
    """
    import torch.multiprocessing as mp

    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    payload = pickle.dumps((fn, args))
    context = (list(sys.path), dict(os.environ), os.getcwd())
    if start_method not in ("forkserver", "spawn"):
        raise ValueError(f"start_method must be 'forkserver' or 'spawn', got {start_method!r}")
    ctx: Any = mp.get_context(start_method)
    if start_method == "forkserver":
        ctx.set_forkserver_preload(["torch", "torch.distributed", __name__])
    deadline = time.monotonic() + timeout
    attempt = 0
    while True:
        try:
            return _run_once(ctx, world_size, backend, deadline, timeout, context, payload, attempt)
        except SpawnError as err:
            # A retry never reruns fn: no rank passed the gate (COMM-25).
            if not err.before_fn_only or attempt >= _RENDEZVOUS_RETRIES:
                raise
            if deadline - time.monotonic() < 1.0:
                raise
            attempt += 1


def _run_once(
    ctx: Any,
    world_size: int,
    backend: str,
    deadline: float,
    timeout: float,
    context: tuple[list[str], dict[str, str], str],
    payload: bytes,
    attempt: int,
) -> list[Any]:
    """One start of the group on a fresh store; raises SpawnError on failure."""
    import torch.distributed as dist

    results = ctx.SimpleQueue()
    # The parent owns the store server: the OS picks a free loopback port.
    store = dist.TCPStore(  # type: ignore[attr-defined]
        _LOOPBACK, 0, world_size=None, is_master=True, wait_for_workers=False
    )
    port = store.port
    left = max(deadline - time.monotonic(), 0.001)
    procs = []
    try:
        for rank in range(world_size):
            proc = ctx.Process(
                target=_child,
                args=(rank, world_size, port, backend, left, context, payload, results, attempt),
                name=f"refdcp-rank{rank}",
                daemon=True,
            )
            proc.start()
            procs.append(proc)
        return _collect(procs, results, world_size, deadline, timeout)
    finally:
        _terminate(procs)
        results.close()
        del store


def _collect(
    procs: list[Any], results: Any, world_size: int, deadline: float, timeout: float
) -> list[Any]:
    """Wait for one report per rank, a failure, a silent death, or the deadline."""
    values: dict[int, Any] = {}
    failures: dict[int, str] = {}
    reported: set[int] = set()
    failure_deadline: float | None = None
    transient: set[int] = set()  # ranks whose failure came before the gate, connecting
    reader = _QueueReader(results)
    while len(reported) < world_size:
        now = time.monotonic()
        if failure_deadline is not None and now >= failure_deadline:
            break
        if now >= deadline:
            for rank in range(world_size):
                if rank not in reported:
                    failures[rank] = f"did not finish within the {timeout:g} s timeout"
            raise SpawnError(
                f"run_gloo: timed out after {timeout:g} s; rank(s) "
                f"{sorted(set(range(world_size)) - reported)} still running",
                failures,
                timed_out=True,
                results=values,
            )
        msg = reader.get(min(0.05, max(deadline - now, 0.0)))
        if msg is None:
            for rank, proc in enumerate(procs):
                if rank not in reported and proc.exitcode is not None:
                    # Give the pipe a moment: a report may still be in flight.
                    late = reader.get(0.2)
                    if late is not None:
                        msg = late
                        break
                    reported.add(rank)
                    failures[rank] = f"process exited with code {proc.exitcode} without reporting"
                    if failure_deadline is None:
                        failure_deadline = time.monotonic() + _FAILURE_GRACE_S
            if msg is None:
                continue
        rank, ok, data, gated = msg
        reported.add(rank)
        if ok:
            values[rank] = pickle.loads(data)
        else:
            failures[rank] = data.decode()
            if not gated and _TRANSIENT_CONNECT.search(failures[rank]):
                transient.add(rank)
            if failure_deadline is None:
                failure_deadline = time.monotonic() + _FAILURE_GRACE_S
    if failures:
        silent = sorted(set(range(world_size)) - reported)
        note = f"; rank(s) {silent} were terminated while still running" if silent else ""
        err = SpawnError(
            f"run_gloo: rank(s) {sorted(failures)} failed{note}",
            failures,
            timed_out=False,
            results=values,
        )
        err.before_fn_only = transient == set(failures)
        raise err
    return [values[rank] for rank in range(world_size)]


class _QueueReader:
    """Polls a multiprocessing SimpleQueue with a timeout."""

    def __init__(self, q: Any) -> None:
        self._reader = q._reader
        self._q = q

    def get(self, timeout: float) -> tuple[int, bool, bytes, bool] | None:
        if not self._reader.poll(timeout):
            return None
        msg: tuple[int, bool, bytes, bool] = self._q.get()
        return msg


def _terminate(procs: list[Any]) -> None:
    """Terminate and reap every child; SIGKILL the ones that ignore SIGTERM."""
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    end = time.monotonic() + _KILL_GRACE_S
    for proc in procs:
        proc.join(max(end - time.monotonic(), 0.0))
        if proc.is_alive():
            proc.kill()
            proc.join(_KILL_GRACE_S)
    for proc in procs:
        if not proc.is_alive():
            proc.close()
