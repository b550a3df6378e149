"""Sparse attention in diffusers' Wan 2.2 ``WanPipeline``: the lines a user adds are marked
``# vidsparse:``.

    python examples/wan22_pipeline.py --tiny                  # CPU, tiny random weights, seconds
    python examples/wan22_pipeline.py --method vsa --sparsity 0.875     # T2V A14B on a GPU
    python examples/wan22_pipeline.py --calibrate calib/      # q/k/v for the PSA search, then
    python examples/wan22_pipeline.py --method psa --plan transformer_plan.json \\
        --plan-2 transformer_2_plan.json                      # one plan per expert
    python examples/wan22_pipeline.py --method dense          # vidsparse's routing, stock attention
    python examples/wan22_pipeline.py --model Wan-AI/Wan2.2-TI2V-5B-Diffusers \\
        --height 704 --width 1280 --num-frames 121 --fps 24   # TI2V-5B: one transformer
    python examples/wan22_pipeline.py --model Wan-AI/Wan2.1-T2V-1.3B-Diffusers   # Wan 2.1
    torchrun --nproc-per-node 2 examples/wan22_pipeline.py --method vsa   # 2 GPUs (Ulysses)

Wan 2.2 T2V A14B holds two experts: ``pipe.transformer`` (high noise, the first steps) and
``pipe.transformer_2`` (low noise, once the timestep falls below ``boundary_ratio``).
``apply_sparse_attention(pipe, ...)`` patches both, and the denoising step a PSA plan is indexed
by comes from the pipeline's scheduler (no step callback). An option given as a dict keyed by
transformer name is per transformer: here one plan per expert. TI2V-5B (one transformer, a 16x
VAE with 48 latent channels) and Wan 2.1's checkpoints (one transformer) take the same calls.

- VSA selects key tiles from the data. ``--gates DIR`` loads the trained gates of a VSA
  fine-tune (``blocks.<i>.to_gate_compress``: FastVideo's keys, and what ``save_pretrained`` of
  a patched transformer writes) from a pipeline folder with one subfolder per transformer; on a
  stock checkpoint there are no gates and the output is VSA's fine stage alone.
- PSA follows plans searched offline for this resolution, frame count and step count.
  ``--calibrate DIR`` records q/k/v of a dense run into ``DIR/transformer`` and
  ``DIR/transformer_2`` (two steps per expert; A14B at 480p writes about 1 GB per layer, step
  and forward) and prints the ``vidsparse search`` command for each. A plan for another latent
  grid or step count is refused; ``--steps`` defaults to the plan's. Without ``--plan`` every
  head gets one fixed stripe pattern (``FALLBACK_SPEC``, 75% sparse): a smoke test, not a
  quality setting.
- Under ``torchrun``, diffusers' context parallelism shards each transformer's sequence and
  ``ulysses=UlyssesAttention()`` runs vidsparse's attention over the whole sequence of each
  rank's heads (``docs/parallel.md``). Not run by the tests: ``enable_parallelism`` needs GPUs.

``--tiny`` builds the A14B layout from small configs (two 2-layer transformers, a tiny
``AutoencoderKLWan``, random prompt embeddings in place of the tokenizer and UMT5 encoder),
downloads nothing, runs 4 steps on the CPU in seconds and writes the decoded frames as a GIF
(PIL only). Otherwise it needs a GPU, ``pip install "vidsparse[diffusers]" imageio
imageio-ffmpeg`` (for the mp4) and the weights, which ``from_pretrained`` downloads. Timings are
of the eager pipeline (``--compile``: regional compilation, the first run compiles) and include
text encoding and VAE decoding; the first run also compiles vidsparse's Triton kernels (``--runs
2`` shows the steady state).
"""

from __future__ import annotations

import argparse
import logging
import os
import time

import torch

from vidsparse import StripeSpec
from vidsparse.integrations.diffusers import (
    apply_sparse_attention,
    capture_calibration,
    load_sparse_attention,
    remove_sparse_attention,
)
from vidsparse.search import dense_step_count, load_plan

log = logging.getLogger("wan22_pipeline")
NAMES = ("transformer", "transformer_2")  # A14B: the high- and the low-noise expert
NEGATIVE = "blurry, low quality, distorted, static, overexposed, worst quality, deformed"
# PSA without a plan: all frames, every 4th spatial block of the block grid (75% sparse).
FALLBACK_SPEC = StripeSpec(t_width=1, t_offset=0, t_stride=1, s_width=1, s_offset=0, s_stride=4)
A14B = dict(height=480, width=832, num_frames=81, steps=40, fps=16)  # 21 x 30 x 52 tokens
TINY = dict(height=128, width=160, num_frames=9, steps=4, fps=8)  # 3 x 8 x 10 tokens
TINY_TRANSFORMER = {  # two heads of 16, two layers; text_dim 24 for the random embeddings
    "patch_size": (1, 2, 2), "num_attention_heads": 2, "attention_head_dim": 16,
    "num_layers": 2, "in_channels": 4, "out_channels": 4, "text_dim": 24, "freq_dim": 32,
    "ffn_dim": 64, "rope_max_seq_len": 64,
}  # fmt: skip
TINY_VAE = dict(base_dim=8, z_dim=4, dim_mult=[1, 1, 1, 1], num_res_blocks=1)


