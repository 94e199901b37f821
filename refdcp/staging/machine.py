"""The stager state machine: one buffer set's life (spec/staging.md, STAGE-1..STAGE-4).

Pure data plus a transition function: ``step(state, event) -> (next state,
action)``. No I/O and no tensors. The machine guards the buffer set's life:
the buffer pool feeds it every event and keeps the returned state; of the
actions only ``FREE`` is executed by the pool itself (it drops the buffers),
the others name what the pool's caller does around the call (the stager
copies, resolves the snapshot, returns the lease). Anything not in
:data:`TRANSITIONS` raises :class:`refdcp.errors.ProtocolError` naming the
requirement it breaks (STAGE-2). ``spec/staging.md``'s table is generated
from :data:`TRANSITIONS` (STAGE-21).
"""

from __future__ import annotations

import enum

from refdcp.errors import ProtocolError

__all__ = ["LEASED", "TRANSITIONS", "Action", "Event", "State", "illegal_requirement", "step"]


class State(enum.Enum):
    """Where a buffer set is in its life (STAGE-1)."""

    IDLE = "idle"  # allocated, never written
    STAGING = "staging"  # a copy into it is in progress (leased)
    STAGED = "staged"  # holds a snapshot an in-flight save reads (leased)
    RELEASED = "released"  # the save that read it finished; reusable
    CLOSED = "closed"  # freed


class Event(enum.Enum):
    """What happens to a buffer set."""

    STAGE = "stage"  # a new snapshot wants this buffer set
    COPY_DONE = "copy_done"
    COPY_FAILED = "copy_failed"
    RELEASE = "release"  # the save reading the snapshot finished (either way)
    CLOSE = "close"


class Action(enum.Enum):
    """What the pool must do after a transition."""

    COPY = "copy"  # copy the source into the buffers
    SIGNAL_STAGED = "signal_staged"  # the snapshot is complete: source may change
    RETURN_TO_POOL = "return_to_pool"  # make the buffers available for reuse
    FREE = "free"  # drop the buffers


#: The whole machine (STAGE-1). A buffer set is leased exactly in STAGING and STAGED.
TRANSITIONS: dict[tuple[State, Event], tuple[State, Action]] = {
    (State.IDLE, Event.STAGE): (State.STAGING, Action.COPY),
    (State.RELEASED, Event.STAGE): (State.STAGING, Action.COPY),
    (State.STAGING, Event.COPY_DONE): (State.STAGED, Action.SIGNAL_STAGED),
    (State.STAGING, Event.COPY_FAILED): (State.RELEASED, Action.RETURN_TO_POOL),
    (State.STAGED, Event.RELEASE): (State.RELEASED, Action.RETURN_TO_POOL),
    (State.IDLE, Event.CLOSE): (State.CLOSED, Action.FREE),
    (State.RELEASED, Event.CLOSE): (State.CLOSED, Action.FREE),
}

#: States in which a save may still read the buffers.
LEASED = frozenset({State.STAGING, State.STAGED})


def illegal_requirement(state: State, event: Event) -> str:
    """The spec ID an illegal ``(state, event)`` pair violates."""
    if event is Event.STAGE and state in LEASED:
        return "STAGE-3"  # never restage into a leased buffer
    if event is Event.CLOSE and state in LEASED:
        return "STAGE-4"  # never free a leased buffer
    return "STAGE-2"


def step(state: State, event: Event) -> tuple[State, Action]:
    """Apply ``event`` to ``state`` (STAGE-1); raise ProtocolError if not allowed (STAGE-2)."""
    try:
        return TRANSITIONS[(state, event)]
    except KeyError:
        rid = illegal_requirement(state, event)
        raise ProtocolError(
            rid, f"stager: event {event.value!r} is not allowed in state {state.value!r}"
        ) from None
