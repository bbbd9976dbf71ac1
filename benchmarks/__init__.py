"""Developer benchmarks: run from a source checkout (``minirt bench MODE``), never installed.

Each report under docs/benchmarks names the command that made it at its top.
"""
