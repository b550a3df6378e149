"""Tuning files: the schema round trip, every reason a file is ignored (with a logged warning and
the tables' defaults), and the hooks in the configs modules (tuned row over the table's, an
active ``override`` over both, loaded once)."""

from __future__ import annotations

import json
import logging
import random
from dataclasses import replace

import pytest
import torch

from vidsparse.ops.block_sparse_attn import configs
from vidsparse.ops.video_sparse_attn import configs as vsa_configs
from vidsparse.utils import tuning_file
from vidsparse.utils.device import CPU_INTERPRETER, Target

HOPPER = Target("cuda", 90)
IDENTITY = {
    "target": "cuda:90",
    "gpu": "NVIDIA H200",
    "driver": "570.86.15",
    "torch": torch.__version__,
    "triton": "3.6.0",
}


@pytest.fixture(autouse=True)
def fresh_store(monkeypatch, tmp_path):
    """Each test reads its own file; none leaves a loaded store behind for other tests."""
    monkeypatch.setenv(tuning_file.ENV_VAR, str(tmp_path / "tuning.json"))
    tuning_file.reload()
    yield tmp_path / "tuning.json"
    tuning_file.reload()


@pytest.fixture
def on_h200(monkeypatch):
    """This process pretends to run on an H200 (the CPU machine has no GPU to ask)."""
    monkeypatch.setattr(tuning_file, "machine_targets", lambda: (CPU_INTERPRETER, HOPPER))
    monkeypatch.setattr(tuning_file, "current_identity", lambda target: dict(IDENTITY))


def engine_entry(kernel="fwd", bq=128, bk=128, d=128, **config) -> dict:
    return {"op": "engine", "kernel": kernel, "block_q": bq, "block_kv": bk, "head_dim": d,
            "config": config}  # fmt: skip


def write(path, entries, identity=IDENTITY, **top) -> dict:
    doc = tuning_file.new_document(identity)
    doc.update(top)
    for entry in entries:
        tuning_file.set_entry(doc, entry)
    path.write_text(json.dumps(doc))
    tuning_file.reload()
    return doc


def table_default(kernel="fwd", bq=128, bk=128, d=128, masked=False):
    with tuning_file.suspended():
        return configs.lookup(HOPPER, kernel, bq, bk, d, masked)


def random_launch(rng, default):
    """Warps and stages that differ from ``default``'s (so a test sees the tuned row)."""
    warps = rng.choice([w for w in (2, 4, 8, 16) if w != default.num_warps])
    stages = rng.choice([s for s in range(1, 7) if s != default.num_stages])
    return warps, stages


# ------------------------------------------------------------------------------ round trip


def test_schema_round_trip(fresh_store):
    rng = random.Random()
    entries = [
        engine_entry("bwd_dq_masked", 64, 64, 64, num_warps=rng.choice([4, 8]), sub_m=32,
                     extra={"waves_per_eu": rng.randint(0, 8)}),
        {"op": "vsa", "kernel": "attn_topk_small", "head_dim": 128,
         "config": {"block_m": 16, "num_pivots": 4}, "base": {"input_precision": "tf32"},
         "measured": {"ms": rng.random()}},
    ]  # fmt: skip
    doc = tuning_file.new_document(IDENTITY, vidsparse="x")
    for e in entries:
        tuning_file.set_entry(doc, e)
    tuning_file.write_document(fresh_store, doc)
    back = tuning_file.read_document(fresh_store)
    assert back == doc
    assert [tuning_file.entry_key(e) for e in back["entries"]] == [
        ("engine", "bwd_dq_masked", 64, 64, 64),
        ("vsa", "attn_topk_small", 128),
    ]


def test_set_entry_replaces_the_same_key():
    doc = tuning_file.new_document(IDENTITY)
    tuning_file.set_entry(doc, engine_entry(num_warps=4))
    tuning_file.set_entry(doc, engine_entry(num_warps=8))
    tuning_file.set_entry(doc, engine_entry(bk=64, num_warps=4))
    assert [e["config"]["num_warps"] for e in doc["entries"]] == [8, 4]


def test_write_refuses_an_invalid_document(fresh_store):
    doc = tuning_file.new_document(IDENTITY)
    doc["entries"].append(engine_entry(num_warps=3))
    with pytest.raises(tuning_file.TuningFileError, match="num_warps"):
        tuning_file.write_document(fresh_store, doc)
    assert not fresh_store.exists()


