"""The end-to-end benchmark's models and inputs: diffusers' video transformers built from their
published configs (random weights), one step's latents and conditioning, and synthetic PSA
plans. See ``vidsparse.bench.ops.e2e`` for what is measured.

Workloads (``--model``), one table entry each (``MODELS``), one family per diffusers class
(``FAMILIES``: how the class is configured, cut to ``--layers`` blocks and called):

- ``wan1.3b``, ``wan14b`` (Wan 2.1 T2V, 480p / 720p), ``wan2.2-5b`` (Wan 2.2 TI2V-5B, 704x1280):
  ``WanTransformer3DModel``;
- ``hunyuan1.5`` (HunyuanVideo 1.5, 720p): ``HunyuanVideo15Transformer3DModel``, joint video +
  text self-attention;
- ``hunyuanvideo`` (HunyuanVideo 13B, 720p 129 frames): ``HunyuanVideoTransformer3DModel``,
  dual- and single-stream blocks, joint video + text self-attention with a key mask;
- ``ltx`` (LTX-Video 2B, 1216x704): ``LTXVideoTransformer3DModel``, head_dim 64;
- ``ltx2`` (LTX-2 19B, 1536x1024): ``LTX2VideoTransformer3DModel``, video and audio streams;
- ``cosmos`` (Cosmos-1.0-Diffusion-7B-Text2World, 704x1280): ``CosmosTransformer3DModel``;
- ``kandinsky5`` (Kandinsky 5.0 Video Lite 2B, 768x512): ``Kandinsky5Transformer3DModel``,
  head_dim 64, channels-last latents;
- ``skyreels-v2`` (SkyReels-V2 T2V 14B 720P): ``SkyReelsV2Transformer3DModel``;
- ``wan-vace`` (Wan 2.1 VACE 14B, 720p): ``WanVACETransformer3DModel`` with control states;
- ``chronoedit`` (ChronoEdit-14B, 720p edit): ``ChronoEditTransformer3DModel``, Wan 2.1 I2V-14B
  blocks (CLIP image and text cross-attention) on the input and edited frames' latents;
- ``wan-animate`` (Wan 2.2 Animate 14B, 720p, 77-frame segment): ``WanAnimateTransformer3DModel``,
  Wan I2V-14B blocks plus pose latents, a motion/face encoder and face adapters.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch

# Re-exported: the model table, as the e2e op, its tests and e2e_ulysses read it from here.
from vidsparse.bench.ops.e2e_configs import (  # noqa: E402, F401
    CONFIGS,
    DEFAULT_PSA_TILE,
    DIFFUSERS_MISSING,
    HUNYUAN15_CONFIG,
    LATENT_HW,
    MODELS,
    PSA_SLACK,
    PSA_TOLERANCE,
    TINY_HY15,
    TINY_PSA_TILE,
    VSA_TILE,
    WAN_CONFIGS,
    least_padding_tile,
)
from vidsparse.bench.ops.e2e_families_more import CLASS_NAMES, FAMILIES, Family  # noqa: F401


def import_model(family: str = "wan"):
    """The diffusers transformer class of ``family``, or exit with one line saying how to
    install diffusers."""
    try:
        import diffusers

        return getattr(diffusers, CLASS_NAMES[family])
    except (ImportError, AttributeError) as exc:
        raise SystemExit(DIFFUSERS_MISSING.format(exc=exc)) from None


def import_wan():
    """diffusers' ``WanTransformer3DModel``, or exit with one line saying how to install it."""
    return import_model("wan")


