"""Compiled fast path (built from the top-level _fast/ sources by setup.py)."""
