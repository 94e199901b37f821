"""The object a storage author hands to the conformance suite (spec/conformance.md).

A backend builds writers and readers for fresh checkpoint locations and
declares what it promises beyond the base contract (CONF-41): a check whose
capability is not declared reports "not applicable" with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from torch.distributed.checkpoint.storage import StorageReader, StorageWriter

__all__ = ["Backend", "Capabilities"]


@dataclass(frozen=True)
class Capabilities:
    """What a backend promises beyond the base contract.

    * ``overwrite``: a new save into a location that holds a committed
      checkpoint replaces it (CONF-26).
    * ``atomic_overwrite``: a failed save into such a location leaves the
      earlier checkpoint loadable and bit-exact (CONF-29).
    * ``concurrent_readers``: several readers may load one checkpoint at the
      same time from several threads (CONF-18).
    * ``thread_count``: ``Backend.writer`` honours ``thread_count > 1`` (CONF-19).
    * ``shared_location``: the writers of several ranks may target one
      location, as on a shared filesystem or object store (CONF-16, CONF-17).
      Declare False for rank-local storage that only a single rank can use:
      every check then drives one rank per location (CONF-55).
    * ``bytes_items``: the backend stores bytes items (``BytesIO``, pickled
      objects) besides tensors (CONF-13). Only CONF-13 saves them (CONF-52).
    * ``dtypes``: the names (``"float32"``, ...) of the dtypes the backend stores;
      ``None``, every dtype. CONF-10 saves only these and names the others (CONF-69).
    * ``why``: ``(capability, reason)`` pairs saying why a capability is not
      declared or a dtype is left out; a not-applicable result quotes the reason
      (CONF-69). A profile (``conformance/profiles.py``) fills it in.
    * ``process_async``: a writer survives pickling and its unpickled copy saves
      where the original would, as torch's process-based ``async_save`` needs
      (CONF-64). Declare False for storage a pickled copy cannot share (in-memory).
    """

    overwrite: bool = True
    atomic_overwrite: bool = False
    concurrent_readers: bool = True
    thread_count: bool = False
    shared_location: bool = True
    bytes_items: bool = True
    dtypes: tuple[str, ...] | None = None
    why: tuple[tuple[str, str], ...] = ()

    def reason(self, capability: str) -> str:
        """Why ``capability`` is not declared, or ``""`` when no reason was given."""
        return dict(self.why).get(capability, "")

    process_async: bool = True


@runtime_checkable
class Backend(Protocol):
    """A storage implementation under test.

    ``new_location(scratch)`` returns a checkpoint id for a fresh, empty
    location; ``scratch`` is a new empty directory the suite deletes
    afterwards (backends that do not use the local disk may ignore it).
    ``writer(location, rank=..., thread_count=...)`` and ``reader(location)``
    build fresh objects for that location; the suite never shares one writer
    between ranks.
    """

    @property
    def name(self) -> str: ...

    @property
    def capabilities(self) -> Capabilities: ...

    def new_location(self, scratch: Path) -> Any: ...

    def writer(self, location: Any, *, rank: int, thread_count: int = 1) -> StorageWriter: ...

    def reader(self, location: Any) -> StorageReader: ...
