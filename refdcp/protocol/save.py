"""The save protocol, one rank's view: every transition, one row per line (spec/protocol.md).

    set_up -> local_plan -> gather plans -> [coordinator] global_plan -> scatter plans
    -> finish_plan -> write -> gather results -> [coordinator] commit -> broadcast outcome

The commit point (SAVE-6) is the coordinator's successful return from
``StorageWriter.finish`` (the ``commit`` step): before it nothing is committed,
after it the checkpoint is complete. The machine follows Rule 1 of
``protocol/machine.py``: these rows are all it does.
"""

from __future__ import annotations

from refdcp.protocol.machine import (
    RAISE,
    On,
    Role,
    Row,
    Table,
    broadcast,
    call,
    gather,
    ret,
    scatter,
)
from refdcp.protocol.names import Phase as P
from refdcp.protocol.names import Slot
from refdcp.protocol.names import Step as S

__all__ = ["COMMIT_STEP", "SAVE", "SAVE_ROWS"]

#: The local step whose successful return is the commit point (SAVE-6).
COMMIT_STEP = S.COMMIT

ANY, COORD, PEER = Role.ANY, Role.COORD, Role.PEER
START, OK, ERR, SENT, GOT_OK, GOT_ERR = On.START, On.OK, On.ERR, On.SENT, On.GOT_OK, On.GOT_ERR
PLANS = gather(Slot.LOCAL_PLAN, Slot.ALL_PLANS)
SEND_PLANS = scatter(Slot.GLOBAL_PLANS, Slot.CENTRAL_PLAN)
RESULTS = gather(Slot.WRITE_RESULTS, Slot.ALL_RESULTS)
OUTCOME = broadcast(Slot.METADATA, Slot.METADATA)

# fmt: off
SAVE_ROWS = [
    #   phase                on       role   next                 action                req
    Row(P.IDLE,              START,   ANY,   P.SET_UP,            *call(S.SET_UP),      req="SAVE-1"),
    Row(P.SET_UP,            OK,      ANY,   P.LOCAL_PLAN,        *call(S.LOCAL_PLAN),  req="SAVE-1"),
    Row(P.SET_UP,            ERR,     ANY,   P.GATHER_PLANS,      *PLANS,               req="PROTO-5"),
    Row(P.LOCAL_PLAN,        OK,      ANY,   P.GATHER_PLANS,      *PLANS,               req="SAVE-2"),
    Row(P.LOCAL_PLAN,        ERR,     ANY,   P.GATHER_PLANS,      *PLANS,               req="PROTO-5"),
    Row(P.GATHER_PLANS,      ERR,     ANY,   P.GATHER_PLANS,      *PLANS,               req="PROTO-5"),
    Row(P.GATHER_PLANS,      GOT_OK,  COORD, P.GLOBAL_PLAN,       *call(S.GLOBAL_PLAN), req="SAVE-3"),
    Row(P.GATHER_PLANS,      GOT_ERR, COORD, P.SCATTER_PLANS,     *SEND_PLANS,          req="PROTO-5"),
    Row(P.GATHER_PLANS,      SENT,    PEER,  P.SCATTER_PLANS,     *SEND_PLANS,          req="SAVE-3"),
    Row(P.GLOBAL_PLAN,       OK,      COORD, P.SCATTER_PLANS,     *SEND_PLANS,          req="SAVE-3"),
    Row(P.GLOBAL_PLAN,       ERR,     COORD, P.SCATTER_PLANS,     *SEND_PLANS,          req="PROTO-5"),
    Row(P.SCATTER_PLANS,     ERR,     ANY,   P.SCATTER_PLANS,     *SEND_PLANS,          req="PROTO-5"),
    Row(P.SCATTER_PLANS,     GOT_OK,  ANY,   P.FINISH_PLAN,       *call(S.FINISH_PLAN), req="SAVE-4"),
    Row(P.SCATTER_PLANS,     GOT_ERR, ANY,   P.FAILED,            *RAISE,               req="ERR-1"),
    Row(P.FINISH_PLAN,       OK,      ANY,   P.WRITE,             *call(S.WRITE),       req="SAVE-4"),
    Row(P.FINISH_PLAN,       ERR,     ANY,   P.GATHER_RESULTS,    *RESULTS,             req="PROTO-5"),
    Row(P.WRITE,             OK,      ANY,   P.GATHER_RESULTS,    *RESULTS,             req="SAVE-5"),
    Row(P.WRITE,             ERR,     ANY,   P.GATHER_RESULTS,    *RESULTS,             req="PROTO-5"),
    Row(P.GATHER_RESULTS,    ERR,     ANY,   P.GATHER_RESULTS,    *RESULTS,             req="PROTO-5"),
    Row(P.GATHER_RESULTS,    GOT_OK,  COORD, P.COMMIT,            *call(S.COMMIT),      req="SAVE-6"),
    Row(P.GATHER_RESULTS,    GOT_ERR, COORD, P.BROADCAST_OUTCOME, *OUTCOME,             req="SAVE-7"),
    Row(P.GATHER_RESULTS,    SENT,    PEER,  P.BROADCAST_OUTCOME, *OUTCOME,             req="SAVE-8"),
    Row(P.COMMIT,            OK,      COORD, P.BROADCAST_OUTCOME, *OUTCOME,             req="SAVE-6", commits=True),
    Row(P.COMMIT,            ERR,     COORD, P.BROADCAST_OUTCOME, *OUTCOME,             req="SAVE-7"),
    Row(P.BROADCAST_OUTCOME, ERR,     ANY,   P.BROADCAST_OUTCOME, *OUTCOME,             req="PROTO-5"),
    Row(P.BROADCAST_OUTCOME, GOT_OK,  ANY,   P.DONE,              *ret(Slot.METADATA),  req="SAVE-8", commits=True),
    Row(P.BROADCAST_OUTCOME, GOT_ERR, ANY,   P.FAILED,            *RAISE,               req="ERR-1"),
    Row(P.DONE,              ERR,     ANY,   P.FAILED,            *RAISE,               req="SAVE-9"),
    Row(P.FAILED,            ERR,     ANY,   P.FAILED,            *RAISE,               req="PROTO-7"),
]
# fmt: on

SAVE = Table("save", SAVE_ROWS)
