"""Kept so that earlier command lines still work:

    python benchmarks/bench_e2e.py ARGS == python -m vidsparse.bench e2e ARGS

The benchmark is ``vidsparse.bench.ops.e2e``; vidsparse must be importable (installed, or
``PYTHONPATH=src``).
"""

from vidsparse.bench.runner import script_main

if __name__ == "__main__":
    script_main("e2e")
