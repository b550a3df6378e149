"""The end-to-end benchmark's training step (``e2e --train``) on the tiny Wan model on the CPU,
in process: float32, the PyTorch reference paths (numbers meaningless, code paths real:
gradient checkpointing, the backward through stock SDPA and through VSA with its gate)."""

from __future__ import annotations

import json
import math

import pytest
import torch

pytest.importorskip("diffusers", minversion="0.36")

from vidsparse.bench import runner  # noqa: E402
from vidsparse.bench.ops import e2e as bench_e2e  # noqa: E402
from vidsparse.bench.ops import e2e_train  # noqa: E402

pytestmark = pytest.mark.usefixtures("torch_backend")

FAST = ["--device", "cpu", "--tiny", "--train", "--warmup", "0", "--reps", "2"]


@pytest.fixture(scope="module")
def tiny_train(tmp_path_factory):
    """One tiny training run shared by the tests below: (rows returned, JSON written). VSA at
    sparsity 0 attends every tile: with its zero gate, the dense model's gradients."""
    out = tmp_path_factory.mktemp("bench_e2e_train") / "e2e_train.json"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VIDSPARSE_BACKEND", "torch")
        argv = [*FAST, "--share-reps", "1", "--vsa-sparsities", "0,0.875", "--out", str(out)]
        rows = bench_e2e.main(argv)
    return rows, json.loads(out.read_text())


@pytest.mark.slow
def test_rows_for_every_method(tiny_train):
    rows, data = tiny_train
    assert data["rows"] == json.loads(json.dumps(rows))
    assert [(r["method"], r["target"]) for r in rows] == [
        ("dense", None),
        ("vsa", 0.0),
        ("vsa", 0.875),
    ]
    keys = ("step_ms", "attn_ms", "attn_fwd_ms", "attn_bwd_ms", "attn_share", "speedup", "loss")
    layers = data["meta"]["layers"]
    for r in rows:
        assert "error" not in r and "attn_share_error" not in r, r
        for key in (*keys, "grad_rel_l2", "grad_norm"):
            assert isinstance(r[key], float) and math.isfinite(r[key]), (r["method"], key)
        assert r["attn_fwd_ms"] > 0 and r["attn_bwd_ms"] > 0 and 0 < r["attn_share"] < 1
        # The forward runs twice a layer (the step's, the checkpoint's recomputation), the
        # backward once.
        assert r["attn_fwd_calls_per_step"] == 2 * layers and r["attn_bwd_calls_per_step"] == layers
        assert r["grad_finite"] is True and len(r["step_ms_all"]) == 2
        assert r["attn_dtype"] == "float32"


@pytest.mark.slow
def test_gradients_against_dense(tiny_train):
    rows, _ = tiny_train
    dense, vsa0, vsa = rows
    assert dense["grad_rel_l2"] < 1e-6  # its last timed step against its first
    assert vsa0["sparsity"] == 0.0 and vsa0["gate"] is True
    assert vsa0["grad_rel_l2"] < 1e-5
    assert vsa0["loss"] == pytest.approx(dense["loss"], rel=1e-5)
    assert 1e-3 < vsa["grad_rel_l2"] < 1.0  # sparse: not the dense gradient, the same model
    assert vsa["sparsity"] == pytest.approx(1 - vsa["topk"] / vsa["tiles"])


@pytest.mark.slow
def test_metadata(tiny_train):
    _, data = tiny_train
    meta = data["meta"]
    assert meta["benchmark"] == "e2e" and meta["mode"] == "train" and meta["complete"] is True
    assert meta["dtype"] == "torch.float32" and meta["vsa_sparsities"] == [0.0, 0.875]
    assert meta["training"]["grad_group"].startswith("blocks.0.attn1")
    assert "no autocast" in meta["training"]["weights"]
    for key in ("git_commit", "torch", "diffusers", "timer", "attention_share", "sdpa"):
        assert meta[key], key


def test_gradient_group_is_the_first_self_attention():
    work = bench_e2e.make_workload(bench_e2e.parse_args(["--device", "cpu", "--tiny"]))
    model = bench_e2e.build_model(work, torch.device("cpu"), torch.float32, 0)
    path, params = e2e_train.grad_group(model)
    assert path == "blocks.0.attn1"
    assert {id(p) for p in params} == {id(p) for p in model.blocks[0].attn1.parameters()}


