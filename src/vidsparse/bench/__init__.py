"""Benchmarks of vidsparse's attention against its peers, as one tool.

- ``harness``: timing (``triton.testing.do_bench`` medians), FLOPs on attended pairs, run
  metadata, JSON, tables, plots;
- ``shapes``: the video DiT shapes every benchmark runs (one table);
- ``registry``: the ops (block_sparse, vsa, psa, sta, e2e, parallel, ...) and their providers;
- ``runner``: runs an op (``vidsparse bench``, ``python -m vidsparse.bench``);
- ``ops/``: the measuring code of each op; ``flex``, ``sdpa``, ``fastvideo``: shared peer
  providers (the registry's requirements ask them too, never ``ops/``); ``compile``: the Gluon
  forward's sm_90 build check.

It sits above the kernels (it imports ``vidsparse.ops``, ``layout``, ``masks``, ...); nothing
below imports it. Submodules are imported on use: ``import vidsparse.bench`` is cheap.
"""
