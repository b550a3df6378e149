"""Packaging facts users rely on: import needs no GPU, and no Triton until a kernel runs."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest


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


ROOT = Path(__file__).resolve().parents[2]


def _pyproject() -> dict:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    path = ROOT / "pyproject.toml"
    if not path.is_file():
        pytest.skip("runs from a checkout")
    return tomllib.loads(path.read_text())


def test_packaging_metadata():
    """SPDX licence with its text, one source of the version, py.typed shipped."""
    import vidsparse

    project = _pyproject()
    assert project["project"]["license"] == "Apache-2.0"
    assert project["project"]["license-files"] == ["LICENSE"]
    assert "Apache License" in (ROOT / "LICENSE").read_text()
    assert "version" not in project["project"] and "version" in project["project"]["dynamic"]
    dynamic = project["tool"]["setuptools"]["dynamic"]["version"]
    assert dynamic == {"attr": "vidsparse.__version__"}
    pep440 = r"\d+\.\d+\.\d+((a|b|rc)\d+)?(\.post\d+)?(\.dev\d+)?"
    assert re.fullmatch(pep440, vidsparse.__version__), vidsparse.__version__
    assert "py.typed" in project["tool"]["setuptools"]["package-data"]["vidsparse"]
    assert (Path(vidsparse.__file__).parent / "py.typed").is_file()
    assert (ROOT / "CHANGELOG.md").read_text().count("## [Unreleased]") == 1
