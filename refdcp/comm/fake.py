"""N ranks in one process, one thread each (spec/comm.md, COMM-30..COMM-36).

``FakeWorld(n).run(fn, *args)`` calls ``fn(comm, *args)`` once per rank, each
in its own thread, and returns the per-rank results in rank order. The
collectives are real rendezvous: a rank blocks until every rank has joined the
same collective. Ranks must call the same collectives in the same order; a
disagreement raises :class:`CollectiveMismatch` on every rank involved instead
of hanging (COMM-7). A rank whose ``fn`` has left (raised or returned) makes peers that
wait for it raise :class:`~refdcp.errors.CommAborted`; a collective that does
not complete in time raises :class:`~refdcp.errors.CommTimeout`.

Every object a rank receives is a fresh ``pickle`` round trip of what the
sender passed (its own contribution included), so ranks share no mutable
state through collectives, as with a real process group (COMM-32).
"""

from __future__ import annotations

import pickle
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from refdcp.errors import (
    CheckpointError,
    CollectiveMismatch,
    CommAborted,
    CommTimeout,
    RankFailures,
)

__all__ = ["CollectiveMismatch", "FakeComm", "FakeWorld", "RankFailures"]


@dataclass
class _Round:
    """One collective, identified by its position in every rank's call sequence."""

    seq: int
    kind: str
    first_rank: int
    payloads: dict[int, bytes] = field(default_factory=dict)
    error: BaseException | None = None
    complete: bool = False
    collected: int = 0


class _Hub:
    """Shared rendezvous state of one :meth:`FakeWorld.run`."""

    def __init__(self, world_size: int, coordinator_rank: int) -> None:
        self.world_size = world_size
        self.coordinator_rank = coordinator_rank
        self.cond = threading.Condition()
        self.rounds: dict[int, _Round] = {}
        self.departed: dict[int, str] = {}

    def exchange(
        self, rank: int, seq: int, kind: str, payload: bytes, timeout: float
    ) -> dict[int, bytes]:
        """Deposit this rank's payload for collective ``seq`` and wait for all ranks."""
        deadline = time.monotonic() + timeout
        with self.cond:
            rnd = self.rounds.get(seq)
            if rnd is None:
                rnd = _Round(seq=seq, kind=kind, first_rank=rank)
                self.rounds[seq] = rnd
            if rnd.error is None and rnd.kind != kind:
                rnd.error = CollectiveMismatch(
                    f"collective #{seq}: rank {rnd.first_rank} called {rnd.kind} "
                    f"but rank {rank} called {kind}"
                )
                self.cond.notify_all()
            rnd.payloads[rank] = payload
            if rnd.error is None and len(rnd.payloads) == self.world_size:
                rnd.complete = True
                self.cond.notify_all()
            while True:
                if rnd.error is not None:
                    self._collect(rnd)
                    raise rnd.error
                if rnd.complete:
                    self._collect(rnd)
                    return rnd.payloads
                missing = [r for r in range(self.world_size) if r not in rnd.payloads]
                gone = {r: self.departed[r] for r in missing if r in self.departed}
                if gone:
                    rnd.error = aborted = CommAborted(
                        f"collective #{seq} ({kind}) on rank {rank}: "
                        + "; ".join(f"rank {r} {why}" for r, why in sorted(gone.items()))
                        + " before joining it"
                    )
                    aborted.ranks = tuple(sorted(gone))  # COMM-60
                    self.cond.notify_all()
                    continue
                left = deadline - time.monotonic()
                if left <= 0:
                    rnd.error = late = CommTimeout(
                        f"collective #{seq} ({kind}) timed out after {timeout:g} s on rank "
                        f"{rank}: rank(s) {missing} did not join"
                    )
                    late.ranks = tuple(missing)  # COMM-60
                    self.cond.notify_all()
                    continue
                self.cond.wait(left)

    def _collect(self, rnd: _Round) -> None:
        """Forget a completed round once every rank has taken its answer.

        A failed round stays recorded so that late joiners raise its error.
        """
        rnd.collected += 1
        if rnd.complete and rnd.collected >= self.world_size:
            del self.rounds[rnd.seq]

    def depart(self, rank: int, why: str) -> None:
        with self.cond:
            self.departed[rank] = why
            self.cond.notify_all()