# ---------------------------------------------------------------------------------------------
# workloads
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Workload:
    """The model to build and the inputs of one step."""

    name: str  # "wan1.3b-480p", "hunyuan1.5-720p", "tiny", ...
    model_name: str  # the plan's model string
    config: dict
    layers: int
    full_layers: int
    latent: tuple[int, ...]  # [B, C, F, H, W] (before any packing or channels-last layout)
    text: tuple[int, int, int]  # [B, tokens, dim] of the main text encoder's states
    grid_shape: tuple[int, int, int]  # tokens after the patch
    psa_tile: tuple[int, int, int]
    family: str = "wan"  # a key of FAMILIES (ModelEntry.family)
    per_token_timestep: bool = False
    # Real tokens of ``text`` (a mask or zeros pad the rest; None: all real). HunyuanVideo 1.5
    # also has byT5 states [B, tokens, dim] and their real tokens, and image states [B, tokens,
    # dim] (zeros: text-to-video, all masked out by the transformer).
    text_real: int | None = None
    text_2: tuple[int, int, int] | None = None
    text_2_real: int | None = None
    image: tuple[int, int, int] | None = None
    extra: dict = field(default_factory=dict)  # family-specific numbers (meta fields too)
    inputs_note: dict = field(default_factory=dict)

    @property
    def spec(self) -> Family:
        return FAMILIES[self.family]

    @property
    def heads(self) -> int:
        return self.spec.heads(self.config)

    @property
    def head_dim(self) -> int:
        return self.spec.head_dim(self.config)

    @property
    def tokens(self) -> int:
        """Video tokens."""
        return math.prod(self.grid_shape)

    @property
    def joint_text(self) -> int:
        """Tokens after the video tokens in the self-attention (HunyuanVideo's text tokens,
        HunyuanVideo 1.5's image, byT5 and text tokens, padding included; 0 where the text
        enters by cross-attention)."""
        return self.spec.joint_text(self)

    @property
    def joint_text_real(self) -> int:
        """Of :attr:`joint_text`, the real (unmasked) ones."""
        return self.spec.joint_text_real(self)

    @property
    def self_attn_len(self) -> int:
        """q and k length of the self-attention calls."""
        return self.tokens + self.joint_text

    @property
    def cross_keys(self) -> int | None:
        """k length of the text cross-attention calls (None: the model has none)."""
        return self.spec.cross_keys(self)

    @property
    def attention_layers(self) -> int:
        """Video self-attention modules the forward runs (the calls per step the integration
        makes sparse): the blocks, plus Wan VACE's VACE blocks."""
        return self.spec.attention_layers(self)

    @property
    def timestep(self) -> float:
        return self.spec.timestep


