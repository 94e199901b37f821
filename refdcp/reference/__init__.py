"""refdcp's reference path: the whole save and load, written to be read (spec/reference.md).

``import refdcp.reference as dcp`` gives ``save`` and ``load`` with the meaning of
``refdcp.save`` and ``refdcp.load``: the same protocol tables, driver and
communicators, the same on-disk format, dedup rule and metadata checks, with
none of the fast path's speed idioms. The default ``refdcp`` is the same rule,
faster; tests run the shared property suites against both and compare them
(REF-1..REF-6).

Read in this order: :mod:`.api` (save/load), :mod:`.save_planner` with
:mod:`.dedup` and :mod:`.metadata`, :mod:`.storage` with :mod:`.format`, then
:mod:`.load_planner`.
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
from refdcp.reference.dedup import Decision, reference_dedup
from refdcp.reference.load_planner import ReferenceLoadPlanner
from refdcp.reference.metadata import reference_metadata_problems
from refdcp.reference.save_planner import ReferenceSavePlanner
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
    "Decision",
    "ReferenceLoadPlanner",
    "ReferenceReader",
    "ReferenceSavePlanner",
    "ReferenceWriter",
    "load",
    "reference_dedup",
    "reference_metadata_problems",
    "save",
]
