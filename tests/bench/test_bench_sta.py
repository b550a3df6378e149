"""The sliding-tile benchmark on its tiny grid, on the CPU (numbers meaningless, code paths
real): ours, FlexAttention (eager, forward only) and masked SDPA agree with the reference, and
an op that is missing is reported in its rows, not raised."""

from __future__ import annotations

import json

import pytest

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
    want = {("cudnn", "dense", m) for m in modes}
    want |= {(p, w, m) for p in ("ours", "flex", "masked-sdpa") for w in ("1x3x3", "3x3x3")
             for m in modes}  # fmt: skip
    assert keys == want
    for r in rows:
        assert r["tokens"] == TOKENS and r["padded_tokens"] == 27 * 64 and r["num_tiles"] == 27
        if r["provider"] == "flex" and r["mode"] != "fwd":
            assert "backward" in r["error"]  # eager flex has no CPU backward: a row, not a crash
            continue
        assert not r.get("error"), r
        assert r["ms"] > 0 and r["speedup_vs_cudnn"] > 0
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
    assert by[("cudnn", "dense", "fwd")]["pairs"] == heads * TOKENS**2
    # 3x3x3 tiles of a 3x3x3-tile grid: every tile sees every tile.
    assert by[("ours", "3x3x3", "fwd")]["density"] == 1.0
    # 1x3x3: a query tile sees the whole t-slab of tiles it is in.
    assert by[("ours", "1x3x3", "fwd")]["pairs"] == heads * sum(n * n for n in SLABS)
    assert by[("ours", "1x3x3", "fwd")]["kv_tiles"] == 9
    ours, flex = by[("ours", "1x3x3", "fwd")], by[("flex", "1x3x3", "fwd")]
    assert ours["ours_over_flex"] == pytest.approx(flex["ms"] / ours["ms"])


@needs_masks
def test_a_missing_op_is_reported_in_its_rows(tmp_path, monkeypatch):
    monkeypatch.setitem(registry.REQUIREMENTS, "sta", lambda device: "not in this build yet")
    out = tmp_path / "sta.json"
    argv = ["--tiny", "--providers", "ours,cudnn", "--modes", "fwd", "--windows", "3x3x3"]
    rows = runner.run("sta", [*argv, "--out", str(out), "--no-plot"])
    by = {r["provider"]: r for r in rows}
    assert set(by) == {"ours", "cudnn"}
    assert by["ours"]["error"] == "ProviderUnavailable: ours: not in this build yet"
    assert not by["cudnn"].get("error") and by["cudnn"]["ms"] > 0
    assert json.loads(out.read_text())["meta"]["complete"] is True


def test_missing_window_masks_are_reported_in_their_rows(tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "vidsparse.masks.sliding_tile", None)  # import fails
    out = tmp_path / "sta.json"
    argv = ["--tiny", "--providers", "ours,cudnn", "--modes", "fwd", "--windows", "3x3x3"]
    rows = runner.run("sta", [*argv, "--out", str(out), "--no-plot"])
    ours = next(r for r in rows if r["provider"] == "ours")
    assert ours["error"].startswith("window masks: ") and ours["window"] == "3x3x3"
    assert ours["pairs"] is None and ours["kv_tiles"] == 27
