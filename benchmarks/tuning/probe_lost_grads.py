"""Lost VSA gate gradients under regional compilation after another patched model ran in the
process: run the host-reads test's training step first (--prefix), then the compiled-training
test's two arms, printing which parameters got no gradient (TORCH_LOGS for the compiled arm
with --logs)."""

import argparse
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prefix", action="store_true")
    ap.add_argument("--reset", action="store_true")
    ap.add_argument("--logs", action="store_true")
    ap.add_argument("--collect", action="store_true", help="gc.collect() after the prefix")
    a = ap.parse_args()
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    if not cuda:
        os.environ.setdefault("VIDSPARSE_BACKEND", "triton")
        os.environ.setdefault("TRITON_INTERPRET", "1")
    t0 = time.time()
    if a.prefix:
        from helpers import load_script

        script = load_script(ROOT / "benchmarks" / "profile" / "find_host_reads.py")
        args = argparse.Namespace(device=device, compile="none", warmup=1, size=["--tiny"])
        script.step_reads("vsa0.875", args)
        print("prefix done", round(time.time() - t0, 1), flush=True)
    if a.collect:
        import gc

        print("collected", gc.collect(), flush=True)
    if a.reset:
        torch._dynamo.reset()
    _print_state("before the test")
    from diffusers import WanTransformer3DModel

    from vidsparse.integrations.diffusers import (
        apply_sparse_attention,
        compile_for_training,
        remove_sparse_attention,
    )

    big = dict(num_attention_heads=6, attention_head_dim=128, text_dim=64, freq_dim=256,
               ffn_dim=3072, rope_max_seq_len=1024)  # fmt: skip
    small = dict(num_attention_heads=2, attention_head_dim=32, text_dim=16, freq_dim=32,
                 ffn_dim=64, rope_max_seq_len=64)  # fmt: skip
    config = dict(patch_size=(1, 2, 2), in_channels=3, out_channels=3, num_layers=2,
                  **(big if cuda else small))  # fmt: skip
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 3, *((16, 64, 128) if cuda else (8, 16, 16)), generator=g).to(device)
    text = torch.randn(1, 8, config["text_dim"], generator=g).to(device)
    target = torch.randn(x.shape, generator=g).to(device)
    for compiled in (False, True):
        if compiled and a.logs:
            torch._logging.set_logs(recompiles=True, guards=True, graph_breaks=True,
                                    aot_graphs=True, graph_code=True)  # fmt: skip
        torch.manual_seed(0)
        model = WanTransformer3DModel(**config).to(device).train()
        model.enable_gradient_checkpointing()
        with torch.no_grad():
            for block in model.blocks:
                block.scale_shift_table.normal_(generator=torch.Generator(device).manual_seed(1))
        apply_sparse_attention(model, "vsa", sparsity=0.5, gate=True)
        if compiled:
            compile_for_training(model)
        for step in range(2):
            model.zero_grad(set_to_none=True)
            with torch.autocast(device, torch.bfloat16, enabled=cuda):
                t = torch.tensor([500.0 + step], device=device)
                out = model(x, t, text, return_dict=False)[0]
            torch.nn.functional.mse_loss(out.float(), target).backward()
        for i, block in enumerate(model.blocks):
            gate = getattr(block.attn1, "_vidsparse_gate", None)
            print(f"  block {i}: attn1._vidsparse_gate is to_gate_compress:",
                  gate is getattr(block, "to_gate_compress", None), flush=True)  # fmt: skip
        _print_state(f"after the {'compiled' if compiled else 'eager'} arm")
        missing = [n for n, p in model.named_parameters() if p.grad is None]
        arm = "compiled" if compiled else "eager"
        print(arm, "missing:", missing, round(time.time() - t0, 1), flush=True)
        remove_sparse_attention(model)


def _print_state(when: str) -> None:
    from vidsparse.integrations.diffusers import dispatch

    shims = {name: len(entry[1]) for name, entry in dispatch._SHIMS.items()}
    counters = {k: dict(v) for k, v in torch._dynamo.utils.counters.items() if v}
    print(
        f"[{when}] shims (patched models alive): {shims}; routes {len(dispatch.ROUTES)}; "
        f"dynamo counters {counters}",
        flush=True,
    )


if __name__ == "__main__":
    main()
