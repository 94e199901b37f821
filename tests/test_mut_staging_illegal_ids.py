"""Every illegal (state, event) pair of the stager machine names its requirement (STAGE-2..4)."""

from __future__ import annotations

import pytest

from refdcp.errors import ProtocolError
from refdcp.staging.machine import TRANSITIONS, Event, State, step

# Written from the spec's words, not from the code: staging into a buffer set a save may still
# read is STAGE-3, closing one is STAGE-4; every other pair outside the table is STAGE-2.
_EXPECTED = {
    (State.STAGING, Event.STAGE): "STAGE-3",
    (State.STAGED, Event.STAGE): "STAGE-3",
    (State.STAGING, Event.CLOSE): "STAGE-4",
    (State.STAGED, Event.CLOSE): "STAGE-4",
}


@pytest.mark.spec("STAGE-2", "STAGE-3", "STAGE-4")
def test_each_illegal_pair_raises_naming_its_requirement() -> None:
    illegal = [(s, e) for s in State for e in Event if (s, e) not in TRANSITIONS]
    assert (State.CLOSED, Event.STAGE) in illegal and (State.IDLE, Event.RELEASE) in illegal
    for state, event in illegal:
        with pytest.raises(ProtocolError) as err:
            step(state, event)
        assert err.value.requirement == _EXPECTED.get((state, event), "STAGE-2"), (state, event)
