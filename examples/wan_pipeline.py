"""Sparse attention in a diffusers ``WanPipeline``: the lines a user with the weights adds.

    python examples/wan_pipeline.py --method vsa --sparsity 0.875
    python examples/wan_pipeline.py --method psa --plan wan_480p_plan.json
    python examples/wan_pipeline.py --method dense            # our processor, SDPA (reference)
    torchrun --nproc-per-node 2 examples/wan_pipeline.py --method vsa   # 2 GPUs (Ulysses)

Needs a GPU, ``pip install "vidsparse[diffusers]"`` and the Wan 2.1 weights (downloaded by
``from_pretrained``). Not run in the tests: they check the same calls on a tiny random model.

The vidsparse part is three lines (marked ``# vidsparse``): apply to the transformer, for PSA
pass the step callback, and optionally remove afterwards.

- VSA selects tiles from the data; a checkpoint fine-tuned with VSA also has trained gate
  projections (``blocks.<i>.attn1.vsa.gate_proj``): load them after ``apply_sparse_attention``.
  On a stock checkpoint the gates are zero and the output is the fine stage alone.
- PSA follows a plan searched offline for this resolution and frame count (``vidsparse search``;
  a plan for another latent grid is refused). The plan is indexed by the denoising step, which
  the callback advances; its ``num_steps`` must be the pipeline's ``num_inference_steps``.
- Under ``torchrun`` (P GPUs): diffusers' context parallelism shards the sequence and
  ``ulysses=UlyssesAttention()`` lets vidsparse's processors run over the whole sequence of each
  rank's heads (``docs/parallel.md``; measured on a random-weight model by
  ``benchmarks/bench_e2e_ulysses.py``).
"""

from __future__ import annotations

import argparse
import os

import torch


def main() -> None:
    args = parse_args()
    from diffusers import AutoencoderKLWan, WanPipeline
    from diffusers.utils import export_to_video

    from vidsparse.integrations.diffusers import (
        apply_sparse_attention,
        denoising_step_callback,
        remove_sparse_attention,
    )

    ulysses = {}
    if "WORLD_SIZE" in os.environ:  # started by torchrun: sequence parallelism over the GPUs
        from diffusers import ContextParallelConfig

        from vidsparse.parallel import UlyssesAttention

        torch.distributed.init_process_group("nccl")
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        ulysses = {"ulysses": UlyssesAttention()}  # vidsparse: our processors exchange heads

    vae = AutoencoderKLWan.from_pretrained(args.model, subfolder="vae", torch_dtype=torch.float32)
    pipe = WanPipeline.from_pretrained(args.model, vae=vae, torch_dtype=torch.bfloat16).to("cuda")
    if ulysses:  # diffusers shards the sequence; vidsparse's attention runs over all of it
        world = torch.distributed.get_world_size()
        pipe.transformer.enable_parallelism(config=ContextParallelConfig(ulysses_degree=world))

    callback = None
    if args.method == "vsa":
        apply_sparse_attention(pipe.transformer, "vsa", sparsity=args.sparsity, **ulysses)
        if args.gate_weights:  # trained gates of a VSA fine-tune
            gates = torch.load(args.gate_weights, map_location="cuda")
            pipe.transformer.load_state_dict(gates, strict=False)
    elif args.method == "psa":
        apply_sparse_attention(pipe.transformer, "psa", plan=args.plan, **ulysses)  # vidsparse
        callback = denoising_step_callback(pipe.transformer)  # vidsparse: plan step = pipe step
    else:
        apply_sparse_attention(pipe.transformer, "dense", **ulysses)  # vidsparse
    if args.compile:  # after apply_sparse_attention: one graph for all blocks (README)
        pipe.transformer.compile_repeated_blocks(fullgraph=not ulysses)

    frames = pipe(
        prompt=args.prompt,
        negative_prompt="blurry, low quality, distorted",
        height=480,
        width=832,
        num_frames=81,  # latent grid 21 x 30 x 52 tokens
        num_inference_steps=args.steps,
        guidance_scale=5.0,
        callback_on_step_end=callback,
        generator=torch.Generator("cuda").manual_seed(0),
    ).frames[0]
    if not ulysses or torch.distributed.get_rank() == 0:
        export_to_video(frames, args.output, fps=16)

    remove_sparse_attention(pipe.transformer)  # vidsparse: back to the stock model, exactly


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="Wan-AI/Wan2.1-T2V-1.3B-Diffusers")
    parser.add_argument("--method", choices=("dense", "vsa", "psa"), default="vsa")
    parser.add_argument("--sparsity", type=float, default=0.875, help="VSA: key tiles skipped")
    parser.add_argument("--gate-weights", help="VSA: a state dict with the trained gates")
    parser.add_argument("--plan", help="PSA: a plan file from `vidsparse search`")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--prompt", default="A cat walks on the grass, realistic")
    parser.add_argument("--output", default="wan_sparse.mp4")
    parser.add_argument(
        "--compile", action="store_true", help="torch.compile every transformer block"
    )
    args = parser.parse_args()
    if args.method == "psa" and not args.plan:
        parser.error("--method psa needs --plan")
    return args


if __name__ == "__main__":
    main()