def main() -> None:
    args = parse_args()
    logging.basicConfig(format="%(message)s")
    for name in ("vidsparse", log.name):  # vidsparse logs what it patches
        logging.getLogger(name).setLevel(logging.INFO)
    ulysses = init_ulysses() if "WORLD_SIZE" in os.environ else None
    start = time.perf_counter()
    pipe, prompt = tiny_pipeline() if args.tiny else load_pipeline(args, ulysses)
    names = [n for n in NAMES if getattr(pipe, n, None) is not None]
    model = "tiny random-weight pipeline" if args.tiny else args.model
    print(f"pipeline: {model} ({', '.join(names)}) in {time.perf_counter() - start:.1f} s")
    if args.calibrate:  # a dense run that records q/k/v, then the search commands
        calibrate(pipe, prompt, args, names)
        return

    patch(pipe, args, names, ulysses)
    log.info("patched %s: %s", " and ".join(names), args.method)
    if args.compile:  # after patching: one graph for all blocks of each transformer
        for name in names:
            getattr(pipe, name).compile_repeated_blocks(fullgraph=ulysses is None)
    frames = generate(pipe, prompt, args)
    if ulysses is None or torch.distributed.get_rank() == 0:
        save_video(frames, args.output, args.fps)
        print(f"video: {len(frames)} frames of {args.width}x{args.height} -> {args.output}")
    remove_sparse_attention(pipe)  # vidsparse: back to the stock pipeline, exactly


def patch(pipe, args, names: list[str], ulysses) -> None:
    """The vidsparse lines: every transformer of ``pipe`` at once."""
    extra = {} if ulysses is None else {"ulysses": ulysses}  # vidsparse: heads exchanged
    if args.method == "vsa" and args.gates:  # vidsparse: VSA with a fine-tune's trained gates
        load_sparse_attention(pipe, args.gates, sparsity=args.sparsity, **extra)
    elif args.method == "vsa":
        apply_sparse_attention(pipe, "vsa", sparsity=args.sparsity, **extra)  # vidsparse
    elif args.method == "psa" and args.plan:  # vidsparse: one plan per transformer
        plans = {"transformer": args.plan, "transformer_2": args.plan_2 or args.plan}
        apply_sparse_attention(pipe, "psa", plan={n: plans[n] for n in names}, **extra)
    elif args.method == "psa":
        log.warning("no --plan: one fixed stripe pattern for every head, %s", FALLBACK_SPEC)
        heads = pipe.transformer.config.num_attention_heads
        apply_sparse_attention(pipe, "psa", specs=[FALLBACK_SPEC] * heads, **extra)
    else:
        apply_sparse_attention(pipe, "dense", **extra)  # vidsparse: the routing, stock attention


def calibrate(pipe, prompt: dict, args, names: list[str]) -> None:
    """Record q/k/v of a dense run for the PSA search, one subfolder per transformer."""
    steps = calibration_steps(pipe, args.steps)
    with capture_calibration(pipe, args.calibrate, steps=steps):  # vidsparse: dense, recording
        pipe(**prompt, **call_kwargs(pipe, args))
    tile = "1 4 4" if args.tiny else "2 8 8"  # the files record the latent grid and step count
    print(f"calibration: steps {steps} -> {args.calibrate}; a plan per transformer with:")
    for name in names:
        folder = os.path.join(args.calibrate, name) if len(names) > 1 else args.calibrate
        print(f"  vidsparse search {folder} --tile {tile} --alpha 0.05 --out {name}_plan.json")


