"""PSA plan files: round trip, lookups, summary, atomic writes, strict validation."""

from __future__ import annotations

import copy
import json
import logging
import os
import random
from dataclasses import replace

import pytest

from vidsparse.layout.grid import VideoGrid
from vidsparse.masks.stripe import MAX_GRID_EXTENT, StripeSpec, stripe_block_mask
from vidsparse.search import (
    PLAN_FORMAT,
    PLAN_VERSION,
    CandidateFamily,
    HeadChoice,
    Plan,
    PlanBucket,
    load_plan,
    save_plan,
)
from vidsparse.search import plan as plan_module

GRID = VideoGrid((4, 8, 12), tile=(1, 4, 4))  # block grid (4, 2, 3)


def _choice(cands, i, err=0.01) -> HeadChoice:
    c = cands[i]
    return HeadChoice(c.spec, c.spatial_unit, float(cands.sparsity[i]), err, 0.999)


def _row_choice() -> HeadChoice:
    # Same column, every second block row: s_stride 2 rows = 2 * Wb blocks.
    spec = StripeSpec(2, 0, None, 1, 0, 2)
    mask = stripe_block_mask([spec], GRID.tiles, "row")
    return HeadChoice(spec, "row", 1.0 - float(mask.float().mean()), 0.02, 0.998)


def make_plan(model: str = "toy-model") -> Plan:
    cands = CandidateFamily().on_grid(GRID.tiles)
    buckets = (
        PlanBucket(2, 6, {0: (_choice(cands, 1), _row_choice()), 3: (_choice(cands, 5),) * 2}),
        PlanBucket(6, 10, {0: (_choice(cands, 2),) * 2, 3: (_choice(cands, 0, 0.0),) * 2}),
    )
    return Plan(
        model=model,
        grid=GRID,
        num_heads=2,
        num_steps=10,
        dense_steps=2,
        buckets=buckets,
        selection={"mode": "alpha", "alpha": 0.05, "target_sparsity": None, "metric": "rel_l2"},
        spatial_units=("block", "row"),
        search={"num_candidates": len(cands), "query_fraction": 1.0, "num_samples": 8},
    )


def test_round_trip(tmp_path):
    plan = make_plan()
    path = tmp_path / "plan.json"
    save_plan(plan, path)
    data = json.loads(path.read_text())
    assert data["format"] == PLAN_FORMAT and data["version"] == PLAN_VERSION
    assert data["grid"] == {"shape": [4, 8, 12], "tile": [1, 4, 4], "block_grid": [4, 2, 3]}
    loaded = load_plan(path, expect_grid=GRID, expect_model="toy-model")
    assert loaded == plan
    assert loaded.to_dict() == plan.to_dict()


def test_the_pipeline_member_is_optional_and_typed(tmp_path):
    plan = replace(make_plan(), transformer="transformer_2")
    path = tmp_path / "plan.json"
    save_plan(plan, path)
    data = json.loads(path.read_text())
    assert data["transformer"] == "transformer_2"
    assert load_plan(path) == plan
    assert "(transformer_2)" in plan.format_summary()
    del data["transformer"]  # plans written before the field, or from a bare transformer
    del data["checksum"]  # ... and before checksums
    path.write_text(json.dumps(data))
    assert load_plan(path).transformer is None
    save_plan(make_plan(), path)
    assert "transformer" not in json.loads(path.read_text())
    data["transformer"] = 2
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="field 'transformer': expected a string"):
        load_plan(path)


def test_specs_for_dense_steps_and_row_conversion():
    plan = make_plan()
    dense = [StripeSpec.dense()] * 2
    assert plan.specs_for(0, 0) == dense and plan.specs_for(1, 3) == dense
    assert plan.choices_for(1, 0) is None
    choices = plan.choices_for(4, 0)
    specs = plan.specs_for(4, 0)
    assert len(specs) == 2 and choices[1].spatial_unit == "row"
    # the block-unit spec draws the same mask as the row-unit choice
    row_mask = stripe_block_mask([choices[1].spec], GRID.tiles, "row")
    assert (stripe_block_mask([specs[1]], GRID.tiles, "block") == row_mask).all()
    assert specs[1].s_stride == choices[1].spec.s_stride * GRID.tiles[2]
    assert plan.specs_for(9, 3) == [StripeSpec.dense()] * 2  # the dense candidate was chosen
    with pytest.raises(ValueError, match="layer 7"):
        plan.specs_for(4, 7)
    with pytest.raises(ValueError, match="step"):
        plan.specs_for(10, 0)


