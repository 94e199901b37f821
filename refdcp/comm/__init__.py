"""Communicators: object collectives with timeouts (spec/comm.md).

* :class:`SingleRank` - a world of one; collectives are local.
* :class:`FakeWorld` - N ranks as threads of one process, for tests and teaching.
* :class:`TorchDistComm` - over a ``torch.distributed`` process group (Gloo, NCCL).
"""

from __future__ import annotations

from refdcp.comm.base import DEFAULT_TIMEOUT_S, Communicator, is_coordinator
from refdcp.comm.fake import CollectiveMismatch, FakeComm, FakeWorld, RankFailures
from refdcp.comm.single import SingleRank
from refdcp.comm.torchdist import TorchDistComm

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "CollectiveMismatch",
    "Communicator",
    "FakeComm",
    "FakeWorld",
    "RankFailures",
    "SingleRank",
    "TorchDistComm",
    "is_coordinator",
]
