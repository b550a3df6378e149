"""The sliding-tile benchmark on its tiny grid, on the CPU (numbers meaningless, code paths
real): ours, FlexAttention (eager, forward only) and masked SDPA agree with the reference, and
an op that is missing (or cannot run on the CPU, as cuDNN) is skipped with a note, not raised."""

from __future__ import annotations

import json

import pytest
import torch

from vidsparse.bench import registry, runner, shapes

pytestmark = pytest.mark.usefixtures("torch_backend")

needs_masks = pytest.mark.skipif(
    registry.REQUIREMENTS["sta-masks"](None) is not None, reason="vidsparse.masks.sliding_tile"
)
needs_sta = pytest.mark.skipif(
    registry.REQUIREMENTS["sta"](None) is not None, reason="vidsparse.sliding_tile_attn"
)

# tiny-sta: 9x10x11 tokens in 3x3x3 tiles of 4x4x4; along t the tiles hold 4, 4 and 1 frames.
TOKENS = 9 * 10 * 11
SLABS = (4 * 110, 4 * 110, 1 * 110)  # real tokens of each t-slab of tiles


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    if registry.REQUIREMENTS["sta"](None) or registry.REQUIREMENTS["sta-masks"](None):
        pytest.skip("sliding-tile attention is not in this vidsparse")
    out = tmp_path_factory.mktemp("bench_sta") / "sta.json"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VIDSPARSE_BACKEND", "torch")
        rows = runner.run("sta", [*registry.get("sta").tiny_args, "--out", str(out), "--no-plot"])
    return rows, json.loads(out.read_text())


@pytest.mark.slow
@needs_sta
@needs_masks
def test_rows_for_every_provider_window_and_mode(tiny_run):
    rows, data = tiny_run
    assert data["rows"] == json.loads(json.dumps(rows))
    keys = {(r["provider"], r["window"], r["mode"]) for r in rows}
    modes = ("fwd", "fwd+bwd")
    # On the CPU: no cuDNN (a GPU backend) and no flex backward (FlexAttention has none
    # there), each skipped with a note rather than an error row.
    want = {(p, w, m) for p in ("ours", "masked-sdpa") for w in ("1x3x3", "3x3x3")
            for m in modes}  # fmt: skip
    want |= {("flex", w, "fwd") for w in ("1x3x3", "3x3x3")}
    assert keys == want
    for r in rows:
        assert r["tokens"] == TOKENS and r["padded_tokens"] == 27 * 64 and r["num_tiles"] == 27
        assert not r.get("error"), r
        assert r["ms"] > 0 and r.get("speedup_vs_cudnn") is None
        if r["mode"] == "fwd" and r["provider"] != "cudnn":
            assert r["check_rel_l2"] < 1e-3, r  # checked against masked SDPA before timing
    assert data["meta"]["benchmark"] == "sta" and data["meta"]["complete"] is True


@pytest.mark.slow
@needs_sta
@needs_masks
def test_pairs_count_real_tokens_of_the_window(tiny_run):
    rows, _ = tiny_run
    heads = shapes.TINY["tiny-sta"].heads
    by = {(r["provider"], r["window"], r["mode"]): r for r in rows}
    # 3x3x3 tiles of a 3x3x3-tile grid: every tile sees every tile.
    assert by[("ours", "3x3x3", "fwd")]["density"] == 1.0
    # 1x3x3: a query tile sees the whole t-slab of tiles it is in.
    assert by[("ours", "1x3x3", "fwd")]["pairs"] == heads * sum(n * n for n in SLABS)
    assert by[("ours", "1x3x3", "fwd")]["kv_tiles"] == 9
    ours, flex = by[("ours", "1x3x3", "fwd")], by[("flex", "1x3x3", "fwd")]
    assert ours["ours_over_flex"] == pytest.approx(flex["ms"] / ours["ms"])


@needs_masks
def test_a_missing_op_is_skipped_with_a_note(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(registry.REQUIREMENTS, "sta", lambda device: "not in this build yet")
    out = tmp_path / "sta.json"
    argv = ["--tiny", "--providers", "ours,cudnn,masked-sdpa", "--modes", "fwd",
            "--windows", "3x3x3"]  # fmt: skip
    rows = runner.run("sta", [*argv, "--out", str(out), "--no-plot"])
    assert {r["provider"] for r in rows} == {"masked-sdpa"}
    assert not rows[0].get("error") and rows[0]["ms"] > 0
    printed = capsys.readouterr().out
    assert "note: skipped ours: not in this build yet" in printed
    if not torch.cuda.is_available():
        assert "note: skipped cudnn: cuDNN is a GPU backend of SDPA" in printed
    assert json.loads(out.read_text())["meta"]["complete"] is True


def test_cudnn_pairs_count_every_real_token():
    """The dense reference (a GPU's cuDNN row) counts all real pairs of the grid."""
    from vidsparse.bench.ops import sta

    x = sta.make_inputs(shapes.TINY["tiny-sta"], torch.device("cpu"), torch.float32, 0)
    case = sta.Case(shapes.TINY["tiny-sta"], "cudnn", "fwd")
    heads = shapes.TINY["tiny-sta"].heads
    assert sta.base_row(case, x, torch.float32)["pairs"] == heads * TOKENS**2


def test_missing_window_masks_are_reported_in_their_rows(tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "vidsparse.masks.sliding_tile", None)  # import fails
    out = tmp_path / "sta.json"
    argv = ["--tiny", "--providers", "ours,cudnn", "--modes", "fwd", "--windows", "3x3x3"]
    rows = runner.run("sta", [*argv, "--out", str(out), "--no-plot"])
    ours = next(r for r in rows if r["provider"] == "ours")
    assert ours["error"].startswith("window masks: ") and ours["window"] == "3x3x3"
    assert ours["pairs"] is None and ours["kv_tiles"] == 27