def calibration_steps(pipe, num_steps: int) -> list[int]:
    """Per transformer, its first and middle step after those a plan keeps dense (the search's
    default: the first fifth). Few steps: each writes one file per layer and forward."""
    pipe.scheduler.set_timesteps(num_steps)
    timesteps = pipe.scheduler.timesteps.tolist()
    boundary = (pipe.config.boundary_ratio or 0.0) * pipe.scheduler.config.num_train_timesteps
    dense = dense_step_count(num_steps, 0.2)
    steps = []
    for high_noise in (True, False):  # the steps of transformer, then of transformer_2
        own = [i for i, t in enumerate(timesteps) if i >= dense and (t >= boundary) == high_noise]
        steps += sorted({own[0], own[len(own) // 2]}) if own else []
    return steps


def generate(pipe, prompt: dict, args):
    """Run the pipeline ``--runs`` times and print each run's time; the last video's frames."""
    mode = "compiled" if args.compile else "eager"
    for run in range(1, args.runs + 1):
        sync()
        start = time.perf_counter()
        frames = pipe(**prompt, **call_kwargs(pipe, args)).frames[0]
        sync()
        seconds = time.perf_counter() - start
        print(
            f"run {run}: {args.method}, {args.steps} steps in {seconds:.2f} s "
            f"({seconds / args.steps * 1e3:.0f} ms/step, {mode})"
        )
    return frames


def call_kwargs(pipe, args) -> dict:
    kwargs = dict(
        height=args.height,
        width=args.width,
        num_frames=args.num_frames,
        num_inference_steps=args.steps,
        guidance_scale=4.0,
        generator=torch.Generator().manual_seed(args.seed),
    )
    if pipe.config.boundary_ratio is not None:  # A14B: the low-noise expert's own guidance
        kwargs["guidance_scale_2"] = 3.0
    return kwargs


def load_pipeline(args, ulysses):
    from diffusers import AutoencoderKLWan, WanPipeline

    vae = AutoencoderKLWan.from_pretrained(args.model, subfolder="vae", torch_dtype=torch.float32)
    pipe = WanPipeline.from_pretrained(args.model, vae=vae, torch_dtype=torch.bfloat16)
    pipe.to("cuda")
    if ulysses is not None:  # diffusers shards each transformer's sequence over the GPUs
        from diffusers import ContextParallelConfig

        config = ContextParallelConfig(ulysses_degree=torch.distributed.get_world_size())
        for name in NAMES:
            if getattr(pipe, name, None) is not None:
                getattr(pipe, name).enable_parallelism(config=config)
    return pipe, dict(prompt=args.prompt, negative_prompt=NEGATIVE)


def tiny_pipeline():
    """A14B's layout from small configs, random weights, on the CPU; random prompt embeddings
    (``text_dim=24``) stand in for the tokenizer and text encoder."""
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline
    from diffusers import WanTransformer3DModel as Transformer

    torch.manual_seed(0)
    vae = AutoencoderKLWan(**TINY_VAE, latents_mean=[0.0] * 4, latents_std=[1.0] * 4)
    pipe = WanPipeline(
        tokenizer=None,
        text_encoder=None,
        vae=vae.eval(),
        transformer=Transformer(**TINY_TRANSFORMER).eval(),
        transformer_2=Transformer(**TINY_TRANSFORMER).eval(),
        scheduler=UniPCMultistepScheduler(
            prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0
        ),
        boundary_ratio=0.875,  # A14B's switch from the high- to the low-noise expert
    )
    pipe.set_progress_bar_config(disable=True)
    g = torch.Generator().manual_seed(1)
    embeds = [torch.randn(1, 16, 24, generator=g) for _ in range(2)]
    return pipe, dict(prompt_embeds=embeds[0], negative_prompt_embeds=embeds[1])


def init_ulysses():
    """Under torchrun: one GPU per rank, and vidsparse's Ulysses exchange."""
    import torch._dynamo  # noqa: F401  (before the process group: docs/parallel.md)

    from vidsparse.parallel import UlyssesAttention

    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    torch.distributed.init_process_group("nccl", device_id=device)
    return UlyssesAttention()


def save_video(frames, path: str, fps: int) -> None:
    from diffusers.utils import export_to_gif, export_to_video
    from diffusers.utils.pil_utils import numpy_to_pil

    if path.endswith(".gif"):  # PIL only
        export_to_gif(numpy_to_pil(frames), path, fps=fps)
    else:  # imageio and imageio-ffmpeg (or OpenCV)
        export_to_video(frames, path, fps=fps)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="Wan-AI/Wan2.2-T2V-A14B-Diffusers")
    parser.add_argument("--tiny", action="store_true", help="tiny random-weight pipeline, CPU")
    parser.add_argument("--method", choices=("dense", "vsa", "psa"), default="vsa")
    parser.add_argument("--sparsity", type=float, default=0.875, help="VSA: key tiles skipped")
    parser.add_argument("--gates", help="VSA: pipeline folder of a fine-tune with trained gates")
    parser.add_argument("--plan", help="PSA: plan file for transformer (and transformer_2)")
    parser.add_argument("--plan-2", help="PSA: plan file for transformer_2 (default --plan)")
    parser.add_argument("--calibrate", metavar="DIR", help="record q/k/v for the PSA search")
    parser.add_argument("--prompt", default="A cat walks on the grass, realistic")
    for name in ("height", "width", "num-frames", "steps", "fps"):
        parser.add_argument(f"--{name}", type=int, help="default: A14B at 480p (--tiny: tiny)")
    parser.add_argument("--runs", type=int, default=1, help="generations to time (default 1)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", help="default wan22_<method>.mp4 (--tiny: a .gif)")
    parser.add_argument("--compile", action="store_true", help="regional torch.compile")
    args = parser.parse_args()
    if args.plan_2 and not args.plan:
        parser.error("--plan-2 needs --plan")
    if args.steps is None and args.method == "psa" and args.plan:
        args.steps = load_plan(args.plan).num_steps  # the plan's step buckets must line up
    for key, value in (TINY if args.tiny else A14B).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    tiny = "_tiny" if args.tiny else ""
    args.output = args.output or f"wan22{tiny}_{args.method}.{'gif' if args.tiny else 'mp4'}"
    return args


if __name__ == "__main__":
    main()
