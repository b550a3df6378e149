"""Calibration files: version 2 (.safetensors with the grid and step count in its metadata),
version 1 (.pt, still read), mixed folders, what the files record, and bad files named."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save as safetensors_save

from vidsparse.layout.grid import VideoGrid
from vidsparse.search import (
    CALIBRATION_SUFFIXES,
    CalibrationInfo,
    CalibrationSample,
    Candidate,
    CandidateSet,
    build_loss_table,
    load_calibration,
    save_calibration_sample,
)

GRID = VideoGrid((2, 4, 4), tile=(1, 4, 4))  # 32 tokens, 2 blocks


def _qkv(batch=None, heads=2, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    shape = (heads, GRID.num_tokens, 8) if batch is None else (batch, heads, GRID.num_tokens, 8)
    return tuple(torch.randn(shape, generator=g).to(dtype) for _ in range(3))


def _sample(step=3, layer=1, **kwargs) -> CalibrationSample:
    return CalibrationSample(step, layer, *_qkv(seed=10 * step + layer), **kwargs)


def _meta(**changes) -> dict[str, str]:
    """Valid version-2 metadata with ``changes`` (a value None drops the key)."""
    meta = {
        "format": "vidsparse-calibration",
        "version": "2",
        "step": "3",
        "layer": "1",
        "tiled": "false",
        "grid_shape": "[2, 4, 4]",
        "num_steps": "10",
    }
    meta.update(changes)
    return {k: v for k, v in meta.items() if v is not None}


def _write_raw(path, meta, tensors=("q", "k", "v")):
    q, _, _ = _qkv()
    path.write_bytes(safetensors_save({name: q.clone() for name in tensors}, meta))


# ---------------------------------------------------------------------------------------------
# version 2
# ---------------------------------------------------------------------------------------------


def test_safetensors_round_trip_keeps_tensors_and_metadata(tmp_path):
    q, k, v = _qkv(batch=2, dtype=torch.bfloat16)
    sample = CalibrationSample(7, 2, q, k, v, grid_shape=(2, 4, 4), num_steps=20)
    path = tmp_path / "s.safetensors"
    save_calibration_sample(sample, path)
    assert [p.name for p in tmp_path.iterdir()] == ["s.safetensors"]  # no temporary left
    with safe_open(str(path), framework="pt") as f:  # plain safetensors, documented metadata
        assert sorted(f.keys()) == ["k", "q", "v"]
        assert f.metadata() == {
            "format": "vidsparse-calibration",
            "version": "2",
            "step": "7",
            "layer": "2",
            "tiled": "false",
            "grid_shape": "[2, 4, 4]",
            "num_steps": "20",
        }
    (back,) = list(load_calibration(path))
    assert (back.step, back.layer, back.tiled) == (7, 2, False)
    assert (back.grid_shape, back.num_steps) == ((2, 4, 4), 20)
    for a, b in ((back.q, q), (back.k, k), (back.v, v)):
        assert a.dtype == torch.bfloat16 and torch.equal(a, b)


def test_save_arguments_override_the_sample_and_views_of_one_buffer_are_saved(tmp_path):
    qkv = torch.randn(3, 2, GRID.num_tokens, 8)  # q/k/v views of one fused buffer
    sample = CalibrationSample(1, 0, qkv[0], qkv[1], qkv[2], tiled=True, num_steps=4)
    path = tmp_path / "s.safetensors"
    save_calibration_sample(sample, path, grid=GRID, num_steps=5)
    back = load_calibration(path)[0]
    assert (back.grid_shape, back.num_steps, back.tiled) == (GRID.shape, 5, True)
    assert torch.equal(back.k, qkv[1]) and torch.equal(back.v, qkv[2])
    info = load_calibration(path).infos()[0]
    assert info == CalibrationInfo(path, 1, 0, True, GRID.shape, 5)


def test_save_without_grid_or_steps_records_neither(tmp_path):
    save_calibration_sample(_sample(), tmp_path / "s.safetensors")
    with safe_open(str(tmp_path / "s.safetensors"), framework="pt") as f:
        assert "grid_shape" not in f.metadata() and "num_steps" not in f.metadata()
    files = load_calibration(tmp_path)
    assert files.recorded("grid_shape") is None and files.recorded("num_steps") is None


@pytest.mark.parametrize(
    "name, kwargs, match",
    [
        ("s.pt", {"num_steps": 10}, "cannot record num_steps"),
        ("s.bin", {}, r"ends in \.safetensors"),
        ("s.safetensors", {"num_steps": 3}, "outside num_steps=3"),  # step 3
        ("s.safetensors", {"num_steps": 0}, "positive"),
    ],
)
def test_save_refuses(tmp_path, name, kwargs, match):
    with pytest.raises(ValueError, match=match):
        save_calibration_sample(_sample(), tmp_path / name, **kwargs)
    assert not list(tmp_path.iterdir())


def test_the_pipeline_member_is_recorded_and_read_back(tmp_path):
    save_calibration_sample(_sample(transformer="transformer_2"), tmp_path / "a.safetensors")
    with safe_open(str(tmp_path / "a.safetensors"), framework="pt") as f:
        assert f.metadata()["transformer"] == '"transformer_2"'
    files = load_calibration(tmp_path)
    assert files[0].transformer == "transformer_2"
    assert files.recorded("transformer") == ("transformer_2", tmp_path / "a.safetensors")
    with pytest.raises(ValueError, match="cannot record num_steps or transformer"):
        save_calibration_sample(_sample(transformer="transformer"), tmp_path / "b.pt")
    with pytest.raises(TypeError, match="transformer must be a non-empty str"):
        _sample(transformer=2)
    save_calibration_sample(_sample(transformer="transformer"), tmp_path / "c.safetensors")
    with pytest.raises(ValueError, match="disagree on transformer"):
        load_calibration(tmp_path).recorded("transformer")


def test_sample_checks_its_step_count():
    with pytest.raises(ValueError, match="step 3 is outside num_steps=3"):
        _sample(num_steps=3)
    with pytest.raises(TypeError, match="num_steps must be an int"):
        _sample(num_steps=2.5)


# ---------------------------------------------------------------------------------------------
# version 1 and mixed folders
# ---------------------------------------------------------------------------------------------


def test_old_pt_files_still_load(tmp_path):
    q, k, v = _qkv()
    # as vidsparse wrote them before version 2
    old = {"format": "vidsparse-calibration", "version": 1, "step": 2, "layer": 0}
    torch.save({**old, "q": q, "k": k, "v": v, "grid_shape": [2, 4, 4]}, tmp_path / "a.pt")
    torch.save({**old, "step": 4, "q": q, "k": k, "v": v, "tiled": True}, tmp_path / "b.pt")
    files = load_calibration(tmp_path)
    a, b = list(files)
    assert (a.step, a.grid_shape, a.tiled, a.num_steps) == (2, (2, 4, 4), False, None)
    assert (b.step, b.grid_shape, b.tiled, b.num_steps) == (4, None, True, None)
    assert torch.equal(a.q, q) and torch.equal(b.v, v)
    assert files.steps() == [2, 4]
    # save_calibration_sample still writes version 1 to a .pt path
    save_calibration_sample(_sample(step=5), tmp_path / "c.pt", grid=GRID)
    assert torch.load(tmp_path / "c.pt", weights_only=True)["version"] == 1
    assert load_calibration(tmp_path / "c.pt")[0].grid_shape == GRID.shape


def test_mixed_folder_reads_both_formats_sorted_by_name(tmp_path):
    save_calibration_sample(_sample(step=1), tmp_path / "a.safetensors", num_steps=10)
    save_calibration_sample(_sample(step=2), tmp_path / "b.pt", grid=GRID)
    save_calibration_sample(_sample(step=3), tmp_path / "c.safetensors", grid=GRID)
    (tmp_path / "notes.txt").write_text("not a sample")
    (tmp_path / "sub.pt").mkdir()  # a folder is no sample either
    files = load_calibration(tmp_path)
    assert [p.name for p in files.paths] == ["a.safetensors", "b.pt", "c.safetensors"]
    assert [s.step for s in files] == [1, 2, 3]
    # files that record nothing do not disagree with those that do
    assert files.recorded("grid_shape") == (GRID.shape, tmp_path / "b.pt")
    assert files.recorded("num_steps") == (10, tmp_path / "a.safetensors")
    assert CALIBRATION_SUFFIXES == (".pt", ".safetensors")


def test_empty_folder_names_both_suffixes(tmp_path):
    (tmp_path / "x.txt").write_text("")
    with pytest.raises(ValueError, match=r"holds no \.pt or \.safetensors files"):
        load_calibration(tmp_path)
    with pytest.raises(FileNotFoundError):
        load_calibration(tmp_path / "missing")


@pytest.mark.parametrize("field", ["grid_shape", "num_steps"])
def test_recorded_values_that_disagree_name_two_files(tmp_path, field):
    save_calibration_sample(_sample(), tmp_path / "a.safetensors", grid=GRID, num_steps=10)
    other = {"grid": VideoGrid((2, 4, 8))} if field == "grid_shape" else {"grid": GRID}
    steps = 12 if field == "num_steps" else 10
    save_calibration_sample(_sample(), tmp_path / "b.safetensors", num_steps=steps, **other)
    files = load_calibration(tmp_path)
    with pytest.raises(ValueError, match=f"disagree on {field}") as err:
        files.recorded(field)
    assert "a.safetensors" in str(err.value) and "b.safetensors" in str(err.value)
    with pytest.raises(ValueError, match="field must be"):
        files.recorded("step")


# ---------------------------------------------------------------------------------------------
# bad files
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "meta, tensors, match",
    [
        (_meta(format="other"), "qkv", "metadata 'format' must be"),
        (_meta(version="1"), "qkv", "unsupported version '1'"),
        (_meta(version=None), "qkv", "unsupported version None"),
        (_meta(step=None), "qkv", r"missing metadata \['step'\]"),
        (_meta(extra="1"), "qkv", r"unexpected metadata \['extra'\]"),
        (_meta(step="three"), "qkv", "metadata 'step' is not JSON"),
        (_meta(step="-1"), "qkv", "step must be >= 0"),
        (_meta(step="1.0"), "qkv", "step must be an int"),
        (_meta(tiled='"no"'), "qkv", "tiled must be a bool"),
        (_meta(grid_shape="[2, 4]"), "qkv", "grid_shape must have 3 entries"),
        (_meta(grid_shape="[2, 0, 4]"), "qkv", "grid_shape must be positive"),
        (_meta(num_steps="3"), "qkv", "step 3 is outside num_steps=3"),
        (_meta(num_steps="true"), "qkv", "num_steps must be an int"),
        (_meta(transformer="3"), "qkv", "transformer must be a non-empty str"),
        (_meta(), "qv", r"missing tensors \['k'\]"),
        (_meta(), "qkvx", r"unexpected tensors \['x'\]"),
    ],
)
def test_bad_version_2_files_are_named(tmp_path, meta, tensors, match):
    path = tmp_path / "bad.safetensors"
    _write_raw(path, meta, tensors=tuple(tensors))
    for read in (lambda: load_calibration(tmp_path)[0], lambda: load_calibration(path).infos()):
        with pytest.raises(ValueError, match=match) as err:
            read()
        assert "calibration file" in str(err.value) and "bad.safetensors" in str(err.value)


def test_bad_tensors_and_unreadable_files_are_named(tmp_path):
    path = tmp_path / "bad.safetensors"
    q, _, _ = _qkv()
    path.write_bytes(safetensors_save({"q": q, "k": q[:1].clone(), "v": q.clone()}, _meta()))
    with pytest.raises(ValueError, match="bad.safetensors.*q, k, v must share one shape"):
        load_calibration(path)[0]
    path.write_bytes(safetensors_save({n: q.int() for n in "qkv"}, _meta()))
    with pytest.raises(ValueError, match="bad.safetensors.*float tensor"):
        load_calibration(path)[0]
    path.write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="calibration file .*bad.safetensors.* cannot be read"):
        load_calibration(tmp_path)[0]
    pt = tmp_path / "bad.pt"
    torch.save({"format": "vidsparse-calibration", "version": 2}, pt)
    with pytest.raises(ValueError, match=r"bad\.pt.*unsupported version 2 in a \.pt file"):
        load_calibration(pt)[0]


# ---------------------------------------------------------------------------------------------
# the search and the recorded step count
# ---------------------------------------------------------------------------------------------


def _dense_only() -> CandidateSet:
    return CandidateSet.build([Candidate.dense()], GRID.tiles)


def test_search_takes_num_steps_from_the_files_and_refuses_another(torch_backend, tmp_path):
    for step in (2, 3):
        save_calibration_sample(
            _sample(step=step), tmp_path / f"s{step}.safetensors", grid=GRID, num_steps=10
        )
    table = build_loss_table(tmp_path, GRID, candidates=_dense_only(), progress=False)
    assert table.num_steps == 10  # not the last sampled step + 1
    assert table.steps == [2, 3] and not table.skipped_steps  # steps 0, 1 of 10 dense
    with pytest.raises(ValueError, match="captured in a 10-step schedule.*num_steps=8"):
        build_loss_table(tmp_path, GRID, candidates=_dense_only(), num_steps=8, progress=False)
    in_memory = [_sample(step=2, num_steps=10), _sample(step=3, num_steps=12)]
    with pytest.raises(ValueError, match=r"record different num_steps: \[10, 12\]"):
        build_loss_table(in_memory, GRID, candidates=_dense_only(), progress=False)
    one = build_loss_table(in_memory[:1], GRID, candidates=_dense_only(), progress=False)
    assert one.num_steps == 10


def test_the_table_and_plan_carry_the_pipeline_member(torch_backend, tmp_path):
    from vidsparse.search import LossTable, plan_from_table

    for step in (2, 3):
        sample = _sample(step=step, transformer="transformer_2")
        save_calibration_sample(sample, tmp_path / f"s{step}.safetensors", num_steps=10)
    table = build_loss_table(tmp_path, GRID, candidates=_dense_only(), progress=False)
    assert table.transformer == "transformer_2"
    table.save(tmp_path / "table.pt")
    again = LossTable.load(tmp_path / "table.pt")
    assert again.transformer == "transformer_2"
    plan = plan_from_table(again, alpha=0.1)
    assert plan.transformer == "transformer_2"
    both = [_sample(step=2, transformer="transformer"), _sample(step=3, transformer="x")]
    with pytest.raises(ValueError, match="came from 'x', earlier samples from 'transformer'"):
        build_loss_table(both, GRID, candidates=_dense_only(), num_steps=10, progress=False)