def test_default_output_names():
    cpu = torch.device("cpu")
    for model, stem in (("wan1.3b", "e2e_train_cpu"), ("wan14b", "e2e_train_wan14b-720p_cpu")):
        args = bench_e2e.parse_args(["--device", "cpu", "--train", "--model", model])
        out = bench_e2e.default_out(cpu, bench_e2e.make_workload(args), args.compile, args.train)
        assert out.name == f"{stem}.json"
    args = bench_e2e.parse_args(["--device", "cpu", "--train"])
    assert args.methods == "dense,vsa" and args.vsa_sparsities == [0.875, 0.9]
    assert args.train_weights == "fp32" and not args.no_vsa_gate
    assert bench_e2e.parse_args(["--device", "cpu"]).methods == "dense,vsa,psa"  # inference
    compiled = bench_e2e.parse_args(["--device", "cpu", "--train", "--compile", "blocks"])
    assert compiled.share_reps == 0  # the share's events cannot sit inside compiled blocks
    out = bench_e2e.default_out(cpu, bench_e2e.make_workload(compiled), "blocks", True)
    assert out.name == "e2e_train_compiled_cpu.json"


@pytest.mark.slow
def test_compiled_run_checks_every_gradient_against_eager(tmp_path):
    out = tmp_path / "e2e_train_compiled.json"
    argv = [*FAST, "--methods", "dense", "--compile", "blocks", "--out", str(out)]
    (row,) = bench_e2e.main(argv)
    assert "error" not in row, row
    assert row["compiled_grad_missing"] == []
    assert 0 <= row["compiled_grad_max_rel"] < 1e-3, row["compiled_grad_worst"]
    meta = json.loads(out.read_text())["meta"]
    assert "mix-order reduction off" in meta["compile"] and meta["compiled_grad_check"]


@pytest.mark.slow
def test_compiled_blocks_train_to_the_eager_gradients():
    """``--compile blocks`` under gradient checkpointing: each block's compiled forward runs
    twice (the step's and the recomputation), the backward through VSA's gate and kernels;
    the loss and every parameter's gradient are the eager step's."""
    from vidsparse.integrations.diffusers import apply_sparse_attention

    args = bench_e2e.parse_args(["--device", "cpu", "--tiny", "--train"])
    work = bench_e2e.make_workload(args)
    cpu = torch.device("cpu")
    results = []
    for compiled in (False, True):
        model = bench_e2e.build_model(work, cpu, torch.float32, 0)
        e2e_train.prepare_model(model)
        apply_sparse_attention(model, "vsa", sparsity=0.5, gate=True)
        for p in model.parameters():  # a nonzero gate: the sparse branch carries gradient
            if p.ndim == 2 and p.abs().max() == 0:
                torch.nn.init.normal_(p, std=0.02, generator=torch.Generator().manual_seed(1))
        if compiled:
            bench_e2e.compile_blocks(model, work)
            assert all(block._compiled_call_impl is not None for block in model.blocks)
        step = e2e_train.TrainStep(model, bench_e2e.make_inputs(work, cpu, torch.float32, 0),
                                   cpu, autocast=False, seed=0)  # fmt: skip
        loss = step()
        results.append((loss, {n: p.grad.clone() for n, p in model.named_parameters()}))
    (eager_loss, eager), (loss, grads) = results
    assert loss.item() == pytest.approx(eager_loss.item(), rel=1e-5)
    assert eager.keys() == grads.keys()
    for name, g in grads.items():
        scale = eager[name].norm().clamp_min(1e-12)
        assert (g - eager[name]).norm() / scale < 1e-4, name


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--vsa-sparsities", "0.9"], "--vsa-sparsities is an option of --train"),
        (["--train-weights", "bf16"], "--train-weights is an option of --train"),
        (["--train", "--vsa-sparsities", "0.9,1.0"], "must lie in [0, 1)"),
        (["--train", "--vsa-sparsities", "0.9,x"], "comma-separated floats"),
    ],
)
def test_bad_combinations_are_one_line_and_exit_2(argv, says, capsys):
    with pytest.raises(SystemExit) as info:
        bench_e2e.parse_args(["--device", "cpu", "--tiny", *argv])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and says in err, err
    # Through the benchmark runner: exit code 2, nothing run.
    assert runner.main(["e2e", "--device", "cpu", "--tiny", *argv]) == 2
