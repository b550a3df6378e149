"""Kept so that earlier command lines still work:

    python benchmarks/bench_psa.py ARGS == python -m vidsparse.bench psa ARGS

The benchmark is ``vidsparse.bench.ops.psa``; vidsparse must be importable (installed, or
``PYTHONPATH=src``).
"""

from vidsparse.bench.runner import script_main

if __name__ == "__main__":
    script_main("psa")
