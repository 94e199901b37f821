"""The worker process behind ``ProcessExecutor`` (asyncsave/executors.py): it writes the snapshot (ASYNC-7).

One worker process per training process, started on first use (``spawn``)
and reused. Snapshots travel through a pipe with torch's multiprocessing
reductions: tensors in shared memory (``CpuStager(cache_staged_state_dict=True,
share_memory=True)``) are passed by handle, other tensors are moved to shared
memory by the sending thread. The worker writes without the training
process's GIL. With torch.distributed initialised, the workers of all ranks
form their own Gloo process group (ASYNC-6), so their collectives never meet
the training loop's.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import queue
import socket
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlanner
from torch.distributed.checkpoint.storage import StorageWriter

from refdcp.asyncsave.groups import checkpoint_process_group
from refdcp.comm.base import Communicator

__all__ = ["Request", "get_worker", "shutdown_worker"]


@dataclass(frozen=True)
class _DistInfo:
    """How the worker joins its own process group (None: single rank)."""

    init_method: str
    rank: int
    world_size: int
    timeout_s: float


@dataclass
class Request:
    staged: dict[str, Any]
    checkpoint_id: Any
    storage_writer: StorageWriter | None
    planner: SavePlanner | None


def _child_main(conn: Any, dist_info: _DistInfo | None) -> None:
    """Worker loop: one save per request, answered with Metadata or the exception."""
    from refdcp.api import save

    comm: Communicator | None = None
    if dist_info is not None:
        # torchrun's trainers find their store through its agent; this worker's group has
        # its own rendezvous address and must create its store, not wait for one (ASYNC-32)
        os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "False"
        dist.init_process_group(
            "gloo",
            init_method=dist_info.init_method,
            rank=dist_info.rank,
            world_size=dist_info.world_size,
            timeout=timedelta(seconds=dist_info.timeout_s),
        )
        from refdcp.comm import TorchDistComm

        comm = TorchDistComm(None, timeout=dist_info.timeout_s)
    conn.send(("ready", None))
    while True:
        try:
            req = conn.recv()
        except EOFError:
            break
        if req is None:
            break
        try:
            if comm is None:
                md = save(
                    req.staged,
                    checkpoint_id=req.checkpoint_id,
                    storage_writer=req.storage_writer,
                    planner=req.planner,
                    no_dist=True,
                )
            else:
                md = save(
                    req.staged,
                    checkpoint_id=req.checkpoint_id,
                    storage_writer=req.storage_writer,
                    planner=req.planner,
                    comm=comm,
                )
            del req
            conn.send(("ok", md))
        except BaseException as exc:
            from refdcp.errors_core import _picklable

            conn.send(("error", _picklable(exc)))
    if dist_info is not None:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


class _Worker:
    """The parent's side: a FIFO of requests served by one dispatcher thread."""

    def __init__(self, dist_info: _DistInfo | None, start_timeout: float) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child_conn = ctx.Pipe()
        self.proc = ctx.Process(
            target=_child_main, args=(child_conn, dist_info), daemon=True, name="refdcp-ckpt"
        )
        self.proc.start()
        child_conn.close()
        if not self._conn.poll(start_timeout):
            self.proc.kill()
            raise TimeoutError(f"the checkpoint worker process did not start in {start_timeout} s")
        try:
            self._conn.recv()
        except (EOFError, OSError) as exc:
            self.proc.join(5)
            raise RuntimeError(
                "the checkpoint worker process exited while starting (exit code "
                f"{self.proc.exitcode}); executor='process' starts it with multiprocessing's "
                "'spawn', so the main script must be guarded by `if __name__ == '__main__':`"
            ) from exc
        self._queue: queue.Queue[tuple[Request, Future[Metadata]] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._serve, daemon=True, name="refdcp-ckpt-io")
        self._thread.start()
        self.alive = True

    def submit(self, req: Request) -> Future[Metadata]:
        fut: Future[Metadata] = Future()
        self._queue.put((req, fut))
        return fut

    def _serve(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            req, fut = item
            if not self.alive:
                fut.set_exception(RuntimeError("the checkpoint worker process has died"))
                continue
            try:
                self._conn.send(req)  # pickles first: a pickling error sends nothing
            except (EOFError, OSError) as exc:
                self.alive = False
                fut.set_exception(RuntimeError(f"the checkpoint worker process died: {exc!r}"))
                continue
            except Exception as exc:
                err = TypeError(
                    "async_save(executor='process') could not send the save to the worker "
                    f"process (the writer, planner and staged state must pickle): {exc!r}"
                )
                err.__cause__ = exc
                fut.set_exception(err)
                continue
            finally:
                del req, item
            try:
                kind, value = self._conn.recv()
            except (EOFError, OSError) as exc:
                self.alive = False
                fut.set_exception(RuntimeError(f"the checkpoint worker process died: {exc!r}"))
                continue
            except Exception as exc:  # the reply arrived whole but did not unpickle here
                fut.set_exception(
                    RuntimeError(f"the worker's reply could not be unpickled: {exc!r}")
                )
                continue
            if kind == "ok":
                fut.set_result(value)
            else:
                fut.set_exception(value)

    def shutdown(self, timeout: float = 30.0) -> None:
        self._queue.put(None)
        self._thread.join(timeout)
        with contextlib.suppress(Exception):
            self._conn.send(None)
        self.proc.join(timeout)
        if self.proc.is_alive():
            self.proc.kill()
        self.alive = False


#: One worker per (distributed?, process group): a worker set up for one mode
#: must never run a save of another (ASYNC-14).
_WORKERS: dict[tuple[bool, Any], _Worker] = {}
_WORKER_LOCK = threading.Lock()


def _group_key(process_group: Any, distributed: bool) -> tuple[bool, Any]:
    if not distributed:
        return (False, None)
    if process_group is None:
        return (True, "default")
    return (True, tuple(dist.get_process_group_ranks(process_group)))


def _dist_info(process_group: Any, timeout_s: float) -> _DistInfo:
    """Agree on a rendezvous address for the workers' own group (collective on the caller)."""
    group = checkpoint_process_group(process_group)
    rank = dist.get_rank(group)
    world = dist.get_world_size(group)
    box: list[Any] = [None]
    if rank == 0:
        host = os.environ.get("MASTER_ADDR", "127.0.0.1")
        with socket.socket() as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        box[0] = f"tcp://{host}:{port}"
    src = dist.get_global_rank(group, 0)
    dist.broadcast_object_list(box, src=src, group=group)
    return _DistInfo(str(box[0]), rank, world, timeout_s)


def get_worker(process_group: Any, distributed: bool, timeout_s: float) -> _Worker:
    key = _group_key(process_group, distributed)
    with _WORKER_LOCK:
        worker = _WORKERS.get(key)
        if worker is None or not worker.alive:
            info = _dist_info(process_group, timeout_s) if distributed else None
            worker = _WORKERS[key] = _Worker(info, start_timeout=timeout_s)
        return worker


def shutdown_worker() -> None:
    """Stop every worker process that was started (also run at interpreter exit)."""
    with _WORKER_LOCK:
        workers = list(_WORKERS.values())
        _WORKERS.clear()
    for worker in workers:
        worker.shutdown()


atexit.register(shutdown_worker)