class FakeComm:
    """One rank's view of a :class:`FakeWorld` run; a :class:`Communicator` (COMM-30)."""

    def __init__(self, hub: _Hub, rank: int, timeout: float) -> None:
        self._hub = hub
        self._rank = rank
        self._timeout = timeout
        self._seq = 0
        self._lock = threading.Lock()

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._hub.world_size

    @property
    def coordinator_rank(self) -> int:
        return self._hub.coordinator_rank

    @property
    def timeout(self) -> float:
        return self._timeout

    def _exchange(self, kind: str, obj: Any, timeout: float | None) -> dict[int, bytes]:
        limit = self._timeout if timeout is None else float(timeout)
        if limit <= 0:
            raise ValueError(f"timeout must be positive, got {limit}")
        payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        with self._lock:
            seq = self._seq
            self._seq += 1
        return self._hub.exchange(self._rank, seq, kind, payload, limit)

    def _is_coordinator(self) -> bool:
        return self._rank == self._hub.coordinator_rank

    def gather(self, obj: Any, *, timeout: float | None = None) -> list[Any] | None:
        got = self._exchange("gather", obj, timeout)
        if not self._is_coordinator():
            return None
        return [pickle.loads(got[r]) for r in range(self.world_size)]

    def scatter(self, objs: list[Any] | None, *, timeout: float | None = None) -> Any:
        if self._is_coordinator():
            if objs is None or len(objs) != self.world_size:
                raise ValueError(
                    f"scatter on the coordinator needs a list of {self.world_size} objects, "
                    f"got {objs!r}"
                )
            sent: Any = list(objs)
        else:
            sent = None
        got = self._exchange("scatter", sent, timeout)
        pieces = pickle.loads(got[self.coordinator_rank])
        return pieces[self._rank]

    def broadcast(self, obj: Any, *, timeout: float | None = None) -> Any:
        got = self._exchange("broadcast", obj if self._is_coordinator() else None, timeout)
        return pickle.loads(got[self.coordinator_rank])

    def all_gather(self, obj: Any, *, timeout: float | None = None) -> list[Any]:
        got = self._exchange("all_gather", obj, timeout)
        return [pickle.loads(got[r]) for r in range(self.world_size)]

    def barrier(self, *, timeout: float | None = None) -> None:
        self._exchange("barrier", None, timeout)

    def __repr__(self) -> str:
        return f"FakeComm(rank={self._rank}, world_size={self.world_size})"


class FakeWorld:
    """A world of ``world_size`` ranks run as threads of this process (COMM-30)."""

    def __init__(
        self, world_size: int, *, coordinator_rank: int = 0, timeout: float = 60.0
    ) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if not 0 <= coordinator_rank < world_size:
            raise ValueError(f"coordinator_rank {coordinator_rank} not in range({world_size})")
        if timeout <= 0:
            raise ValueError(f"timeout must be positive, got {timeout}")
        self.world_size = world_size
        self.coordinator_rank = coordinator_rank
        self.timeout = float(timeout)

    def run(
        self,
        fn: Callable[..., Any],
        *args: Any,
        return_exceptions: bool = False,
        timeout: float | None = None,
    ) -> list[Any]:
        """Call ``fn(comm, *args)`` on every rank and return the results in rank order.

        If a rank raises: with ``return_exceptions`` the exception takes that
        rank's place in the list; otherwise, when every rank raised an
        equivalent :class:`CheckpointError` the coordinator's is re-raised, else
        :class:`RankFailures` (COMM-34). ``timeout`` bounds the whole run
        (``None``: no bound beyond each collective's own); when it expires
        :class:`CommTimeout` names the ranks still running (COMM-35).
        """
        hub = _Hub(self.world_size, self.coordinator_rank)
        results: dict[int, Any] = {}
        errors: dict[int, BaseException] = {}

        def body(rank: int) -> None:
            comm = FakeComm(hub, rank, self.timeout)
            try:
                results[rank] = fn(comm, *args)
            except BaseException as exc:
                errors[rank] = exc
                hub.depart(rank, f"raised {type(exc).__name__}: {exc}")
            else:
                hub.depart(rank, "returned")

        threads = [
            threading.Thread(target=body, args=(r,), name=f"fakeworld-rank{r}", daemon=True)
            for r in range(self.world_size)
        ]
        for t in threads:
            t.start()
        deadline = None if timeout is None else time.monotonic() + timeout
        for t in threads:
            t.join(None if deadline is None else max(deadline - time.monotonic(), 0.0))
        running = [r for r, t in enumerate(threads) if t.is_alive()]
        if running:
            for r in running:
                hub.depart(r, "was abandoned by FakeWorld.run after its timeout")
            raise CommTimeout(
                f"FakeWorld.run timed out after {timeout:g} s; rank(s) {running} still running"
            )
        if errors and not return_exceptions:
            raise _combine(errors, results, self.world_size, self.coordinator_rank)
        return [errors[r] if r in errors else results[r] for r in range(self.world_size)]


def _combine(
    errors: dict[int, BaseException],
    results: dict[int, Any],
    world_size: int,
    coordinator_rank: int,
) -> BaseException:
    """The coordinator's CheckpointError if every rank raised an equivalent one."""
    if len(errors) == world_size and all(isinstance(e, CheckpointError) for e in errors.values()):
        keys = {
            (e.step, tuple(sorted(e.rank_failures)), e.committed)
            for e in errors.values()
            if isinstance(e, CheckpointError)
        }
        if len(keys) == 1:
            return errors[coordinator_rank]
    return RankFailures(errors, results)
