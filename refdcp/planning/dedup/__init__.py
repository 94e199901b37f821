"""Dedup of replicated write items (DEDUP-*): the planner's fast versions of the rule in ``refdcp/reference/dedup.py``."""