# ------------------------------------------------------------------------------ the hooks


def test_lookup_takes_the_tuned_row_and_keeps_the_rest_of_the_table(fresh_store, on_h200):
    rng = random.Random()
    default = table_default()
    warps, stages = random_launch(rng, default)
    write(fresh_store, [engine_entry(num_warps=warps, num_stages=stages)])
    got = configs.lookup(HOPPER, "fwd", 128, 128, 128)
    assert got == replace(default, num_warps=warps, num_stages=stages)
    assert got.use_tma == default.use_tma and got.gluon == default.gluon  # Hopper's choices
    assert tuning_file.loaded(HOPPER).status == "in effect"
    # Other keys keep the table's: the masked variant, another block size, another head_dim.
    assert configs.lookup(HOPPER, "fwd", 128, 128, 128, masked=True) == table_default(masked=True)
    assert configs.lookup(HOPPER, "fwd", 128, 64, 128) == table_default(bk=64)
    assert configs.lookup(HOPPER, "fwd", 128, 128, 64) == table_default(d=64)


def test_masked_and_backward_rows(fresh_store, on_h200):
    rng = random.Random()
    step = rng.choice([16, 32])
    write(fresh_store, [engine_entry("bwd_dkdv_masked", 64, 64, 128, sub_m=step, num_warps=2)])
    got = configs.lookup(HOPPER, "bwd_dkdv", 64, 64, 128, masked=True)
    assert (got.sub_m, got.num_warps) == (step, 2)
    assert configs.lookup(HOPPER, "bwd_dkdv", 64, 64, 128) == table_default("bwd_dkdv", 64, 64)
    # A step wider than the block is fitted, as the table's are; fp32 fits the tuned row too.
    write(fresh_store, [engine_entry("bwd_dq", 64, 64, 128, sub_m=256, num_stages=3)])
    assert configs.lookup(HOPPER, "bwd_dq", 64, 64, 128).sub_m == 64
    fp32 = configs.lookup(HOPPER, "bwd_dq", 64, 64, 128, fp32=True)
    assert (fp32.num_stages, fp32.sub_m) == (1, 64)


def test_override_beats_the_file(fresh_store, on_h200):
    write(fresh_store, [engine_entry(num_warps=2, num_stages=5)])
    forced = configs.KernelConfig(16, 1)
    with configs.override(fwd=forced):
        assert configs.lookup(HOPPER, "fwd", 128, 128, 128) is forced
    assert configs.lookup(HOPPER, "fwd", 128, 128, 128).num_warps == 2


def test_suspended_gives_the_tables(fresh_store, on_h200):
    write(fresh_store, [engine_entry(num_warps=2)])
    with tuning_file.suspended():
        assert configs.lookup(HOPPER, "fwd", 128, 128, 128).num_warps != 2
    assert configs.lookup(HOPPER, "fwd", 128, 128, 128).num_warps == 2


def test_vsa_hooks(fresh_store, on_h200):
    rng = random.Random()
    pivots, warps = rng.choice([2, 4, 16]), rng.choice([2, 16])
    small = {"block_m": 64, "block_n": 128, "num_pivots": pivots, "num_warps": warps}
    write(fresh_store, [
        {"op": "vsa", "kernel": "attn_topk_small", "head_dim": 128, "config": small},
        {"op": "vsa", "kernel": "pool", "head_dim": 128, "config": {"tiles_per_program": 8}},
    ])  # fmt: skip
    got = vsa_configs.coarse_attn_config(HOPPER, 128, 624)  # Wan 480p: a small grid
    assert (got.block_m, got.block_n, got.num_pivots, got.num_warps) == (64, 128, pivots, warps)
    assert vsa_configs.coarse_attn_config(HOPPER, 128, 40).block_m == 64  # fitted to the grid
    with tuning_file.suspended():
        large = vsa_configs.coarse_attn_config(HOPPER, 128, 1440)
        pool = vsa_configs.pool_config(HOPPER, 128)
    assert vsa_configs.coarse_attn_config(HOPPER, 128, 1440) == large  # not tuned
    assert vsa_configs.pool_config(HOPPER, 128) == replace(pool, tiles_per_program=8)
    with tuning_file.suspended():
        pool_64 = vsa_configs.pool_config(HOPPER, 64)
    assert vsa_configs.pool_config(HOPPER, 64) == pool_64  # another head_dim: not tuned


