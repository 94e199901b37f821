"""Who is missing, and who left: a side channel through the process group's store (COMM-60, COMM-62).

A tensor collective cannot say which peer is missing when it times out, and a
peer interrupted inside a collective cannot send anything through it. So each
:class:`~refdcp.comm.torchdist.TorchDistComm` also keeps, in the group's
key-value store (the ``TCPStore`` every process group has):

* ``<ns>/at/<rank>``: the number of the collective the rank last waited in
  for more than :data:`POLL_S` seconds (a collective that misses a rank makes
  every present rank wait that long), read on a timeout to name the ranks
  that never entered it;
* ``<ns>/left/<rank>`` and the counter ``<ns>/left``: a departure notice a rank
  writes when a ``BaseException`` interrupts it inside a collective; waiting
  peers poll the counter once a collective has waited :data:`POLL_S` seconds (then every
  :data:`POLL_S` seconds) and raise ``CommAborted`` naming it instead of waiting for their
  timeout. A collective that completes sooner never touches the store.

``<ns>`` names the group and the communicator's creation index in the group,
which agree across ranks since every rank creates its communicators in the
same order. Every store operation is best effort: if the store fails, the
communicator behaves as without this channel.
"""

from __future__ import annotations

from typing import Any

__all__ = ["POLL_S", "PeerWatch", "store_of"]

#: How often a waiting rank looks for departure notices (seconds).
POLL_S = 0.2

_INSTANCES: dict[str, int] = {}


def store_of(process_group: Any) -> tuple[Any, str] | None:
    """The group's store and a name for the group, or None when unavailable."""
    try:
        import torch.distributed.distributed_c10d as c10d

        if process_group is None:
            return c10d._get_default_store(), "world"
        return c10d._get_process_group_store(process_group), str(process_group.group_name)
    except Exception:  # private API moved, or a group without a store
        return None


class PeerWatch:
    """One communicator's view of the side channel."""

    def __init__(self, store: Any, group: str, rank: int, world_size: int) -> None:
        index = _INSTANCES.get(group, 0)
        _INSTANCES[group] = index + 1
        self.store = store
        self.ns = f"refdcp/comm/{group}/{index}"
        self.rank = rank
        self.world_size = world_size

    def entered(self, seq: int) -> None:
        """Record that this rank entered collective ``seq``."""
        self._try(self.store.set, f"{self.ns}/at/{self.rank}", str(seq))

    def leave(self, why: str) -> None:
        """Announce that this rank leaves: peers waiting in a collective stop at once."""
        if self._try(self.store.set, f"{self.ns}/left/{self.rank}", why) is not _FAILED:
            self._try(self.store.add, f"{self.ns}/left", 1)

    def departed(self) -> dict[int, str]:
        """Ranks that announced their departure (one store round trip when none did)."""
        count = self._try(self.store.add, f"{self.ns}/left", 0)
        if count is _FAILED or not count:
            return {}
        out: dict[int, str] = {}
        for r in range(self.world_size):
            key = f"{self.ns}/left/{r}"
            if r != self.rank and self._try(self.store.check, [key]) is True:
                value = self._try(self.store.get, key)
                out[r] = value.decode(errors="replace") if isinstance(value, bytes) else "left"
        return out

    def missing(self, seq: int) -> list[int]:
        """Ranks that had not entered collective ``seq`` (best effort)."""
        out = []
        for r in range(self.world_size):
            if r == self.rank:
                continue
            key = f"{self.ns}/at/{r}"
            if self._try(self.store.check, [key]) is not True:
                out.append(r)
                continue
            value = self._try(self.store.get, key)
            try:
                if int(value) < seq:
                    out.append(r)
            except (TypeError, ValueError):
                continue
        return out

    @staticmethod
    def _try(fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except Exception:
            return _FAILED


_FAILED: Any = object()
