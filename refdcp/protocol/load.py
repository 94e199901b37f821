"""The load protocol, one rank's view, as a transition table (spec/protocol.md).

    set_up (read metadata) -> local_plan -> gather plans -> [coordinator] global_plan
    -> scatter plans -> finish_plan -> read -> all-gather read outcome
    -> apply (Stateful.load_state_dict, top-level replacement) -> all-gather outcome

``apply`` runs only when every rank read successfully (LOAD-5), so a failed
load never calls ``load_state_dict`` anywhere.
"""

from __future__ import annotations

from refdcp.protocol.machine import IDLE, Kind, On, Role, Row, Table

__all__ = ["LOAD", "LOAD_ROWS"]

_L, _G, _S, _A = Kind.LOCAL, Kind.GATHER, Kind.SCATTER, Kind.ALL_GATHER
_C, _P = Role.COORD, Role.PEER

LOAD_ROWS = [
    Row(IDLE, On.START, "set_up", _L, "set_up", req="LOAD-1"),
    Row("set_up", On.OK, "local_plan", _L, "local_plan", req="LOAD-1"),
    Row("set_up", On.ERR, "gather_plans", _G, "local_plan", "all_plans", req="PROTO-5"),
    Row("local_plan", On.OK, "gather_plans", _G, "local_plan", "all_plans", req="LOAD-2"),
    Row("local_plan", On.ERR, "gather_plans", _G, "local_plan", "all_plans", req="PROTO-5"),
    Row("gather_plans", On.GOT_OK, "global_plan", _L, "global_plan", role=_C, req="LOAD-3"),
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
        req="LOAD-3",
    ),
    Row(
        "global_plan", On.OK, "scatter_plans", _S, "global_plans", "central_plan", _C, req="LOAD-3"
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
    Row("scatter_plans", On.GOT_OK, "finish_plan", _L, "finish_plan", req="LOAD-4"),
    Row("scatter_plans", On.GOT_ERR, "failed", Kind.RAISE, req="ERR-1"),
    Row("finish_plan", On.OK, "read", _L, "read", req="LOAD-4"),
    Row("finish_plan", On.ERR, "gather_read", _A, "read_outcome", "read_outcomes", req="PROTO-5"),
    Row("read", On.OK, "gather_read", _A, "read_outcome", "read_outcomes", req="LOAD-4"),
    Row("read", On.ERR, "gather_read", _A, "read_outcome", "read_outcomes", req="PROTO-5"),
    Row("gather_read", On.GOT_OK, "apply", _L, "apply", req="LOAD-5"),
    Row("gather_read", On.GOT_ERR, "failed", Kind.RAISE, req="LOAD-5"),
    Row("apply", On.OK, "gather_applied", _A, "apply_outcome", "apply_outcomes", req="LOAD-6"),
    Row("apply", On.ERR, "gather_applied", _A, "apply_outcome", "apply_outcomes", req="LOAD-6"),
    Row("gather_applied", On.GOT_OK, "done", Kind.RETURN, "loaded", req="LOAD-6"),
    Row("gather_applied", On.GOT_ERR, "failed", Kind.RAISE, req="ERR-1"),
]

LOAD = Table("load", LOAD_ROWS)
