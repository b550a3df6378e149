"""Kept so that earlier command lines still work:

    python benchmarks/bench_vsa.py ARGS == python -m vidsparse.bench vsa ARGS

The benchmark is ``vidsparse.bench.ops.vsa``; vidsparse must be importable (installed, or
``PYTHONPATH=src``).
"""

from vidsparse.bench.runner import script_main

if __name__ == "__main__":
    script_main("vsa")
