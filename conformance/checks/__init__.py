"""The conformance checks, one module per area; importing this registers them all."""

from conformance.checks import (
    asyncpath,
    commit_tensor,
    crash,
    crossed,
    data,
    failures,
    power,
    protocol,
    ranks,
    stateful,
)

__all__ = [
    "asyncpath",
    "commit_tensor",
    "crash",
    "crossed",
    "data",
    "failures",
    "power",
    "protocol",
    "ranks",
    "stateful",
]
