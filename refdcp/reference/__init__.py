"""refdcp's reference path: the whole save and load, written to be read (spec/reference.md).

``import refdcp.reference as dcp`` gives ``save`` and ``load`` with the meaning of
``refdcp.save`` and ``refdcp.load`` and their parameters: the same protocol
tables and communicators (driven by its own loop and step bodies), the same
on-disk format, dedup rule and metadata checks, with none of the fast path's
speed idioms. The default ``refdcp`` is the same rule,
faster; tests run the shared property suites against both and compare them
(REF-1..REF-6).

Read in this order: :mod:`.api` (save/load), :mod:`.run` (what a rank does at each
step of the protocol), :mod:`.save_planner` with
:mod:`.dedup` and :mod:`.metadata`, :mod:`.storage` with :mod:`.format`, then
:mod:`.load_planner`.
``async_save`` (:mod:`.async_save`) stages with :mod:`.staging` and runs
``save`` on a background thread (REF-10, REF-11).
"""

from refdcp.errors import (
    CheckpointError,
    CommAborted,
    CommError,
    CommTimeout,
    ProtocolError,
    RefdcpError,
)
from refdcp.reference.api import load, save
from refdcp.reference.async_save import AsyncSaveHandle, InFlightLimiter, async_save
from refdcp.reference.dedup import Decision, reference_dedup
from refdcp.reference.load_planner import ReferenceLoadPlanner
from refdcp.reference.local_shards import LocalShards
from refdcp.reference.metadata import reference_metadata_problems
from refdcp.reference.save_planner import ReferenceSavePlanner
from refdcp.reference.staging import CpuStager, ReferenceStager, release_staging_buffers
from refdcp.reference.storage import ReferenceReader, ReferenceWriter
from refdcp.storage.errors import CorruptionError

#: torch's and refdcp's names for the reference planners and storage (REF-1)
DefaultSavePlanner = ReferenceSavePlanner
DefaultLoadPlanner = ReferenceLoadPlanner
FileSystemWriter = ReferenceWriter
FileSystemReader = ReferenceReader

__all__ = [
    "CheckpointError",
    "CommAborted",
    "CommError",
    "CommTimeout",
    "CorruptionError",
    "DefaultLoadPlanner",
    "DefaultSavePlanner",
    "FileSystemReader",
    "FileSystemWriter",
    "ProtocolError",
    "RefdcpError",
    "AsyncSaveHandle",
    "CpuStager",
    "InFlightLimiter",
    "ReferenceStager",
    "async_save",
    "release_staging_buffers",
    "Decision",
    "LocalShards",
    "ReferenceLoadPlanner",
    "ReferenceReader",
    "ReferenceSavePlanner",
    "ReferenceWriter",
    "load",
    "reference_dedup",
    "reference_metadata_problems",
    "save",
]