def test_summary():
    plan = make_plan()
    s = plan.summary()
    assert set(s["per_layer"]) == {0, 3}
    assert sum(s["patterns"].values()) == 2 * 2 * 2  # buckets x layers x heads
    b = plan.buckets
    want = (4 * (b[0].layers[0][0].sparsity + b[0].layers[0][1].sparsity) / 2) + (
        4 * b[1].layers[0][0].sparsity
    )
    assert s["per_layer"][0]["sparsity"] == pytest.approx(want / 8)
    assert s["schedule_sparsity"] == pytest.approx(s["sparsity"] * 8 / 10)
    text = plan.format_summary()
    assert "toy-model" in text and "layer" in text and "most chosen patterns" in text


def test_atomic_write_keeps_the_old_file_on_failure(tmp_path, monkeypatch):
    path = tmp_path / "plan.json"
    save_plan(make_plan("old"), path)
    before = path.read_bytes()

    def broken_fsync(fd):
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(plan_module.os, "fsync", broken_fsync)
    with pytest.raises(OSError, match="simulated"):
        save_plan(make_plan("new"), path)
    assert path.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["plan.json"]  # no temporary left behind


def test_invalid_plan_is_never_written(tmp_path):
    path = tmp_path / "plan.json"
    save_plan(make_plan("old"), path)
    before = path.read_bytes()
    bad = make_plan()
    bucket = bad.buckets[0]
    heads = list(bucket.layers[0])
    heads[0] = HeadChoice(heads[0].spec, "block", float("nan"), 0.1, 0.9)
    bucket.layers[0] = tuple(heads)
    with pytest.raises(ValueError, match="sparsity"):
        save_plan(bad, path)
    assert path.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["plan.json"]


def _delete(key):
    def edit(d):
        del d[key]

    return edit


def _set(*path_and_value):
    *path, value = path_and_value

    def edit(d):
        for key in path[:-1]:
            d = d[key]
        d[path[-1]] = value

    return edit


BAD_PLANS = {
    "old version": (_set("version", 0), "'version'"),
    "future version": (_set("version", PLAN_VERSION + 1), "'version'"),
    "version as string": (_set("version", "1"), "'version'"),
    "wrong format": (_set("format", "vidsparse-vsa-plan"), "'format'"),
    "missing format": (_delete("format"), "'format'"),
    "missing field": (_delete("num_heads"), "'num_heads'"),
    "extra field": (_set("comment", "hi"), "'comment'"),
    "wrong type": (_set("num_heads", "2"), "'num_heads'"),
    "bool for int": (_set("num_steps", True), "'num_steps'"),
    "bad grid": (_set("grid", "block_grid", [4, 2, 4]), "'grid.block_grid'"),
    "bad selection": (_set("selection", "mode", "greedy"), "'selection.mode'"),
    "bad spec": (
        _set("buckets", 0, "layers", 0, "heads", 0, "spec", "t_width", 0),
        "'buckets[0].layers[0].heads[0].spec'",
    ),
    "spec missing key": (
        lambda d: d["buckets"][0]["layers"][0]["heads"][0]["spec"].pop("s_offset"),
        "'buckets[0].layers[0].heads[0].spec'",
    ),
    "bad unit": (
        _set("buckets", 0, "layers", 0, "heads", 1, "spatial_unit", "column"),
        "'buckets[0].layers[0].heads[1].spatial_unit'",
    ),
    "sparsity out of range": (
        _set("buckets", 1, "layers", 0, "heads", 0, "sparsity", 1.5),
        "'buckets[1].layers[0].heads[0].sparsity'",
    ),
    "too few heads": (
        lambda d: d["buckets"][0]["layers"][1]["heads"].pop(),
        "'buckets[0].layers[1].heads'",
    ),
    "gap between buckets": (_set("buckets", 1, "start", 7), "'buckets[1].start'"),
    "buckets stop early": (_set("buckets", 1, "end", 9), "'buckets'"),
    "nan error": (
        _set("buckets", 0, "layers", 0, "heads", 0, "rel_l2", float("nan")),
        "'buckets[0].layers[0].heads[0].rel_l2'",
    ),
    "not an object": (lambda d: d.clear(), "'format'"),
}


