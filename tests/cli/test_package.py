"""Packaging facts users rely on: import needs no GPU, and no Triton until a kernel runs."""

import json
import os
import subprocess
import sys


def _run(code: str) -> str:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""  # as on a machine without a GPU
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    return proc.stdout.strip()


def test_import_needs_no_gpu_and_no_triton():
    out = _run(
        "import json, sys, torch, vidsparse\n"
        "g = vidsparse.VideoGrid((3, 5, 7))\n"
        "x = torch.randn(1, 2, g.num_tokens, 8)\n"
        "y = vidsparse.video_sparse_attn(x, x, x, g, topk=2)\n"
        "print(json.dumps({'version': vidsparse.__version__, 'triton': 'triton' in sys.modules,"
        " 'shape': list(y.shape)}))"
    )
    info = json.loads(out.splitlines()[-1])
    assert info["version"]
    assert info["triton"] is False, "the CPU reference path must not import Triton"
    assert info["shape"] == [1, 2, 105, 8]


def test_public_names():
    import vidsparse

    for name in vidsparse.__all__:
        assert getattr(vidsparse, name) is not None
