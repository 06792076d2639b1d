"""Benchmarks of Conveyor (run as modules: `python -m benchmarks.<name>`)."""
