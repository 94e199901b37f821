"""Pure protocol state machines for save and load (spec/protocol.md)."""

from refdcp.protocol.load import LOAD
from refdcp.protocol.machine import Action, Event, Kind, On, Role, Row, State, Table
from refdcp.protocol.save import COMMIT_STEP, SAVE

__all__ = [
    "COMMIT_STEP",
    "LOAD",
    "SAVE",
    "Action",
    "Event",
    "Kind",
    "On",
    "Role",
    "Row",
    "State",
    "Table",
]
