"""Which kernels a GPU of each generation gets, with the GPU faked (no GPU needed).

The capability query (``torch.cuda.get_device_properties``) is monkeypatched to report an
Ampere (sm_80), a Hopper (sm_90) or a Blackwell (sm_100) GPU, or (with ``torch.version.hip``
set) an MI300 (gfx942) or MI350 (gfx950), ``utils.device.target_of`` reads it as it would on
that GPU, and the engine's launchers run on meta tensors with every kernel swapped for a
recorder: the kernels they would launch are what is checked. Only Hopper may take the TMA
kernels and the Gluon forward (``fwd_sm90.py``: wgmma and Hopper's TMA); every other GPU takes
the Triton pointer kernels, with configs that compile spill-free for ``cuda:100``, ``gfx942``
and ``gfx950`` (``tests/compile/test_compile_targets.py``).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("triton")

from vidsparse.ops.block_sparse_attn import (  # noqa: E402
    bwd,
    bwd_sm90,
    configs,
    fwd,
    fwd_sm90,
    launch,
    lists,
)
from vidsparse.ops.video_sparse_attn import configs as vsa_configs  # noqa: E402
from vidsparse.utils import device as device_module  # noqa: E402
from vidsparse.utils.device import Target  # noqa: E402

GPUS = {  # name -> (major, minor)
    "A100 (sm_80)": (8, 0),
    "H100 (sm_90)": (9, 0),
    "B200 (sm_100)": (10, 0),
    "RTX 5090 (sm_120)": (12, 0),
}
AMD_GPUS = {"MI300X (gfx942)": "gfx942", "MI350X (gfx950)": "gfx950"}


@pytest.fixture
def fake_gpu(monkeypatch):
    """``fake_gpu(major, minor)``: the Target ``target_of`` reads for CUDA device 0 of that
    capability (``fake_gpu(9, 4, hip_arch="gfx942")``: a ROCm build's device of that gfx
    arch); the engine's launchers see it for every tensor."""
    device_module.target_of.cache_clear()

    def install(major, minor, hip_arch=None):
        arch = f"{hip_arch}:sramecc+:xnack-" if hip_arch else ""
        props = SimpleNamespace(major=major, minor=minor, name=f"fake sm_{major}{minor} {arch}",
                                multi_processor_count=132, gcnArchName=arch)  # fmt: skip
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index=None: props)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.version, "hip", "6.4" if hip_arch else None)
        target = device_module.target_of(torch.device("cuda", 0))
        for module in (fwd, bwd):
            monkeypatch.setattr(module, "target_of", lambda device: target)
        return target

    yield install
    device_module.target_of.cache_clear()


class _Recorder:
    def __init__(self, name, sink):
        self.name, self.sink = name, sink

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.sink.append((self.name, kwargs))


