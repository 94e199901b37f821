"""Object collectives over a torch.distributed process group (spec/comm.md, COMM-50..COMM-53).

Objects are pickled into ``uint8`` tensors. Every collective first all-gathers a
three-integer header ``(operation, sequence number, payload size)`` and then
moves the payloads with one tensor collective. The header makes every rank
check that all ranks called the same collective at the same position
(COMM-7), and gives the size to pad payloads to (``pickle.loads`` ignores
trailing bytes). Tensor collectives are issued with ``async_op=True`` and
polled until a deadline, so a missing or late peer gives
:class:`~refdcp.errors.CommTimeout` after the timeout instead of a hang, on
Gloo and NCCL alike (COMM-5).
"""

from __future__ import annotations

import pickle
import time
from typing import Any

import torch
import torch.distributed as dist

from refdcp.comm.base import DEFAULT_TIMEOUT_S
from refdcp.comm.departures import POLL_S, PeerWatch, store_of
from refdcp.errors import CollectiveMismatch, CommAborted, CommError, CommTimeout
from refdcp.storage.format.items import raw_view

__all__ = ["TorchDistComm"]

_OPS = ("gather", "scatter", "broadcast", "all_gather", "barrier")
_MAX_POLL_S = 0.005
#: An all-gather whose largest payload is over this many bytes moves each rank's payload
#: in broadcasts of its own (see ``TorchDistComm.all_gather``).
BROADCAST_ABOVE = 4 << 20
#: In such an all-gather, buffers of at least this many bytes travel out of band.
OUT_OF_BAND_MIN = 64 << 10


