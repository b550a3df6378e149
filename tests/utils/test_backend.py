"""Without Triton (a CPU-only torch brings none): ``auto`` takes the PyTorch reference and
says so once in the log; ``VIDSPARSE_BACKEND=triton`` is refused, saying why."""

from __future__ import annotations

import logging

import pytest
import torch

from vidsparse.utils import backend


@pytest.fixture
def no_triton(monkeypatch):
    backend._note_no_triton.cache_clear()
    monkeypatch.setattr(backend, "triton_available", lambda: False)
    yield
    backend._note_no_triton.cache_clear()


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_auto_falls_back_to_torch_with_one_log_line(no_triton, monkeypatch, caplog, device):
    monkeypatch.setenv("VIDSPARSE_BACKEND", "auto")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with caplog.at_level(logging.WARNING, logger="vidsparse"):
        for _ in range(3):
            assert backend.resolve_backend(torch.device(device)) == "torch"
    notes = [r.getMessage() for r in caplog.records if "Triton is not installed" in r.getMessage()]
    assert len(notes) == 1 and "PyTorch reference runs instead" in notes[0]


def test_forced_triton_without_triton_is_refused(no_triton, monkeypatch):
    monkeypatch.setenv("VIDSPARSE_BACKEND", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(ValueError, match="Triton is not installed"):
        backend.resolve_backend(torch.device("cpu"))


def test_cpu_without_the_interpreter_needs_no_triton_and_logs_nothing(no_triton, monkeypatch,
                                                                       caplog):  # fmt: skip
    monkeypatch.setenv("VIDSPARSE_BACKEND", "auto")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with caplog.at_level(logging.WARNING, logger="vidsparse"):
        assert backend.resolve_backend(torch.device("cpu")) == "torch"
    assert not caplog.records


def test_triton_available_does_not_import_triton():
    import subprocess
    import sys

    code = ("import sys; from vidsparse.utils.backend import triton_available; "
            "triton_available(); print('triton' in sys.modules)")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout
    assert out.strip() == "False"
