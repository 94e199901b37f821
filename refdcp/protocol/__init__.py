"""Pure protocol state machines for save and load (spec/protocol.md).

``machine.py`` holds the one rule every machine follows (Rule 1) and the
transition function; ``save.py`` and ``load.py`` hold the tables, one literal
row per transition; ``names.py`` the phases, steps and slots they name.
"""

from refdcp.protocol.load import LOAD
from refdcp.protocol.machine import Action, Event, Kind, On, Role, Row, State, Table
from refdcp.protocol.names import Phase, Slot, Step
from refdcp.protocol.save import COMMIT_STEP, SAVE

__all__ = [
    "COMMIT_STEP",
    "LOAD",
    "SAVE",
    "Action",
    "Event",
    "Kind",
    "On",
    "Phase",
    "Role",
    "Row",
    "Slot",
    "State",
    "Step",
    "Table",
]
