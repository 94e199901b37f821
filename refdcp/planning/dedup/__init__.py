"""Dedup of replicated write items (DEDUP-*): the planner's fast versions of the rule in ``planning/dedup_reference.py``."""
