"""Microbenchmarks under pytest-benchmark: each ``test_*.py`` here declares the rank
counts it runs at (``RANKS``); ``python -m bench.micro`` runs them (bench/micro/__main__.py)."""
