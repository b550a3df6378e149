"""Sparse attention in diffusers' ``HunyuanVideo15Pipeline``: the lines a user adds are marked
``# vidsparse:``.

    python examples/hunyuanvideo15_pipeline.py --tiny            # CPU, tiny random weights
    python examples/hunyuanvideo15_pipeline.py --method vsa --sparsity 0.875   # 480p on a GPU
    python examples/hunyuanvideo15_pipeline.py --calibrate calib/  # q/k/v for the PSA search
    python examples/hunyuanvideo15_pipeline.py --method psa --plan plan.json
    python examples/hunyuanvideo15_pipeline.py --method dense    # vidsparse's routing, stock
    python examples/hunyuanvideo15_pipeline.py \\
        --model hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-720p_t2v --height 720 --width 1280

HunyuanVideo 1.5 runs joint attention: each block's self-attention holds the video tokens
followed by the text tokens (Qwen2.5-VL, ByT5 glyphs and, for image-to-video, SigLIP image
tokens), padded per sample. vidsparse sparsifies the video queries' attention to video keys and
attends the real text tokens densely (``text_tokens=``; padded ones are dropped per sample), so
the routing is the same one call as for Wan: ``apply_sparse_attention(pipe, ...)``. The pipeline
has no step callback; the denoising step a PSA plan is indexed by comes from its scheduler.

- VSA selects key tiles from the data; on a stock checkpoint there are no trained gates and the
  output is VSA's fine stage alone (``load_sparse_attention`` loads a fine-tune's gates).
- PSA follows a plan searched offline for this resolution, frame count and step count:
  ``--calibrate DIR`` records the video q/k/v of a dense run at two steps (480p: about 0.6 GB
  per layer and forward) and prints the ``vidsparse search`` command. A plan for another latent
  grid or step count is refused; ``--steps`` defaults to the plan's. Without ``--plan`` every
  head gets one fixed stripe pattern (``FALLBACK_SPEC``, 75% sparse): a smoke test, not a
  quality setting.
- Sequence parallelism (``ulysses=``) does not take text tokens yet: one GPU.

``--tiny`` builds the pipeline from small configs with random weights and no downloads: a
2-layer ``HunyuanVideo15Transformer3DModel``, a tiny ``AutoencoderKLHunyuanVideo15`` (frames are
decoded; the pipeline needs one, it reads the latent channels from it), the Euler flow-matching
scheduler and classifier-free guidance. The pipeline takes ``None`` for its two text encoders
and tokenizers when the prompt embeddings and their masks are passed (random ones here, with
padding). It runs 4 steps on the CPU in seconds and writes a GIF (PIL only). Otherwise it
needs a GPU, ``pip install "vidsparse[diffusers]" imageio imageio-ffmpeg`` (for the mp4) and the
weights, which ``from_pretrained`` downloads. Timings are of the eager pipeline and include text
encoding and VAE decoding; the first run also compiles vidsparse's Triton kernels (``--runs 2``
shows the steady state).
"""

from __future__ import annotations

import argparse
import logging
import time

import torch

from vidsparse import StripeSpec
from vidsparse.integrations.diffusers import (
    apply_sparse_attention,
    capture_calibration,
    remove_sparse_attention,
)
from vidsparse.search import dense_step_count, load_plan

log = logging.getLogger("hunyuanvideo15_pipeline")
# PSA without a plan: all frames, every 4th spatial block of the block grid (75% sparse).
FALLBACK_SPEC = StripeSpec(t_width=1, t_offset=0, t_stride=1, s_width=1, s_offset=0, s_stride=4)
P480 = dict(height=480, width=848, num_frames=121, steps=50, fps=24)  # 31 x 30 x 53 tokens
TINY = dict(height=128, width=160, num_frames=9, steps=4, fps=8)  # 3 x 8 x 10 tokens
TEXT, GLYPHS = 24, 20  # the tiny model's text embedding widths (Qwen2.5-VL's and ByT5's)
TINY_TRANSFORMER = {  # 9 input channels: 4 latent, 4 condition latent, 1 condition mask
    "in_channels": 9, "out_channels": 4, "num_attention_heads": 2, "attention_head_dim": 16,
    "num_layers": 2, "num_refiner_layers": 1, "mlp_ratio": 2.0, "patch_size": 1,
    "patch_size_t": 1, "text_embed_dim": TEXT, "text_embed_2_dim": GLYPHS,
    "image_embed_dim": 16, "rope_axes_dim": (4, 6, 6), "task_type": "t2v",
}  # fmt: skip


def main() -> None:
    args = parse_args()
    logging.basicConfig(format="%(message)s")
    for name in ("vidsparse", log.name):  # vidsparse logs what it patches
        logging.getLogger(name).setLevel(logging.INFO)
    start = time.perf_counter()
    pipe, prompt = tiny_pipeline() if args.tiny else load_pipeline(args)
    model = "tiny random-weight pipeline" if args.tiny else args.model
    print(f"pipeline: {model} (transformer) in {time.perf_counter() - start:.1f} s")
    if args.calibrate:  # a dense run that records q/k/v, then the search command
        calibrate(pipe, prompt, args)
        return

    patch(pipe, args)
    log.info("patched transformer: %s", args.method)
    frames = generate(pipe, prompt, args)
    save_video(frames, args.output, args.fps)
    print(f"video: {len(frames)} frames of {args.width}x{args.height} -> {args.output}")
    remove_sparse_attention(pipe)  # vidsparse: back to the stock pipeline, exactly