def test_loaded_once_then_dict_lookups(fresh_store, on_h200, monkeypatch):
    write(fresh_store, [engine_entry(num_warps=2)])
    reads = []
    real = tuning_file.read_document
    monkeypatch.setattr(tuning_file, "read_document", lambda p: reads.append(p) or real(p))
    for _ in range(50):
        assert configs.lookup(HOPPER, "fwd", 128, 128, 128).num_warps == 2
        configs.lookup(HOPPER, "bwd_dq", 128, 128, 128)
    assert len(reads) == 1
    write(fresh_store, [engine_entry(num_warps=16)])  # reload() inside: read again
    assert configs.lookup(HOPPER, "fwd", 128, 128, 128).num_warps == 16


def test_another_target_than_this_machines_is_never_loaded(fresh_store):
    """Cross-target compile checks ask for cuda:90 on a CPU: no GPU query, the tables."""
    write(fresh_store, [engine_entry(num_warps=2)])
    assert configs.lookup(HOPPER, "fwd", 128, 128, 128) == table_default()
    assert tuning_file.loaded(HOPPER).status == "off"


# ------------------------------------------------------------------------------ where


def test_where_the_file_is_looked_for(monkeypatch, tmp_path):
    monkeypatch.delenv(tuning_file.ENV_VAR)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(tuning_file, "_gpu_name", lambda target: "NVIDIA H200 NVL")
    path, source = tuning_file.tuning_path(HOPPER)
    assert path == tmp_path / "vidsparse" / "tuning" / "nvidia-h200-nvl.json"
    assert source == "user cache"
    # The CPU interpreter reads no cached file (the CPU test suite stays as it is).
    assert tuning_file.tuning_path(CPU_INTERPRETER)[0] is None
    monkeypatch.setenv(tuning_file.ENV_VAR, str(tmp_path / "x.json"))
    assert tuning_file.tuning_path(CPU_INTERPRETER)[0] == tmp_path / "x.json"
    monkeypatch.setenv(tuning_file.ENV_VAR, "off")
    assert tuning_file.tuning_path(HOPPER)[0] is None


def test_absent_file_is_quiet(fresh_store, on_h200, caplog):
    with caplog.at_level(logging.WARNING, logger="vidsparse.tuning"):
        assert configs.lookup(HOPPER, "fwd", 128, 128, 128) == table_default()
    assert tuning_file.loaded(HOPPER).status == "absent" and not caplog.records


# ------------------------------------------------------------------------------ ignored


def _doc_text(entries=(), identity=IDENTITY, **top) -> str:
    doc = tuning_file.new_document(identity)
    doc["entries"] = list(entries)
    doc.update(top)
    return json.dumps(doc)