def _launches(monkeypatch, block, head_dim=128, dtype=torch.bfloat16, backward=True,
              sizes=False, padding_finite=False, epilogue=None):  # fmt: skip
    """Kernel names (and launch kwargs) of one forward and one backward on meta tensors;
    ``sizes``: with key-block sizes (``padding_finite`` as the video ops pass it)."""
    sink = []
    for module in (fwd, bwd, lists):
        for attr in dir(module):
            if attr.endswith("_kernel"):
                monkeypatch.setattr(module, attr, _Recorder(attr, sink))
    monkeypatch.setattr(fwd_sm90, "block_sparse_attn_fwd_sm90",
                        lambda *args, **kwargs: sink.append(("gluon_fwd_sm90", {})) or (
                            torch.empty_like(args[0]), None))  # fmt: skip
    monkeypatch.setattr(bwd_sm90, "dkdv_gluon",
                        lambda q, k, v, *args, **kwargs: sink.append(("gluon_dkdv_sm90", kwargs))
                        or (torch.empty_like(k), torch.empty_like(v)))  # fmt: skip
    monkeypatch.setattr(bwd_sm90, "dq_gluon",
                        lambda q, *args, **kwargs: sink.append(("gluon_dq_sm90", kwargs))
                        or torch.empty_like(q))  # fmt: skip
    monkeypatch.setattr(bwd_sm90, "dkdvdq_gluon",
                        lambda q, k, v, *args, **kwargs: sink.append(("gluon_dkdvdq_sm90", kwargs))
                        or (torch.empty_like(k), torch.empty_like(v),
                            torch.empty_like(q)))  # fmt: skip
    meta = torch.device("meta")
    B, H, S = 1, 2, 4 * block
    q, k, v, do = (torch.empty(B, H, S, head_dim, dtype=dtype, device=meta) for _ in range(4))
    idx = torch.empty(1, H, S // block, 2, dtype=torch.int32, device=meta)
    cnt = torch.empty(1, H, S // block, dtype=torch.int32, device=meta)
    kv_sizes = torch.empty(S // block, dtype=torch.int32, device=meta) if sizes else None
    case = (kv_sizes, block, block, head_dim**-0.5)
    o, lse = fwd.block_sparse_attn_fwd(q, k, v, idx, cnt, *case, padding_finite=padding_finite)
    if backward:
        lse = torch.empty(B, H, S, dtype=torch.float32, device=meta)
        more = {} if epilogue is None else {"epilogue": epilogue}
        bwd.block_sparse_attn_bwd(do, q, k, v, o, lse, idx, cnt, *case,
                                  padding_finite=padding_finite, **more)  # fmt: skip
    return sink


def _backward_names(launches):
    return [n for n, _ in launches if ("_bwd_" in n or "gluon_d" in n) and "preprocess" not in n]


def test_target_of_reads_the_capability(fake_gpu):
    assert fake_gpu(8, 0) == Target("cuda", 80) and not Target("cuda", 80).is_hopper
    device_module.target_of.cache_clear()
    assert fake_gpu(9, 0) == Target("cuda", 90) and Target("cuda", 90).is_hopper
    device_module.target_of.cache_clear()
    assert fake_gpu(10, 0) == Target("cuda", 100) and not Target("cuda", 100).is_hopper


@pytest.mark.parametrize("gpu", [g for g in GPUS if "sm_90" not in g])
@pytest.mark.parametrize("block", [64, 128])
def test_non_hopper_gpus_take_the_triton_pointer_kernels(monkeypatch, fake_gpu, gpu, block):
    """Ampere and Blackwell (and later): no Gluon, no TMA, no fused backward; 128-row forward
    blocks with 8 warps (4 spill on sm_100)."""
    target = fake_gpu(*GPUS[gpu])
    names = [name for name, _ in _launches(monkeypatch, block)]
    assert "gluon_fwd_sm90" not in names
    assert "block_sparse_attn_fwd_kernel" in names
    assert not any("tma" in n or "fused" in n for n in names), names
    assert {"block_sparse_attn_bwd_dkdv_kernel", "block_sparse_attn_bwd_dq_kernel"} <= set(names)
    fwd_kwargs = dict(_launches(monkeypatch, block, backward=False))["block_sparse_attn_fwd_kernel"]
    assert fwd_kwargs["num_warps"] == (8 if block == 128 else 4)
    for kernel in ("fwd", "bwd_dkdv", "bwd_dq"):
        cfg = configs.lookup(target, kernel, block, block, 128)
        assert not (cfg.use_tma or cfg.gluon or cfg.fused), (kernel, cfg)
    # NVIDIA rows carry no eviction hints (yet): every kernel compiles as without the knob.
    assert all(
        value == "" for _, kwargs in _launches(monkeypatch, block) for key, value in kwargs.items()
        if key.startswith("EVICT_")
    )  # fmt: skip
    # VSA's coarse kernels: the generic NVIDIA table, not Hopper's tuned one.
    assert vsa_configs._tables_for(target) == [vsa_configs.NVIDIA_GENERIC]


def test_hopper_configs_are_untouched_by_the_other_gpus_rows(monkeypatch):
    """The non-Hopper rows (masked ones among them) never reach a Hopper's lookup: every
    Hopper config is the same with that table emptied."""
    hopper = Target("cuda", 90)
    cases = [(kernel, *block, d, masked) for kernel in ("fwd", "bwd_dkdv", "bwd_dq")
             for block in ((64, 64), (128, 64), (128, 128)) for d in (64, 128)
             for masked in (False, True)]  # fmt: skip
    with_rows = [configs.lookup(hopper, *case) for case in cases]
    monkeypatch.setattr(configs, "NVIDIA_NON_HOPPER", {})
    assert with_rows == [configs.lookup(hopper, *case) for case in cases]


@pytest.mark.parametrize("block", [64, 128])
def test_hopper_takes_the_gluon_forward_and_tma(monkeypatch, fake_gpu, block):
    """The control: on sm_90 the same calls reach the Gluon forward and the TMA backward: at
    128x128 its dK/dV and dQ in the Gluon kernels (the default, and ``one_pass="off"``), or
    with ``one_pass="fixed"`` the one pass with dQ in fixed point (k, v's bounds first, the
    preprocess forming the rows' multipliers); at 64x64 both Triton kernels (where the Gluon
    dK/dV kernel was slower, and there is no 64-row Gluon dQ kernel), whatever is asked."""
    from vidsparse.ops.block_sparse_attn import configs

    fake_gpu(9, 0)
    names = [name for name, _ in _launches(monkeypatch, block)]
    assert names.count("gluon_fwd_sm90") == 1 and "block_sparse_attn_fwd_kernel" not in names
    triton = ["block_sparse_attn_bwd_dkdv_kernel", "block_sparse_attn_bwd_dq_kernel"]
    two = ["gluon_dkdv_sm90", "gluon_dq_sm90"] if block == 128 else triton
    for mode in (None, configs.ONE_PASS_OFF):
        with configs.override(one_pass=mode):
            assert _backward_names(_launches(monkeypatch, block)) == two
    with configs.override(one_pass="fixed"):
        launches = _launches(monkeypatch, block)
    preprocess = [kw for name, kw in launches if "preprocess" in name]
    if block == 128:
        assert _backward_names(launches) == ["block_sparse_attn_bwd_kv_bounds_kernel",
                                             "gluon_dkdvdq_sm90"]  # fmt: skip
        assert preprocess[0]["DQ_FIXED"] and launches[-1][1]["dq_fix"] is preprocess[0]["DQ_FIX"]
    else:
        assert "DQ_FIXED" not in preprocess[0] and _backward_names(launches) == two


def test_hopper_backward_leaves_the_gluon_kernels_where_they_do_not_fit(monkeypatch, fake_gpu):
    """At 128x128 the Gluon dK/dV and dQ kernels need D=128, 16-bit inputs, TMA, an epilogue
    with their Gluon hook, and a row that asks for them (the masked rows do not). Without one
    of these that gradient's Triton kernel runs (both in the fused launch when neither is
    Gluon's), never a failure."""
    from vidsparse.ops.block_sparse_attn.epilogue import Epilogue, EpilogueFns, FnSpecs

    fake_gpu(9, 0)
    fused = ["block_sparse_attn_bwd_fused_kernel"]
    assert _backward_names(_launches(monkeypatch, 128, head_dim=64)) == fused
    fp32 = _backward_names(_launches(monkeypatch, 128, dtype=torch.float32))
    assert not any("gluon" in n for n in fp32), fp32

    class OwnHooks(Epilogue):  # a client's dQ and dK/dV hooks, Triton only
        name = "test_own_grad_hooks"

        def fns(self):
            base = super().fns()
            hook = FnSpecs("own", object())
            return EpilogueFns(base.forward, base.prologue, hook, hook, base.forward_sm90)

    assert _backward_names(_launches(monkeypatch, 128, epilogue=OwnHooks())) == fused
    # key-block sizes vouched finite: Triton's kernels (the masked 128x128 rows ask for no
    # Gluon, although both Gluon kernels take padding keys)
    finite = _backward_names(_launches(monkeypatch, 128, sizes=True, padding_finite=True))
    assert not any("gluon" in n for n in finite), finite
    # padding of unknown content: no TMA, so no Gluon either
    masked = _backward_names(_launches(monkeypatch, 128, sizes=True, padding_finite=False))
    assert not any("gluon" in n for n in masked), masked


@pytest.mark.parametrize("gpu", AMD_GPUS)
@pytest.mark.parametrize("block", [64, 128])
@pytest.mark.parametrize("sizes", [False, True])
def test_amd_gpus_take_the_pointer_kernels_with_their_hints(monkeypatch, fake_gpu, gpu, block,
                                                            sizes):  # fmt: skip
    """CDNA3/4: never the Gluon forward or TMA (Hopper's), even where the inputs would allow
    it (16-bit, aligned, padding vouched finite), nor the fused backward; every kernel gets
    the AMD rows' launch options and eviction hints (``configs.AMD_CDNA``)."""
    target = fake_gpu(9, 4, hip_arch=AMD_GPUS[gpu])
    assert target == Target("hip", AMD_GPUS[gpu]) and target.is_cdna
    monkeypatch.setattr(fwd, "gluon_fits", lambda *args: True)  # were the inputs Gluon's
    launches = _launches(monkeypatch, block, sizes=sizes, padding_finite=sizes)
    names = [name for name, _ in launches]
    assert "gluon_fwd_sm90" not in names
    assert not any("tma" in n or "fused" in n for n in names), names
    kwargs = {name: kw for name, kw in launches}
    hints = {  # kernel -> (row, EVICT_STREAMED, EVICT_RESIDENT)
        "block_sparse_attn_fwd_kernel": ("fwd", "evict_first", ""),
        "block_sparse_attn_bwd_dkdv_kernel": ("bwd_dkdv", "evict_first", "evict_first"),
        "block_sparse_attn_bwd_dq_kernel": ("bwd_dq", "evict_first", ""),
    }
    for name, (row, streamed, resident) in hints.items():
        cfg = configs.lookup(target, row, block, block, 128, masked=sizes)
        assert not (cfg.use_tma or cfg.gluon or cfg.fused), (row, cfg)
        assert (kwargs[name]["EVICT_STREAMED"], kwargs[name]["EVICT_RESIDENT"]) == (
            streamed, resident), name  # fmt: skip
        assert {"waves_per_eu", "matrix_instr_nonkdim", "kpack"} <= set(kwargs[name]), name
        assert kwargs[name]["num_stages"] == cfg.num_stages, name


def test_every_amd_row_carries_the_hints():
    """Each kernel's rows, the head-dim-specific ones too: evict_first on the streamed tiles,
    and on the resident ones of dK/dV only."""
    for key, cfg in configs.AMD_CDNA.items():
        assert cfg.evict_streamed == "evict_first", key
        assert cfg.evict_resident == ("evict_first" if key[0] == "bwd_dkdv" else ""), key


def test_eviction_hints_are_checked():
    with pytest.raises(ValueError, match="evict_streamed"):
        configs.KernelConfig(evict_streamed="evict_normal")


@pytest.mark.parametrize("version, warps", [((3, 6), 4), ((3, 8), 8), ((3, 9), 8), (None, 4)])
def test_vsa_coarse_config_on_hopper_follows_the_triton(monkeypatch, version, warps):
    """Hopper's coarse top-k: 4 warps as measured with Triton 3.6; from 3.8 on (whose compiler
    spills 424-520 B there) the spill-free 8 warps. Other GPUs: the generic 8 warps."""
    monkeypatch.setattr(vsa_configs, "triton_version", lambda: version)
    for tiles in (624, 1440):  # the small-grid row and the large one
        cfg = vsa_configs.coarse_attn_config(Target("cuda", 90), 128, tiles)
        assert cfg.num_warps == warps, (tiles, cfg)
        assert vsa_configs.coarse_attn_config(Target("cuda", 100), 128, tiles).num_warps == 8


def test_a_gluon_api_that_differs_switches_gluon_off_with_a_reason(monkeypatch, fake_gpu,
                                                                    caplog):  # fmt: skip
    """Where the Gluon launcher cannot be imported (a Triton whose Gluon API moved), a Hopper
    takes the Triton TMA kernel, and the log says why, once."""
    import sys

    fake_gpu(9, 0)
    launch.gluon_launcher.cache_clear()
    monkeypatch.setitem(sys.modules, "vidsparse.ops.block_sparse_attn.fwd_sm90", None)
    try:
        with caplog.at_level("WARNING", logger="vidsparse"):
            names = [name for name, _ in _launches(monkeypatch, 128, backward=False)]
            _launches(monkeypatch, 128, backward=False)
    finally:
        launch.gluon_launcher.cache_clear()
    assert names == ["block_sparse_attn_fwd_tma_kernel"]
    notes = [r.getMessage() for r in caplog.records if "Gluon forward is off" in r.getMessage()]
    assert len(notes) == 1 and "TMA kernel runs instead" in notes[0]


@pytest.mark.parametrize("version", [(3, 9), (3, 5), None])
def test_a_triton_outside_the_gluon_span_switches_gluon_off(monkeypatch, fake_gpu, caplog,
                                                            version):  # fmt: skip
    """Triton 3.9 removed a Gluon TMA call the kernels make: there (and before 3.6) the Hopper
    forward is the Triton TMA kernel and dK/dV Triton's, with one log line each naming the
    Triton."""
    from vidsparse.utils import device as device_mod

    fake_gpu(9, 0)
    launch.gluon_launcher.cache_clear()
    monkeypatch.setattr(device_mod, "triton_version", lambda: version)
    try:
        with caplog.at_level("WARNING", logger="vidsparse"):
            names = _backward_names(_launches(monkeypatch, 128))
            forward = [name for name, _ in _launches(monkeypatch, 128, backward=False)]
    finally:
        launch.gluon_launcher.cache_clear()
    assert forward == ["block_sparse_attn_fwd_tma_kernel"]
    assert names == ["block_sparse_attn_bwd_fused_kernel"]  # dK/dV in Triton's kernel too
    for kernel in ("forward", "backward"):
        (note,) = [r.getMessage() for r in caplog.records
                   if f"Gluon {kernel} is off" in r.getMessage()]  # fmt: skip
        assert "written for the Gluon API of Triton 3.6-3.8" in note
