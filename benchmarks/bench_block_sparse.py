"""Kept so that earlier command lines still work:

    python benchmarks/bench_block_sparse.py ARGS == python -m vidsparse.bench block_sparse ARGS

The benchmark is ``vidsparse.bench.ops.block_sparse``; vidsparse must be importable (installed, or
``PYTHONPATH=src``).
"""

from vidsparse.bench.runner import script_main

if __name__ == "__main__":
    script_main("block_sparse")