class TorchDistComm:
    """A :class:`Communicator` over ``process_group`` (default: the WORLD group) (COMM-50).

    ``rank`` and ``world_size`` are the group's; the coordinator is group rank
    0, translated to its global rank for torch's ``src``/``dst`` (COMM-50).
    NCCL groups move bytes through the current CUDA device (COMM-51).
    """

    def __init__(self, process_group: Any = None, *, timeout: float = DEFAULT_TIMEOUT_S) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(  # COMM-53
                "TorchDistComm needs an initialised torch.distributed process group"
            )
        if timeout <= 0:
            raise ValueError(f"timeout must be positive, got {timeout}")
        self._group = process_group
        self._rank = dist.get_rank(process_group)
        if self._rank < 0:
            raise ValueError("this process is not a member of the given process group")
        self._world_size = dist.get_world_size(process_group)
        self._coordinator_global = (
            0 if process_group is None else dist.get_global_rank(process_group, 0)
        )
        backend = str(dist.get_backend(process_group)).lower()
        if "gloo" not in backend and "nccl" in backend:
            self._device = torch.device("cuda", torch.cuda.current_device())
        else:
            self._device = torch.device("cpu")
        self._timeout = float(timeout)
        self._seq = 0
        self._broken: str | None = None
        found = store_of(process_group)  # who is missing, who left (COMM-60, COMM-62)
        self._watch = PeerWatch(*found, self._rank, self._world_size) if found else None

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def coordinator_rank(self) -> int:
        return 0

    @property
    def timeout(self) -> float:
        return self._timeout

    @property
    def device(self) -> torch.device:
        """Where the byte tensors live: CPU for Gloo, the current CUDA device for NCCL."""
        return self._device

    # -- collectives -------------------------------------------------------

    def gather(self, obj: Any, *, timeout: float | None = None) -> list[Any] | None:
        data = _dumps(obj)
        deadline, size = self._header("gather", len(data), timeout, max)
        buf = self._to_tensor(data, size)
        is_coord = self._rank == 0
        out = [self._empty(size) for _ in range(self._world_size)] if is_coord else None
        work = dist.gather(buf, out, dst=self._coordinator_global, group=self._group, async_op=True)
        self._wait(work, deadline, "gather")
        if out is None:
            return None
        return [_loads(t) for t in out]

    def scatter(self, objs: list[Any] | None, *, timeout: float | None = None) -> Any:
        pieces: list[bytes] = []
        if self._rank == 0:
            if objs is None or len(objs) != self._world_size:
                raise ValueError(
                    f"scatter on the coordinator needs a list of {self._world_size} objects, "
                    f"got {objs!r}"
                )
            pieces = [_dumps(o) for o in objs]
        deadline, size = self._header(
            "scatter", max((len(p) for p in pieces), default=0), timeout, _coordinator_value
        )
        out = self._empty(size)
        scatter_list = [self._to_tensor(p, size) for p in pieces] if self._rank == 0 else None
        work = dist.scatter(
            out, scatter_list, src=self._coordinator_global, group=self._group, async_op=True
        )
        self._wait(work, deadline, "scatter")
        return _loads(out)

    def broadcast(self, obj: Any, *, timeout: float | None = None) -> Any:
        data = _dumps(obj) if self._rank == 0 else b""
        deadline, size = self._header("broadcast", len(data), timeout, _coordinator_value)
        buf = self._to_tensor(data, size) if self._rank == 0 else self._empty(size)
        work = dist.broadcast(buf, src=self._coordinator_global, group=self._group, async_op=True)
        self._wait(work, deadline, "broadcast")
        return _loads(buf)

    def all_gather(self, obj: Any, *, timeout: float | None = None) -> list[Any]:
        """Small payloads in one all-gather padded to the largest. Once any rank's payload
        is over ``BROADCAST_ABOVE`` bytes, each rank's payload moves in broadcasts of its
        own instead (Gloo broadcasts large buffers several times faster than it all-gathers
        them, and nothing is padded), its large buffers (numpy arrays, bytearrays of at
        least ``OUT_OF_BAND_MIN`` bytes) out of band, without a copy into the pickle
        (COMM-63), as a read-once load's pieces are (ONCE-3)."""
        head, raws = _dumps_out_of_band(obj)
        total = len(head) + sum(r.nbytes for r in raws)
        inband = None if total > BROADCAST_ABOVE else (_dumps(obj) if raws else head)
        announced = total if inband is None else len(inband)
        deadline, sizes = self._header_sizes("all_gather", announced, timeout)
        if max(sizes) > BROADCAST_ABOVE:
            return self._all_gather_by_broadcasts(head, raws, deadline)
        assert inband is not None  # announced <= max(sizes) <= BROADCAST_ABOVE
        size = max(max(sizes), 1)
        out = [self._empty(size) for _ in range(self._world_size)]
        work = dist.all_gather(out, self._to_tensor(inband, size), group=self._group, async_op=True)
        self._wait(work, deadline, "all_gather")
        return [_loads(t) for t in out]

    def _all_gather_by_broadcasts(
        self, head: bytes, raws: list[memoryview], deadline: float
    ) -> list[Any]:
        left = max(deadline - time.monotonic(), 1e-3)
        manifests = self.all_gather([len(head), *(r.nbytes for r in raws)], timeout=left)
        sent: list[tuple[torch.Tensor, list[torch.Tensor]]] = []
        works = []
        for src, (head_len, *lengths) in enumerate(manifests):
            mine = src == self._rank
            head_t = self._to_tensor(head, head_len) if mine else self._empty(head_len)
            if mine:
                bufs = [_writable_tensor(r).to(self._device) for r in raws]  # NCCL: on GPU
            else:
                bufs = [self._empty(n) for n in lengths]
            root = src if self._group is None else dist.get_global_rank(self._group, src)
            for t in [head_t, *bufs]:  # issued together: Gloo may move several at once
                if t.numel():
                    works.append(dist.broadcast(t, src=root, group=self._group, async_op=True))
            sent.append((head_t, bufs))
        for work in works:
            self._wait(work, deadline, "all_gather")
        out: list[Any] = []
        for src, (head_t, bufs) in enumerate(sent):
            if src == self._rank:  # a fresh copy of this rank's own contribution too (COMM-32)
                out.append(pickle.loads(head, buffers=[bytearray(r) for r in raws]))
            else:
                host = [b.cpu().numpy() for b in bufs]
                out.append(pickle.loads(raw_view(head_t.cpu()), buffers=host))
        return out

    def barrier(self, *, timeout: float | None = None) -> None:
        self._header("barrier", 0, timeout, max)

    # -- machinery ---------------------------------------------------------

    def _header(self, op: str, nbytes: int, timeout: float | None, pick: Any) -> tuple[float, int]:
        """Exchange (op, seq, size); check agreement; return (deadline, payload size)."""
        deadline, sizes = self._header_sizes(op, nbytes, timeout)
        size: int = pick(sizes)
        return deadline, max(size, 1)

    def _header_sizes(self, op: str, nbytes: int, timeout: float | None) -> tuple[float, list[int]]:
        """Exchange (op, seq, size); check agreement; return (deadline, every rank's size)."""
        if self._broken is not None:  # COMM-52
            raise CommError(f"communicator unusable after an earlier failure: {self._broken}")
        limit = self._timeout if timeout is None else float(timeout)
        if limit <= 0:
            raise ValueError(f"timeout must be positive, got {limit}")
        deadline = time.monotonic() + limit
        seq = self._seq
        self._seq += 1
        mine = torch.tensor([_OPS.index(op), seq, nbytes], dtype=torch.int64, device=self._device)
        headers = [torch.empty_like(mine) for _ in range(self._world_size)]
        work = dist.all_gather(headers, mine, group=self._group, async_op=True)
        self._wait(work, deadline, op)
        rows = [tuple(int(v) for v in h.tolist()) for h in headers]
        for r, (r_op, r_seq, _) in enumerate(rows):
            if (r_op, r_seq) != (rows[0][0], rows[0][1]):
                raise CollectiveMismatch(
                    f"collective mismatch: rank 0 called {_OPS[rows[0][0]]} "
                    f"(collective #{rows[0][1]}) but rank {r} called {_OPS[r_op]} "
                    f"(collective #{r_seq})"
                )
        return deadline, [row[2] for row in rows]

    def _wait(self, work: Any, deadline: float, op: str) -> None:
        """Poll ``work`` until done or ``deadline``; map failures to CommTimeout/CommAborted."""
        delay = 0.0001
        poll_at = time.monotonic() + POLL_S  # fast collectives never touch the store
        recorded = False
        try:
            while not work.is_completed():
                now = time.monotonic()
                gone = None
                if self._watch is not None and now >= poll_at:
                    poll_at = now + POLL_S
                    if not recorded:  # a slow collective: record that this rank is in it
                        self._watch.entered(self._seq - 1)
                        recorded = True
                    gone = self._watch.departed()
                if gone:
                    self._broken = f"{op} aborted: rank(s) {sorted(gone)} left"
                    aborted = CommAborted(
                        f"{op} on rank {self._rank}: "
                        + "; ".join(f"rank {r} left ({why})" for r, why in sorted(gone.items()))
                    )
                    aborted.ranks = tuple(sorted(gone))  # COMM-62
                    raise aborted
                if now >= deadline:
                    self._broken = f"{op} timed out"
                    raise self._timeout_error(op)
                time.sleep(delay)
                delay = min(delay * 2, _MAX_POLL_S)
        except BaseException as exc:
            if not isinstance(exc, Exception) and self._watch is not None:
                self._broken = f"{op} interrupted by {type(exc).__name__}"
                self._watch.leave(f"interrupted by {type(exc).__name__} in {op}")  # COMM-62
            raise
        try:
            work.wait()
        except Exception as exc:
            self._broken = f"{op} failed: {exc}"
            text = str(exc)
            if "timed out" in text.lower() or "timeout" in text.lower():
                raise CommTimeout(f"{op} on rank {self._rank} timed out: {text}") from exc
            gone = self._watch.departed() if self._watch is not None else {}
            who = "; ".join(f"rank {r} left ({why})" for r, why in sorted(gone.items()))
            aborted = CommAborted(
                f"{op} on rank {self._rank} failed, {who or 'a peer left'}: {text}"
            )
            aborted.ranks = tuple(sorted(gone))  # COMM-60
            raise aborted from exc

    def _timeout_error(self, op: str) -> CommTimeout:
        """A timeout naming the ranks that had not entered this collective, when known (COMM-60)."""
        missing = self._watch.missing(self._seq - 1) if self._watch is not None else []
        who = f"rank(s) {missing} did not enter it" if missing else "a peer is missing or late"
        err = CommTimeout(
            f"{op} on rank {self._rank} of {self._world_size} did not complete within "
            f"its timeout: {who}"
        )
        err.ranks = tuple(missing)
        return err

    def _empty(self, size: int) -> torch.Tensor:
        return torch.empty(size, dtype=torch.uint8, device=self._device)

    def _to_tensor(self, data: bytes, size: int) -> torch.Tensor:
        if len(data) == size:
            buf = bytearray(data)  # one copy, no zero-fill first
        else:
            buf = bytearray(size)
            buf[: len(data)] = data
        t = torch.frombuffer(buf, dtype=torch.uint8)
        return t if self._device.type == "cpu" else t.to(self._device)

    def __repr__(self) -> str:
        return (
            f"TorchDistComm(rank={self._rank}, world_size={self._world_size}, "
            f"device={self._device}, timeout={self._timeout:g})"
        )


def _coordinator_value(values: list[int]) -> int:
    return values[0]


def _dumps_out_of_band(obj: Any) -> tuple[bytes, list[memoryview]]:
    """The pickle of ``obj`` with its large buffers left out (protocol 5), and those buffers."""
    raws: list[memoryview] = []

    def keep(buf: pickle.PickleBuffer) -> bool:
        raw = buf.raw()
        if raw.nbytes < OUT_OF_BAND_MIN:
            return True  # in band
        raws.append(raw)
        return False

    return pickle.dumps(obj, protocol=5, buffer_callback=keep), raws


def _writable_tensor(raw: memoryview) -> torch.Tensor:
    """A uint8 CPU tensor over ``raw`` (a copy only when ``raw`` is read-only)."""
    if raw.readonly:
        raw = memoryview(bytearray(raw))
    return torch.frombuffer(raw, dtype=torch.uint8)


def _dumps(obj: Any) -> bytes:
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def _loads(t: torch.Tensor) -> Any:
    """Unpickle a (possibly padded) byte tensor without numpy."""
    host = t.cpu()
    buf = bytearray(host.numel())
    torch.frombuffer(buf, dtype=torch.uint8).copy_(host)
    return pickle.loads(buf)
