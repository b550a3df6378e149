"""``@triton.jit`` code of VSA's coarse stage; the launchers are in ``coarse.py``."""
