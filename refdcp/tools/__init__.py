"""The tools around the core: CLI, trace, inspect, verify, diagrams, progress, spec report (spec/tooling.md)."""