@pytest.mark.parametrize("case", sorted(BAD_PLANS))
def test_bad_plans_raise_naming_the_field(tmp_path, case):
    edit, field = BAD_PLANS[case]
    with pytest.raises(ValueError, match=field.replace("[", r"\[").replace("]", r"\]")):
        load_plan(_edited_plan_file(tmp_path, edit))


def _edited_plan_file(tmp_path, edit):
    """A valid plan's dict, changed by ``edit``, written as a plan file."""
    data = copy.deepcopy(make_plan().to_dict())
    edit(data)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize("text", ["[" * 100_000, '{"a": ' * 100_000, "[" * 100_000 + "]" * 100_000])
def test_deeply_nested_plan_is_a_value_error(tmp_path, text):
    """JSON's parser recurses once per level: a hostile file must not end in RecursionError."""
    path = tmp_path / "plan.json"
    path.write_text(text)
    with pytest.raises(ValueError, match="nests too deeply"):
        load_plan(path)


def test_plan_for_another_grid_or_model(tmp_path):
    path = tmp_path / "plan.json"
    save_plan(make_plan(), path)
    other = VideoGrid((4, 8, 16), tile=(1, 4, 4))
    with pytest.raises(ValueError, match=r"'grid'.*\(4, 8, 12\).*\(4, 8, 16\)"):
        load_plan(path, expect_grid=other)
    with pytest.raises(ValueError, match=r"'grid'"):
        load_plan(path, expect_grid=VideoGrid((4, 8, 12), tile=(2, 4, 4)))
    with pytest.raises(ValueError, match=r"'model'.*'toy-model'.*'wan2.1-14b'"):
        load_plan(path, expect_model="wan2.1-14b")


def test_corrupted_json(tmp_path):
    path = tmp_path / "plan.json"
    save_plan(make_plan(), path)
    text = path.read_text()
    path.write_text(text[: len(text) // 2])
    with pytest.raises(ValueError, match="not valid JSON"):
        load_plan(path)
    path.write_bytes(b"\xff\xfe garbage")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_plan(path)
    with pytest.raises(FileNotFoundError):
        load_plan(tmp_path / "missing.json")


# --------------------------------------------------------------------------- integrity (issue 22)


def test_saved_plans_carry_a_checksum_of_their_content(tmp_path):
    path = tmp_path / "plan.json"
    save_plan(make_plan(), path)
    data = json.loads(path.read_text())
    assert data["checksum"] == plan_module.plan_checksum(data)
    assert list(data)[:3] == ["format", "version", "checksum"]


def test_random_single_byte_flips_never_load_changed_numbers(tmp_path):
    """Before checksums 5 of 300 random single-byte flips loaded with changed numbers: now a
    flip is refused (ValueError) or leaves the plan as it was (white space)."""
    path = tmp_path / "plan.json"
    plan = make_plan()
    save_plan(plan, path)
    original = path.read_bytes()
    rng = random.Random(22)
    refused = 0
    for _ in range(300):
        flipped = bytearray(original)
        flipped[rng.randrange(len(flipped))] ^= rng.randrange(1, 256)
        path.write_bytes(bytes(flipped))
        try:
            loaded = load_plan(path)
        except ValueError:
            refused += 1
            continue
        assert loaded == plan and loaded.to_dict() == plan.to_dict()
    assert refused >= 290


def test_a_changed_number_is_refused_by_the_checksum(tmp_path):
    path = tmp_path / "plan.json"
    save_plan(make_plan(), path)
    data = json.loads(path.read_text())
    data["buckets"][0]["layers"][0]["heads"][0]["sparsity"] = 0.5  # still a valid plan
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="'checksum': does not match"):
        load_plan(path)
    data["checksum"] = "md5:1234"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="'checksum': expected 'sha256:'"):
        load_plan(path)


