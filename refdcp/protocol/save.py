"""The save protocol, one rank's view, as a transition table (spec/protocol.md).

    set_up -> local_plan -> gather plans -> [coordinator] global_plan -> scatter plans
    -> finish_plan -> write -> gather results -> [coordinator] commit -> broadcast outcome

The commit point (SAVE-6) is the coordinator's successful return from
``StorageWriter.finish`` (the ``commit`` step): before it nothing is committed,
after it the checkpoint is complete.
"""

from __future__ import annotations

from refdcp.protocol.machine import Kind, On, Role, Row, Table
from refdcp.protocol.planning_phase import planning_rows

__all__ = ["SAVE", "SAVE_ROWS", "COMMIT_STEP"]

COMMIT_STEP = "commit"

_L, _G, _B = Kind.LOCAL, Kind.GATHER, Kind.BROADCAST
_C, _P = Role.COORD, Role.PEER

SAVE_ROWS = [
    *planning_rows("SAVE-1", "SAVE-2", "SAVE-3", "SAVE-4"),
    Row("finish_plan", On.OK, "write", _L, "write", req="SAVE-4"),
    Row("finish_plan", On.ERR, "gather_results", _G, "write_results", "all_results", req="PROTO-5"),
    Row("write", On.OK, "gather_results", _G, "write_results", "all_results", req="SAVE-5"),
    Row("write", On.ERR, "gather_results", _G, "write_results", "all_results", req="PROTO-5"),
    Row("gather_results", On.GOT_OK, COMMIT_STEP, _L, COMMIT_STEP, role=_C, req="SAVE-6"),
    Row(
        "gather_results",
        On.GOT_ERR,
        "broadcast_outcome",
        _B,
        "metadata",
        "metadata",
        _C,
        req="SAVE-7",
    ),
    Row(
        "gather_results", On.SENT, "broadcast_outcome", _B, "metadata", "metadata", _P, req="SAVE-8"
    ),
    Row(
        COMMIT_STEP,
        On.OK,
        "broadcast_outcome",
        _B,
        "metadata",
        "metadata",
        _C,
        commits=True,
        req="SAVE-6",
    ),
    Row(COMMIT_STEP, On.ERR, "broadcast_outcome", _B, "metadata", "metadata", _C, req="SAVE-7"),
    Row(
        "broadcast_outcome", On.GOT_OK, "done", Kind.RETURN, "metadata", commits=True, req="SAVE-8"
    ),
    Row("broadcast_outcome", On.GOT_ERR, "failed", Kind.RAISE, req="ERR-1"),
]

SAVE = Table("save", SAVE_ROWS)
