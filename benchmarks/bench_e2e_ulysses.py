"""Kept so that earlier command lines still work:

    python benchmarks/bench_e2e_ulysses.py ARGS == python -m vidsparse.bench e2e_ulysses ARGS

The benchmark is ``vidsparse.bench.ops.e2e_ulysses``; vidsparse must be importable (installed, or
``PYTHONPATH=src``).
"""

from vidsparse.bench.runner import script_main

if __name__ == "__main__":
    script_main("e2e_ulysses")
