"""The conformance checks, one module per area; importing this registers them all."""

from conformance.checks import data, failures, protocol, ranks, stateful

__all__ = ["data", "failures", "protocol", "ranks", "stateful"]
