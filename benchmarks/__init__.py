"""On-demand benchmarks that print tables, each run from the repository root as `python -m benchmarks.NAME`."""