IGNORED = {
    "corrupt": ('{"format": "vidsparse-tuning", "schema": 1, "entr', "not valid JSON"),
    "not ours": (json.dumps({"rows": []}), "not a vidsparse tuning file"),
    "old schema": (_doc_text(schema=0), "schema version 0"),
    "newer schema": (_doc_text(schema=2), "schema version 2"),
    "other gpu": (_doc_text(identity={**IDENTITY, "gpu": "NVIDIA A100-SXM4-80GB"}), "gpu"),
    "other target": (_doc_text(identity={**IDENTITY, "target": "cuda:80"}), "target"),
    "other triton": (_doc_text(identity={**IDENTITY, "triton": "3.8.0"}), "triton '3.8.0'"),
    "other torch": (_doc_text(identity={**IDENTITY, "torch": "2.4.0"}), "torch '2.4.0'"),
    "other driver": (_doc_text(identity={**IDENTITY, "driver": "535.1"}), "driver '535.1'"),
    "no identity": (_doc_text(identity={"gpu": "x"}), '"identity"'),
    "unknown kernel": (_doc_text([engine_entry("fwd_fused", num_warps=4)]), "unknown kernel"),
    "unknown op": (_doc_text([{**engine_entry(), "op": "psa"}]), "unknown kernel psa/fwd"),
    "unknown field": (_doc_text([engine_entry(use_tma=False)]), "unknown field 'use_tma'"),
    "fwd has no step": (_doc_text([engine_entry(sub_m=64)]), "unknown field 'sub_m'"),
    "warps not pow2": (_doc_text([engine_entry(num_warps=6)]), "num_warps must be"),
    "warps a bool": (_doc_text([engine_entry(num_warps=True)]), "num_warps must be"),
    "stages 0": (_doc_text([engine_entry(num_stages=0)]), "num_stages must be"),
    "step 48": (_doc_text([engine_entry("bwd_dq", sub_m=48)]), "sub_m must be"),
    "block 8": (_doc_text([{**engine_entry(), "block_q": 8}]), "block_q must be"),
    "unknown knob": (_doc_text([engine_entry(extra={"waves": 1})]), "unknown extra 'waves'"),
    "knob range": (_doc_text([engine_entry(extra={"kpack": 4})]), "extra.kpack must be"),
    "pool tiles 3": (
        _doc_text(
            [{"op": "vsa", "kernel": "pool", "head_dim": 64, "config": {"tiles_per_program": 3}}]
        ),
        "tiles_per_program must be",
    ),  # fmt: skip
    "pivots 3": (
        _doc_text(
            [{"op": "vsa", "kernel": "attn_topk", "head_dim": 64, "config": {"num_pivots": 3}}]
        ),
        "num_pivots must be",
    ),  # fmt: skip
    "twice": (_doc_text([engine_entry(num_warps=4), engine_entry(num_warps=8)]), "a second"),
    "entries not a list": (
        json.dumps({**json.loads(_doc_text()), "entries": {"fwd": {}}}),
        '"entries" must be a list',
    ),
}


@pytest.mark.parametrize("case", sorted(IGNORED))
def test_an_unusable_file_is_ignored_with_a_warning(case, fresh_store, on_h200, caplog):
    text, words = IGNORED[case]
    fresh_store.write_text(text)
    tuning_file.reload()
    with caplog.at_level(logging.WARNING, logger="vidsparse.tuning"):
        got = configs.lookup(HOPPER, "fwd", 128, 128, 128)
        configs.lookup(HOPPER, "fwd", 128, 128, 128)
    assert got == table_default()
    state = tuning_file.loaded(HOPPER)
    assert state.status == "ignored" and words in state.reason, state.reason
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings  # once, not per lookup
    assert "ignored" in warnings[0] and words in warnings[0] and str(fresh_store) in warnings[0]


def test_a_mismatched_file_with_good_rows_is_still_not_used(fresh_store, on_h200):
    write(fresh_store, [engine_entry(num_warps=2)], identity={**IDENTITY, "triton": "3.5.1"})
    assert configs.lookup(HOPPER, "fwd", 128, 128, 128) == table_default()


def test_not_utf8_is_ignored(fresh_store, on_h200):
    fresh_store.write_bytes(b"\xff\xfe{")
    tuning_file.reload()
    assert configs.lookup(HOPPER, "fwd", 128, 128, 128) == table_default()
    assert "UTF-8" in tuning_file.loaded(HOPPER).reason


def test_an_entry_tuned_against_another_default_is_ignored(fresh_store, on_h200, caplog):
    default = table_default()
    entry = engine_entry(num_warps=2)
    entry["base"] = {"use_tma": not default.use_tma}
    write(fresh_store, [entry])
    with caplog.at_level(logging.WARNING, logger="vidsparse.tuning"):
        assert configs.lookup(HOPPER, "fwd", 128, 128, 128) == default
    assert "default changed" in caplog.text and "use_tma" in caplog.text
    applies, why = tuning_file.entry_status(HOPPER, tuning_file.engine_key(
        "fwd", 128, 128, 128, False), default)  # fmt: skip
    assert not applies and "default changed" in why


def test_an_entry_naming_a_field_the_dataclass_lacks_is_ignored(fresh_store, on_h200, caplog):
    """The file's schema knows ``sub_m``; a config class without it (a renamed field) makes
    the entry unusable, not the lookup fail."""
    entry = engine_entry("bwd_dq", sub_m=64)
    entry["base"] = {"no_such_field": 1}
    write(fresh_store, [entry])
    with caplog.at_level(logging.WARNING, logger="vidsparse.tuning"):
        assert configs.lookup(HOPPER, "bwd_dq", 128, 128, 128) == table_default("bwd_dq")
    assert "no field 'no_such_field'" in caplog.text
