"""StorageReader wrappers that count what a load reads, or model a slow shared storage (ONCE-5).

:class:`CountingReader` wraps any reader and counts, per ``read_data`` call,
the stored bytes of every stored item the plan's reads touch (each stored item
once per call: the unit a reader fetches and checks whole, LOAD-17) and the
number of such items (requests). :class:`ModelledReader` also makes each
request wait on a :class:`SharedLink` (one storage system shared by every
rank): its bytes take ``bytes / bandwidth`` of the link's time, one request
after another, plus ``latency`` seconds each, as a benchmark's model of a
network file system or object store.
"""

from __future__ import annotations

import inspect
import threading
import time
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

__all__ = ["CountingReader", "ModelledReader", "SharedLink"]


class CountingReader(StorageReader):
    """``inner`` with ``bytes_read`` and ``requests`` counted over every ``read_data`` call."""

    def __init__(self, inner: StorageReader) -> None:
        self.inner = inner
        self.bytes_read = 0
        self.requests = 0
        self._lengths: dict[Any, int] = {}

    @property
    def checkpoint_id(self) -> Any:
        return getattr(self.inner, "checkpoint_id", None)

    def reset(self, checkpoint_id: Any = None) -> None:
        self.inner.reset(checkpoint_id)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False

    def set_verify(self, verify: bool | None) -> None:
        set_verify = getattr(self.inner, "set_verify", None)
        if set_verify is not None:
            set_verify(verify)
        elif verify:
            raise ValueError(f"verify=True needs a reader with checksums, not {self.inner!r}")

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return self.inner.read_metadata(*args, **kwargs)

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        data = metadata.storage_data if isinstance(metadata.storage_data, dict) else {}
        self._lengths = {k: int(getattr(v, "length", 0)) for k, v in data.items()}
        params = inspect.signature(self.inner.set_up_storage_reader).parameters.values()
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
            self.inner.set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        else:  # torch's older signature (LOAD-1)
            self.inner.set_up_storage_reader(metadata, is_coordinator)

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return self.inner.prepare_local_plan(plan)

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return self.inner.prepare_global_plan(plans)

    def stored_items(self, plan: LoadPlan) -> list[int]:
        """The stored bytes of each distinct stored item ``plan`` reads."""
        seen: dict[Any, int] = {}
        for item in plan.items:
            seen.setdefault(item.storage_index, self._lengths.get(item.storage_index, 0))
        return list(seen.values())

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        sizes = self.stored_items(plan)
        self.bytes_read += sum(sizes)
        self.requests += len(sizes)
        self.before_read(sizes)
        return self.inner.read_data(plan, planner)

    def before_read(self, sizes: list[int]) -> None:
        """Called with the stored items' sizes before the inner reader reads them."""


class SharedLink:
    """One storage system's link shared by every rank: ``bandwidth`` bytes/s for one
    request at a time, and ``latency`` seconds added to each request."""

    def __init__(self, bandwidth: float, latency: float) -> None:
        if bandwidth <= 0 or latency < 0:
            raise ValueError("bandwidth must be positive and latency not negative")
        self.bandwidth = bandwidth
        self.latency = latency
        self._lock = threading.Lock()
        self._free_at = 0.0
        self.busy_s = 0.0  # link time taken by all requests so far

    def transfer(self, nbytes: int) -> None:
        """Wait as one request of ``nbytes`` would: its turn on the link, then its latency."""
        with self._lock:
            now = time.monotonic()
            start = max(now, self._free_at)
            self._free_at = start + nbytes / self.bandwidth
            self.busy_s += nbytes / self.bandwidth
            done = self._free_at + self.latency
        time.sleep(max(done - time.monotonic(), 0.0))


class ModelledReader(CountingReader):
    """A :class:`CountingReader` whose reads first wait on ``link`` (the modelled storage)."""

    def __init__(self, inner: StorageReader, link: SharedLink) -> None:
        super().__init__(inner)
        self.link = link

    def before_read(self, sizes: list[int]) -> None:
        for n in sizes:
            self.link.transfer(n)