def test_a_plan_without_checksum_loads_with_a_note(tmp_path, caplog):
    """Older plan files (and hand-edited ones, their checksum deleted) still load."""
    path = tmp_path / "plan.json"
    save_plan(make_plan(), path)
    data = json.loads(path.read_text())
    del data["checksum"]
    path.write_text(json.dumps(data))
    with caplog.at_level(logging.INFO, logger="vidsparse.search.plan"):
        assert load_plan(path) == make_plan()
    assert "has no checksum" in caplog.text and "plan.json" in caplog.text
    caplog.clear()
    save_plan(make_plan(), path)
    with caplog.at_level(logging.INFO, logger="vidsparse.search.plan"):
        load_plan(path)
    assert "checksum" not in caplog.text


def test_oversized_plan_file_is_a_value_error(tmp_path, monkeypatch):
    path = tmp_path / "plan.json"
    save_plan(make_plan(), path)
    monkeypatch.setattr(plan_module, "MAX_PLAN_BYTES", path.stat().st_size - 1)
    with pytest.raises(ValueError, match="larger than MAX_PLAN_BYTES"):
        load_plan(path)


def test_endless_file_is_read_only_up_to_the_limit(monkeypatch):
    """/dev/zero has no end: load_plan reads MAX_PLAN_BYTES + 1 bytes and stops."""
    if not os.path.exists("/dev/zero"):
        pytest.skip("no /dev/zero")
    monkeypatch.setattr(plan_module, "MAX_PLAN_BYTES", 1 << 16)
    with pytest.raises(ValueError, match="larger than MAX_PLAN_BYTES"):
        load_plan("/dev/zero")


M = MAX_GRID_EXTENT
SPEC = ("buckets", 0, "layers", 0, "heads", 0, "spec")
OUT_OF_BOUNDS = {
    "huge t_width": (_set(*SPEC, "t_width", 10**30), r"heads\[0\]\.spec\.t_width'.*must lie"),
    "huge offset": (_set(*SPEC, "t_offset", 2**63 - 1), r"spec\.t_offset'.*-2147483647"),
    "negative offset": (_set(*SPEC, "s_offset", -(2**63 - 1)), r"spec\.s_offset'"),
    "stride past max": (_set(*SPEC, "s_stride", M + 1), r"spec\.s_stride'.*must lie"),
    "huge heads": (_set("num_heads", 10**30), r"'num_heads': must be <= 2147483647"),
    "huge grid": (_set("grid", "shape", [10**12, 8, 12]), r"'grid.shape\[0\]': must be <="),
    "many tiles": (
        lambda d: d["grid"].update(shape=[2**22, 2**12, 4], block_grid=[2**22, 2**10, 1]),
        r"'grid.shape': .* more than MAX_GRID_EXTENT",
    ),
}


@pytest.mark.parametrize("case", sorted(OUT_OF_BOUNDS))
def test_the_plan_reader_applies_the_spec_bounds_naming_the_field(tmp_path, case):
    """Such values loaded and failed only at the first forward (torch's overflow message)."""
    edit, field = OUT_OF_BOUNDS[case]
    with pytest.raises(ValueError, match=field):
        load_plan(_edited_plan_file(tmp_path, edit))


def test_errors_quote_hostile_values_in_short(tmp_path):
    data = copy.deepcopy(make_plan().to_dict())
    data["model"] = ["x" * 10**5] * 100
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="'model': expected a string") as info:
        load_plan(path)
    assert len(str(info.value)) < 500
    data["model"] = "m"
    data["num_heads"] = [[[[[[[[[[[[1]]]]]]]]]]]]
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="'num_heads'") as info:
        load_plan(path)
    assert len(str(info.value)) < 500