def make_workload(args) -> Workload:
    """``args``: ``model`` (default wan1.3b), ``tiny``, ``layers`` (an int, "all" or None),
    ``resolution``, ``frames``, ``psa_tile`` (None or missing: the model's defaults)."""
    model = getattr(args, "model", None) or "wan1.3b"
    if model not in MODELS:
        raise SystemExit(f"--model must be one of {sorted(MODELS)}, got {model!r}")
    entry = MODELS[model]
    spec = FAMILIES[entry.family]
    if args.tiny:
        config, latent = spec.tiny_config(entry), spec.tiny_latent(entry)
        if entry.family == "wan" and not entry.per_token_timestep:
            names = dict(name="tiny", model_name="tiny-wan")  # Wan 2.1 1.3B and 14B share it
        else:
            names = dict(name=f"tiny-{model}", model_name=f"tiny-{model}")
        psa_tile, default_layers = TINY_PSA_TILE, spec.num_layers(config)
    else:
        resolution = getattr(args, "resolution", None) or entry.default_resolution
        if resolution not in entry.latent_hw:
            raise SystemExit(
                f"--resolution {resolution} is not set up for {model}; choose from "
                f"{sorted(entry.latent_hw)}"
            )
        h, w = entry.latent_hw[resolution]
        frames = getattr(args, "frames", None) or entry.default_frames
        latent = (1, entry.latent_channels, spec.latent_frames(frames), h, w)
        config = dict(entry.config)
        names = dict(name=f"{model}-{resolution}", model_name=entry.model_name)
        psa_tile = getattr(args, "psa_tile", None) or entry.psa_tile
        default_layers = entry.default_layers
    full = spec.num_layers(config)
    layers = full if args.layers == "all" else (args.layers or default_layers)
    if not 1 <= layers <= full:
        raise SystemExit(f"--layers must lie in [1, {full}] for this model, got {layers}")
    spec.set_layers(config, layers)
    grid_shape = tuple(n // p for n, p in zip(latent[2:], spec.patch(config)))
    work = Workload(
        layers=layers,
        full_layers=full,
        config=config,
        latent=latent,
        grid_shape=grid_shape,
        psa_tile=parse_tile(psa_tile) if psa_tile else least_padding_tile(grid_shape),
        family=entry.family,
        per_token_timestep=entry.per_token_timestep,
        **names,
        **spec.conditioning(config, latent, args.tiny),
    )
    return Workload(**{**work.__dict__, "inputs_note": spec.note(work)})


def parse_tile(text) -> tuple[int, int, int]:
    if isinstance(text, tuple):
        return text
    parts = tuple(int(x) for x in text.lower().split("x"))
    if len(parts) != 3 or min(parts) < 1:
        raise SystemExit(f"a tile is TxHxW, e.g. 2x8x8; got {text!r}")
    return parts


def build_model(work: Workload, device: torch.device, dtype: torch.dtype, seed: int):
    """Random-weight transformer on ``device`` in ``dtype``; modules diffusers keeps in fp32 when
    it loads a checkpoint in bf16 (``_keep_in_fp32_modules``; Wan: RoPE tables, time embedder,
    scale/shift tables, the FP32LayerNorms) are kept in fp32 here too."""
    cls = import_model(work.family)
    torch.manual_seed(seed)
    with torch.device(device):  # initialise on the GPU: seconds, not minutes, for 14B
        model = cls(**work.config)
        work.spec.after_init(model)
    keep = set(getattr(model, "_keep_in_fp32_modules", None) or ())
    # Tensor by tensor (``model.to(dtype)`` would cast the fp32 modules too, and warn).
    for module_name, module in model.named_modules():
        for tensors in (module._parameters, module._buffers):
            for name, t in tensors.items():
                if t is None or not t.is_floating_point():
                    continue
                full = f"{module_name}.{name}" if module_name else name
                target = torch.float32 if keep.intersection(full.split(".")) else dtype
                if isinstance(t, torch.nn.Parameter):
                    t.data = t.data.to(target)
                else:
                    tensors[name] = t.to(target)
    return model.eval().requires_grad_(False)


def make_inputs(work: Workload, device: torch.device, dtype: torch.dtype, seed: int) -> dict:
    """The keyword arguments of one forward: what the model's diffusers pipeline hands the
    transformer for one text-to-video step of one CFG branch (``meta.inputs`` says what)."""
    g = torch.Generator().manual_seed(seed + 1)
    return work.spec.inputs(work, device, dtype, g)


# ---------------------------------------------------------------------------------------------
# PSA plans
# ---------------------------------------------------------------------------------------------


def synthetic_plan(work: Workload, target: float, rng: random.Random, tolerance: float):
    """A one-step PSA plan with a spec near ``target`` for every (layer, head).

    Returns ``(plan, achieved sparsity, pattern histogram)``. The candidates are the default
    family's distinct masks on the block grid (dense excluded) within ``tolerance`` of the
    target, plus the nearest one on each side of the target where that side has none within
    it (on Wan 480p in 1x16x8 blocks the family has nothing between 0.499 and 0.663, so a
    target of 0.6 mixes the two), drawn uniformly at random; a draw that would move the
    running mean more than ``PSA_SLACK`` off the target is redrawn from the side that brings
    it back, so the model-wide mean lands on the target while the heads still mix patterns.
    """
    from vidsparse.layout.grid import VideoGrid
    from vidsparse.search.candidates import CandidateFamily
    from vidsparse.search.plan import HeadChoice, Plan, PlanBucket

    grid = VideoGrid(work.grid_shape, work.psa_tile)
    cands = CandidateFamily().on_grid(grid.tiles)
    sparsity = cands.sparsity.tolist()
    sparse = [i for i in range(len(cands)) if sparsity[i] > 0.0]
    pool = [i for i in sparse if abs(sparsity[i] - target) <= tolerance]
    for side in (
        [i for i in sparse if sparsity[i] <= target],
        [i for i in sparse if sparsity[i] >= target],
    ):
        if side and not set(side) & set(pool):
            pool.append(min(side, key=lambda i: abs(sparsity[i] - target)))
    below = [i for i in pool if sparsity[i] <= target]
    above = [i for i in pool if sparsity[i] >= target]
    total, drawn = 0.0, 0
    patterns: Counter[str] = Counter()
    layers = {}
    for layer in range(work.attention_layers):  # Wan VACE: its VACE blocks too
        heads = []
        for _ in range(work.heads):
            i = rng.choice(pool)
            mean = (total + sparsity[i]) / (drawn + 1)
            if abs(mean - target) > PSA_SLACK:
                i = rng.choice((below if mean > target else above) or pool)
            total, drawn = total + sparsity[i], drawn + 1
            patterns[str(cands[i])] += 1
            # No search ran: the objective fields are unknown (NaN), not zero.
            heads.append(
                HeadChoice(cands[i].spec, cands[i].spatial_unit, sparsity[i], math.nan, math.nan)
            )
        layers[layer] = tuple(heads)
    plan = Plan(
        model=work.model_name,
        grid=grid,
        num_heads=work.heads,
        num_steps=1,
        dense_steps=0,
        buckets=(PlanBucket(0, 1, layers),),
        selection={"mode": "target", "alpha": None, "target_sparsity": target, "metric": "rel_l2"},
        search={"num_candidates": len(cands), "query_fraction": 1.0, "num_samples": 0},
    )
    return plan, total / drawn, dict(patterns.most_common())


def plan_file_method(path: str, work: Workload) -> tuple[Any, int, float, dict]:
    """A searched plan file: ``(plan, step, sparsity at that step, patterns)``; it runs at its
    first sparse step (``dense_steps``)."""
    from vidsparse.search.plan import load_plan

    plan = load_plan(path)
    step = plan.dense_steps
    if step >= plan.num_steps:
        raise ValueError(f"the plan {path} runs every step dense")
    bucket = plan.bucket_for(step)
    choices = [c for heads in bucket.layers.values() for c in heads]
    patterns = Counter(str(c.candidate) for c in choices)
    sparsity = sum(c.sparsity for c in choices) / len(choices)
    return plan, step, sparsity, dict(patterns.most_common())


# ---------------------------------------------------------------------------------------------
# torch.compile
# ---------------------------------------------------------------------------------------------

COMPILE_MODES = ("none", "blocks")


def compile_blocks(model, work: Workload | None = None, training: bool = False) -> None:
    """``torch.compile(fullgraph=True)`` of every transformer block, in place (diffusers'
    regional compilation: blocks share one compiled graph while their code sees the same
    Python constants). A graph break anywhere in a block is an error. Every method recompiles
    the blocks once (its hooks are new objects); torch's recompile limit stays as users
    have it, so a method that needed one graph per layer would show it (Dynamo warns and runs
    the excess layers eagerly). A class that declares no ``_repeated_blocks`` (Cosmos) gets
    its family's block class on the instance. ``training``: through ``compile_for_training``
    (its inductor options keep every parameter's gradient)."""
    names = work.spec.repeated_blocks if work is not None else ()
    if names and not getattr(model, "_repeated_blocks", None):
        model._repeated_blocks = list(names)
    if training:
        from vidsparse.integrations.diffusers import compile_for_training

        compile_for_training(model)
    else:
        model.compile_repeated_blocks(fullgraph=True)