def patch(pipe, args) -> None:
    """The vidsparse lines."""
    if args.method == "vsa":
        apply_sparse_attention(pipe, "vsa", sparsity=args.sparsity)  # vidsparse
    elif args.method == "psa" and args.plan:
        apply_sparse_attention(pipe, "psa", plan=args.plan)  # vidsparse: a searched plan
    elif args.method == "psa":
        log.warning("no --plan: one fixed stripe pattern for every head, %s", FALLBACK_SPEC)
        heads = pipe.transformer.config.num_attention_heads
        apply_sparse_attention(pipe, "psa", specs=[FALLBACK_SPEC] * heads)
    else:
        apply_sparse_attention(pipe, "dense")  # vidsparse: the routing, stock attention


def calibrate(pipe, prompt: dict, args) -> None:
    """Record the video q/k/v of a dense run for the PSA search: the first step after those a
    plan keeps dense (the search's default: the first fifth) and one halfway from there."""
    dense = dense_step_count(args.steps, 0.2)
    steps = sorted({dense, (dense + args.steps) // 2} - {args.steps})
    with capture_calibration(pipe, args.calibrate, steps=steps):  # vidsparse: dense, recording
        pipe(**prompt, **call_kwargs(args))
    tile = "1 4 4" if args.tiny else "2 8 8"  # the files record the latent grid and step count
    print(f"calibration: steps {steps} -> {args.calibrate}; a plan with:")
    print(f"  vidsparse search {args.calibrate} --tile {tile} --alpha 0.05 --out plan.json")


def generate(pipe, prompt: dict, args):
    """Run the pipeline ``--runs`` times and print each run's time; the last video's frames."""
    for run in range(1, args.runs + 1):
        sync()
        start = time.perf_counter()
        frames = pipe(**prompt, **call_kwargs(args)).frames[0]
        sync()
        seconds = time.perf_counter() - start
        print(
            f"run {run}: {args.method}, {args.steps} steps in {seconds:.2f} s "
            f"({seconds / args.steps * 1e3:.0f} ms/step, eager)"
        )
    return frames


def call_kwargs(args) -> dict:
    # Guidance is the pipeline's guider (the checkpoint's classifier-free guidance scale).
    return dict(
        height=args.height,
        width=args.width,
        num_frames=args.num_frames,
        num_inference_steps=args.steps,
        generator=torch.Generator().manual_seed(args.seed),
    )


def load_pipeline(args):
    from diffusers import HunyuanVideo15Pipeline

    pipe = HunyuanVideo15Pipeline.from_pretrained(args.model, torch_dtype=torch.bfloat16)
    pipe.vae.enable_tiling()  # decoding 121 frames at 480p in one go takes a lot of memory
    pipe.to("cuda")
    return pipe, dict(prompt=args.prompt)


def tiny_pipeline():
    """The pipeline from small configs, random weights, on the CPU, without text encoders."""
    from diffusers import (
        AutoencoderKLHunyuanVideo15,
        FlowMatchEulerDiscreteScheduler,
        HunyuanVideo15Pipeline,
        HunyuanVideo15Transformer3DModel,
    )
    from diffusers.guiders import ClassifierFreeGuidance

    torch.manual_seed(0)
    vae = AutoencoderKLHunyuanVideo15(
        latent_channels=4, block_out_channels=(8, 8, 8, 8, 8), layers_per_block=1
    )  # 16x spatial, 4x temporal compression, as the real one
    pipe = HunyuanVideo15Pipeline(
        text_encoder=None,
        tokenizer=None,
        transformer=HunyuanVideo15Transformer3DModel(**TINY_TRANSFORMER).eval(),
        vae=vae.eval(),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=5.0),
        text_encoder_2=None,
        tokenizer_2=None,
        guider=ClassifierFreeGuidance(guidance_scale=6.0),
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe, random_prompt_embeds()


def random_prompt_embeds(seed: int = 1) -> dict:
    """What the two text encoders would give, for the prompt and the negative prompt: the
    embeddings and their masks, the last few tokens padding."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for prefix in ("", "negative_"):
        for suffix, tokens, width in (("", 16, TEXT), ("_2", 8, GLYPHS)):
            mask = torch.ones(1, tokens)
            mask[:, -3:] = 0
            out[f"{prefix}prompt_embeds{suffix}"] = torch.randn(1, tokens, width, generator=g)
            out[f"{prefix}prompt_embeds_mask{suffix}"] = mask
    return out


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
    parser.add_argument(
        "--model", default="hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-480p_t2v"
    )
    parser.add_argument("--tiny", action="store_true", help="tiny random-weight pipeline, CPU")
    parser.add_argument("--method", choices=("dense", "vsa", "psa"), default="vsa")
    parser.add_argument("--sparsity", type=float, default=0.875, help="VSA: key tiles skipped")
    parser.add_argument("--plan", help="PSA: plan file from `vidsparse search`")
    parser.add_argument("--calibrate", metavar="DIR", help="record q/k/v for the PSA search")
    parser.add_argument("--prompt", default="A cat walks on the grass, realistic")
    for name in ("height", "width", "num-frames", "steps", "fps"):
        parser.add_argument(f"--{name}", type=int, help="default: 480p, 121 frames (--tiny: tiny)")
    parser.add_argument("--runs", type=int, default=1, help="generations to time (default 1)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", help="default hunyuanvideo15_<method>.mp4 (--tiny: a .gif)")
    args = parser.parse_args()
    if args.steps is None and args.method == "psa" and args.plan:
        args.steps = load_plan(args.plan).num_steps  # the plan's step buckets must line up
    for key, value in (TINY if args.tiny else P480).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    name = f"hunyuanvideo15{'_tiny' if args.tiny else ''}_{args.method}"
    args.output = args.output or f"{name}.{'gif' if args.tiny else 'mp4'}"
    return args


if __name__ == "__main__":
    main()
