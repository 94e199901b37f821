"""The save protocol, one rank's view, as a transition table (spec/protocol.md).

    set_up -> local_plan -> gather plans -> [coordinator] global_plan -> scatter plans
    -> finish_plan -> write -> gather results -> [coordinator] commit -> broadcast outcome

The commit point (SAVE-6) is the coordinator's successful return from
``StorageWriter.finish`` (the ``commit`` step): before it nothing is committed,
after it the checkpoint is complete.
"""

from __future__ import annotations

from refdcp.protocol.machine import IDLE, Kind, On, Role, Row, Table

__all__ = ["SAVE", "SAVE_ROWS", "COMMIT_STEP"]

COMMIT_STEP = "commit"

_L, _G, _S, _B = Kind.LOCAL, Kind.GATHER, Kind.SCATTER, Kind.BROADCAST
_C, _P = Role.COORD, Role.PEER

SAVE_ROWS = [
    Row(IDLE, On.START, "set_up", _L, "set_up", req="SAVE-1"),
    Row("set_up", On.OK, "local_plan", _L, "local_plan", req="SAVE-1"),
    Row("set_up", On.ERR, "gather_plans", _G, "local_plan", "all_plans", req="PROTO-5"),
    Row("local_plan", On.OK, "gather_plans", _G, "local_plan", "all_plans", req="SAVE-2"),
    Row("local_plan", On.ERR, "gather_plans", _G, "local_plan", "all_plans", req="PROTO-5"),
    Row("gather_plans", On.GOT_OK, "global_plan", _L, "global_plan", role=_C, req="SAVE-3"),
    Row(
        "gather_plans",
        On.GOT_ERR,
        "scatter_plans",
        _S,
        "global_plans",
        "central_plan",
        _C,
        req="PROTO-5",
    ),
    Row(
        "gather_plans",
        On.SENT,
        "scatter_plans",
        _S,
        "global_plans",
        "central_plan",
        _P,
        req="SAVE-3",
    ),
    Row(
        "global_plan", On.OK, "scatter_plans", _S, "global_plans", "central_plan", _C, req="SAVE-3"
    ),
    Row(
        "global_plan",
        On.ERR,
        "scatter_plans",
        _S,
        "global_plans",
        "central_plan",
        _C,
        req="PROTO-5",
    ),
    Row("scatter_plans", On.GOT_OK, "finish_plan", _L, "finish_plan", req="SAVE-4"),
    Row("scatter_plans", On.GOT_ERR, "failed", Kind.RAISE, req="ERR-1"),
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
