"""The rows save and load share: set-up, local plans, gather, global plan, scatter (PROTO-1).

Both protocols plan the same way (SAVE-1..4, LOAD-1..4); only the requirement
each row cites differs, so the rows are written once here and each table
names its own IDs.
"""

from __future__ import annotations

from refdcp.protocol.machine import IDLE, Kind, On, Role, Row

__all__ = ["planning_rows"]

_L, _G, _S = Kind.LOCAL, Kind.GATHER, Kind.SCATTER
_C, _P = Role.COORD, Role.PEER


def planning_rows(set_up: str, local: str, central: str, finish: str) -> list[Row]:
    """Rows from IDLE up to ``finish_plan``, citing the protocol's own requirement IDs.

    ``set_up``: the set-up requirement; ``local``: local plans gathered;
    ``central``: the coordinator's global plan scattered; ``finish``: each
    rank finishing the plan it received.
    """
    scatter = ("scatter_plans", _S, "global_plans", "central_plan")
    return [
        Row(IDLE, On.START, "set_up", _L, "set_up", req=set_up),
        Row("set_up", On.OK, "local_plan", _L, "local_plan", req=set_up),
        Row("set_up", On.ERR, "gather_plans", _G, "local_plan", "all_plans", req="PROTO-5"),
        Row("local_plan", On.OK, "gather_plans", _G, "local_plan", "all_plans", req=local),
        Row("local_plan", On.ERR, "gather_plans", _G, "local_plan", "all_plans", req="PROTO-5"),
        Row("gather_plans", On.GOT_OK, "global_plan", _L, "global_plan", role=_C, req=central),
        Row("gather_plans", On.GOT_ERR, *scatter, _C, req="PROTO-5"),
        Row("gather_plans", On.SENT, *scatter, _P, req=central),
        Row("global_plan", On.OK, *scatter, _C, req=central),
        Row("global_plan", On.ERR, *scatter, _C, req="PROTO-5"),
        Row("scatter_plans", On.GOT_OK, "finish_plan", _L, "finish_plan", req=finish),
        Row("scatter_plans", On.GOT_ERR, "failed", Kind.RAISE, req="ERR-1"),
    ]
