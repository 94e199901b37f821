"""The load protocol, one rank's view: every transition, one row per line (spec/protocol.md).

    set_up (read metadata) -> local_plan -> gather plans -> [coordinator] global_plan
    -> scatter plans -> finish_plan -> read -> all-gather read outcome
    -> apply (Stateful.load_state_dict, top-level replacement) -> all-gather outcome

``apply`` runs only when every rank read successfully (LOAD-5), so a failed
load never calls ``load_state_dict`` anywhere. A load returns nothing: the
loaded values are in the caller's state dict. The machine follows Rule 1 of
``protocol/machine.py``: these rows are all it does.
"""

from __future__ import annotations

from refdcp.protocol.machine import (
    RAISE,
    On,
    Role,
    Row,
    Table,
    all_gather,
    call,
    gather,
    ret,
    scatter,
)
from refdcp.protocol.names import Phase as P
from refdcp.protocol.names import Slot
from refdcp.protocol.names import Step as S

__all__ = ["LOAD", "LOAD_ROWS"]

ANY, COORD, PEER = Role.ANY, Role.COORD, Role.PEER
START, OK, ERR, SENT, GOT_OK, GOT_ERR = On.START, On.OK, On.ERR, On.SENT, On.GOT_OK, On.GOT_ERR
PLANS = gather(Slot.LOCAL_PLAN, Slot.ALL_PLANS)
SEND_PLANS = scatter(Slot.GLOBAL_PLANS, Slot.CENTRAL_PLAN)
READS = all_gather(Slot.READ_OUTCOME, Slot.READ_OUTCOMES)
APPLIED = all_gather(Slot.APPLY_OUTCOME, Slot.APPLY_OUTCOMES)

# fmt: off
LOAD_ROWS = [
    #   phase             on       role   next              action                req
    Row(P.IDLE,           START,   ANY,   P.SET_UP,         *call(S.SET_UP),      req="LOAD-1"),
    Row(P.SET_UP,         OK,      ANY,   P.LOCAL_PLAN,     *call(S.LOCAL_PLAN),  req="LOAD-1"),
    Row(P.SET_UP,         ERR,     ANY,   P.GATHER_PLANS,   *PLANS,               req="PROTO-5"),
    Row(P.LOCAL_PLAN,     OK,      ANY,   P.GATHER_PLANS,   *PLANS,               req="LOAD-2"),
    Row(P.LOCAL_PLAN,     ERR,     ANY,   P.GATHER_PLANS,   *PLANS,               req="PROTO-5"),
    Row(P.GATHER_PLANS,   ERR,     ANY,   P.GATHER_PLANS,   *PLANS,               req="PROTO-5"),
    Row(P.GATHER_PLANS,   GOT_OK,  COORD, P.GLOBAL_PLAN,    *call(S.GLOBAL_PLAN), req="LOAD-3"),
    Row(P.GATHER_PLANS,   GOT_ERR, COORD, P.SCATTER_PLANS,  *SEND_PLANS,          req="PROTO-5"),
    Row(P.GATHER_PLANS,   SENT,    PEER,  P.SCATTER_PLANS,  *SEND_PLANS,          req="LOAD-3"),
    Row(P.GLOBAL_PLAN,    OK,      COORD, P.SCATTER_PLANS,  *SEND_PLANS,          req="LOAD-3"),
    Row(P.GLOBAL_PLAN,    ERR,     COORD, P.SCATTER_PLANS,  *SEND_PLANS,          req="PROTO-5"),
    Row(P.SCATTER_PLANS,  ERR,     ANY,   P.SCATTER_PLANS,  *SEND_PLANS,          req="PROTO-5"),
    Row(P.SCATTER_PLANS,  GOT_OK,  ANY,   P.FINISH_PLAN,    *call(S.FINISH_PLAN), req="LOAD-4"),
    Row(P.SCATTER_PLANS,  GOT_ERR, ANY,   P.FAILED,         *RAISE,               req="ERR-1"),
    Row(P.FINISH_PLAN,    OK,      ANY,   P.READ,           *call(S.READ),        req="LOAD-4"),
    Row(P.FINISH_PLAN,    ERR,     ANY,   P.GATHER_READ,    *READS,               req="PROTO-5"),
    Row(P.READ,           OK,      ANY,   P.GATHER_READ,    *READS,               req="LOAD-4"),
    Row(P.READ,           ERR,     ANY,   P.GATHER_READ,    *READS,               req="PROTO-5"),
    Row(P.GATHER_READ,    ERR,     ANY,   P.GATHER_READ,    *READS,               req="PROTO-5"),
    Row(P.GATHER_READ,    GOT_OK,  ANY,   P.APPLY,          *call(S.APPLY),       req="LOAD-5"),
    Row(P.GATHER_READ,    GOT_ERR, ANY,   P.FAILED,         *RAISE,               req="LOAD-5"),
    Row(P.APPLY,          OK,      ANY,   P.GATHER_APPLIED, *APPLIED,             req="LOAD-6"),
    Row(P.APPLY,          ERR,     ANY,   P.GATHER_APPLIED, *APPLIED,             req="LOAD-6"),
    Row(P.GATHER_APPLIED, ERR,     ANY,   P.GATHER_APPLIED, *APPLIED,             req="PROTO-5"),
    Row(P.GATHER_APPLIED, GOT_OK,  ANY,   P.DONE,           *ret(),               req="LOAD-6"),
    Row(P.GATHER_APPLIED, GOT_ERR, ANY,   P.FAILED,         *RAISE,               req="ERR-1"),
    Row(P.DONE,           ERR,     ANY,   P.FAILED,         *RAISE,               req="PROTO-7"),
    Row(P.FAILED,         ERR,     ANY,   P.FAILED,         *RAISE,               req="PROTO-7"),
]
# fmt: on

LOAD = Table("load", LOAD_ROWS)
