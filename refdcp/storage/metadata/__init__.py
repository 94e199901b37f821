"""The ``.metadata`` file: its safe unpickler, its shape checks, its limits and its pickler (FMT-*)."""
