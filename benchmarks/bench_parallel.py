"""Kept so that earlier command lines still work:

    python benchmarks/bench_parallel.py ARGS == python -m vidsparse.bench parallel ARGS

The benchmark is ``vidsparse.bench.ops.parallel``; vidsparse must be importable (installed, or
``PYTHONPATH=src``).
"""

from vidsparse.bench.runner import script_main

if __name__ == "__main__":
    script_main("parallel")
