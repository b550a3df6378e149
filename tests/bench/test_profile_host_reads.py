"""``benchmarks/profile/find_host_reads.py`` finds the lines that read tensor values back to the
host, and a VSA training step makes no such read in library code: on a GPU each would be a
sync that stalls the launch queue of a host-bound step. On the CPU the Triton kernels run in
the interpreter, so the launchers' host code is what is watched (the GPU test watches the
launchers the tiny model takes there)."""

import argparse
import warnings
from pathlib import Path

import pytest
import torch

import vidsparse
from helpers import load_script
from vidsparse.masks.block_sparse import random_block_lists
from vidsparse.testing import reading_methods_watched

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "profile" / "find_host_reads.py"


def _module():
    return load_script(SCRIPT)


def _args(device: str) -> argparse.Namespace:
    return argparse.Namespace(device=device, compile="none", warmup=1, size=["--tiny"])


def test_the_validation_of_fresh_lists_is_found_as_a_library_read(triton_backend):
    script = _module()
    q, k, v = (torch.randn(1, 2, 128, 32) for _ in range(3))
    idx, cnt = random_block_lists(1, 2, 2, 2, density=0.5)
    before = torch.Tensor.__bool__
    with script.host_reads() as counts:
        vidsparse.block_sparse_attn(q, k, v, idx, cnt, block_size=(64, 64))
    sites = [site for (_, device, site) in script.library_reads(counts)]
    assert sites and all(site.startswith("vidsparse/masks/block_sparse.py:") for site in sites)
    assert torch.Tensor.__bool__ is before  # the class's methods are restored


def test_a_sync_warning_is_placed_at_the_line_that_read_not_at_the_watcher(triton_backend):
    """A sync warning raised inside a watched read (as CUDA's sync debug mode raises one in
    ``.item()``) is placed at the library line that read, past the watcher's wrapper."""
    script = _module()
    q, k, v = (torch.randn(1, 2, 128, 32) for _ in range(3))
    idx, cnt = random_block_lists(1, 2, 2, 2, density=0.5)

    def warn_as_cuda_would(name, tensor):
        warnings.warn("called a synchronizing CUDA operation", UserWarning, stacklevel=1)

    with script.sync_warnings() as syncs, reading_methods_watched(warn_as_cuda_would):
        vidsparse.block_sparse_attn(q, k, v, idx, cnt, block_size=(64, 64))
    assert syncs and all(
        site.startswith("vidsparse/masks/block_sparse.py:") for site, _ in syncs
    ), syncs
    assert script.library_syncs(syncs) == syncs
    assert not script.library_syncs([("vidsparse/bench/ops/train_vsa.py:271", "sync")])


def test_reads_from_the_benchmark_harness_are_not_library_reads():
    script = _module()
    harness = "vidsparse/bench/ops/train_vsa.py:271"
    counts = {("item", "cpu", harness): 1, ("item", "cpu", f"vidsparse/ops/x.py:1 <- {harness}"): 2}
    assert list(script.library_reads(counts).values()) == [2]


@pytest.mark.interpreter
def test_a_vsa_training_step_reads_nothing_back_in_library_code(triton_backend):
    counts, _ = _module().step_reads("vsa0.875", _args("cpu"))
    assert sum(counts.values()) > 0  # the harness's own reads (loss.item()) were seen
    assert _module().library_reads(counts) == {}


@pytest.mark.gpu
def test_gpu_a_vsa_training_step_reads_nothing_back_and_does_not_sync():
    script = _module()
    counts, syncs = script.step_reads("vsa0.875", _args("cuda"))
    assert script.library_reads(counts) == {}
    assert syncs  # the harness's loss.item() syncs, and is seen doing so
    assert script.library_syncs(syncs) == []
