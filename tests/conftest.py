"""Test configuration.

Without a GPU the Triton kernels run in the interpreter: ``TRITON_INTERPRET=1`` must be set
before any ``@triton.jit`` function is defined, so it is set here, before vidsparse is imported.
"""

import os

import torch

HAS_GPU = torch.cuda.is_available()
if not HAS_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

# The reference path is what unmarked tests exercise unless they ask for a backend.
os.environ.setdefault("VIDSPARSE_BACKEND", "auto")
# The tables' configs, not a tuning file a user left in their cache (`vidsparse tune`), are
# what the tests and the compile checks exercise; the tuning-file tests set their own.
os.environ.setdefault("VIDSPARSE_TUNING_FILE", "off")


def pytest_configure(config):
    """Stop at once, saying why, where the interpreter cannot run (else every interpreter
    test fails with a numpy TypeError deep inside Triton)."""
    if HAS_GPU:
        return
    import numpy

    from vidsparse.utils.device import triton_version

    version = triton_version()
    numpy_version = tuple(int(x) for x in numpy.__version__.split(".")[:2])
    if version is not None and version < (3, 7) and numpy_version >= (2, 4):
        raise pytest.UsageError(
            f"Triton {'.'.join(map(str, version))}'s interpreter needs numpy < 2.4 (installed: "
            f"{numpy.__version__}): pip install 'numpy<2.4' (CI pins it in "
            ".ci/constraints-triton3.6.txt)"
        )


def pytest_collection_modifyitems(config, items):
    if HAS_GPU:
        return
    skip_gpu = pytest.mark.skip(reason="needs a GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture
def torch_backend(monkeypatch):
    """Force the PyTorch reference backend for the duration of a test."""
    monkeypatch.setenv("VIDSPARSE_BACKEND", "torch")


@pytest.fixture
def triton_backend(monkeypatch):
    """Force the Triton backend (interpreter on CPU, compiled kernels on GPU)."""
    monkeypatch.setenv("VIDSPARSE_BACKEND", "triton")


@pytest.fixture
def exact_bf16_interpreter(monkeypatch):
    """bf16 in Triton's CPU interpreter as a GPU computes it: ``tl.dot`` on bf16 operands
    multiplies their values (exact in fp32, fp32 accumulation), and fp32 -> bf16 casts round
    to nearest even (torch's cast). No-op on a GPU."""
    if HAS_GPU:
        return
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    dot, cast = builder.create_dot, builder.cast_impl

    def values(handle):
        if handle.dtype.scalar != tl.bfloat16:
            return handle
        bits = np.asarray(handle.data).astype(np.uint32) << 16
        return interpreter.TensorHandle(bits.view(np.float32), tl.float32)

    def create_dot(self, a, b, d, *args):
        return dot(self, values(a), values(b), d, *args)

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            x = torch.from_numpy(np.ascontiguousarray(src.data, dtype=np.float32))
            bits = x.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
            return interpreter.TensorHandle(bits, tl.bfloat16)
        return cast(self, src, dst_type)

    monkeypatch.setattr(builder, "create_dot", create_dot)
    monkeypatch.setattr(builder, "cast_impl", cast_impl)


@pytest.fixture
def device():
    """Where kernel tests run: the GPU if there is one, else the CPU interpreter."""
    return torch.device("cuda" if HAS_GPU else "cpu")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _give_back_gpu_memory(request):
    """After each GPU test, hand the allocator's cached blocks back to the card: the GPU suite
    runs as several pytest processes on one card (benchmarks/gpu_tests_parallel.sh), and on an
    80 GB card one process's cache (55 GB seen) left the others out of memory."""
    yield
    if HAS_GPU and "gpu" in request.keywords:
        torch.cuda.empty_cache()


@pytest.fixture(autouse=True)
def _gluon_schedule_from_env():
    """``VIDSPARSE_TEST_GLUON="PERSISTENT_TILES=1"``: run the tests under that Gluon forward
    schedule (``configs.GluonOptions`` fields, comma-separated, integers or 0/1), e.g. a
    schedule that is off by default through a whole folder's GPU tests."""
    spec = os.environ.get("VIDSPARSE_TEST_GLUON", "")
    if not spec:
        yield
        return
    from dataclasses import fields, replace

    from vidsparse.ops.block_sparse_attn import configs

    types = {f.name: f.type for f in fields(configs.GluonOptions)}
    changes = {}
    for item in spec.split(","):
        name, value = item.split("=")
        if name not in types:
            raise pytest.UsageError(f"VIDSPARSE_TEST_GLUON: no GluonOptions field {name!r}")
        changes[name] = bool(int(value)) if types[name] in (bool, "bool") else int(value)
    with configs.override(gluon=replace(configs.GLUON, **changes)):
        yield
