"""The conformance checks, one module per area; importing this registers them all."""

from conformance.checks import (
    commit_tensor,
    crash,
    data,
    failures,
    power,
    protocol,
    ranks,
    stateful,
)

__all__ = ["commit_tensor", "crash", "data", "failures", "power", "protocol", "ranks", "stateful"]
