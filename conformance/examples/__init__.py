"""Example backends for the conformance suite."""
