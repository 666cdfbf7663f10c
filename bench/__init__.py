"""Benchmarks, run by hand from the project root as modules: ``python -m bench.hari_cached --help``."""
