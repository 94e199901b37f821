"""The load protocol, one rank's view, as a transition table (spec/protocol.md).

    set_up (read metadata) -> local_plan -> gather plans -> [coordinator] global_plan
    -> scatter plans -> finish_plan -> read -> all-gather read outcome
    -> apply (Stateful.load_state_dict, top-level replacement) -> all-gather outcome

``apply`` runs only when every rank read successfully (LOAD-5), so a failed
load never calls ``load_state_dict`` anywhere.
"""

from __future__ import annotations

from refdcp.protocol.machine import Kind, On, Row, Table
from refdcp.protocol.planning_phase import planning_rows

__all__ = ["LOAD", "LOAD_ROWS"]

_L, _A = Kind.LOCAL, Kind.ALL_GATHER

LOAD_ROWS = [
    *planning_rows("LOAD-1", "LOAD-2", "LOAD-3", "LOAD-4"),
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
