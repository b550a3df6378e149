"""Diagnose ``train_vsa --compile blocks`` on a GPU: eager and compiled runs of the dense arm
from the same init, their training losses step by step; then, from the compiled run's trained
weights, every parameter's gradient on one batch by eager, compiled and compiled without
gradient checkpointing, against eager's."""

from __future__ import annotations

import os
import sys
import tempfile

import torch
from diffusers import ModelMixin

from vidsparse.bench.ops import train_vsa as tv
from vidsparse.integrations.diffusers import compile as tv_compile
from vidsparse.testing import grad_errors

# CHECK_BACKEND=aot_eager: AOTAutograd's graphs run eagerly (is it inductor?);
# CHECK_NO_SPLIT=1: inductor without split reductions; CHECK_MIX_ORDER=1: inductor's
# mix-order reduction left on (as torch has it; the library's training compile turns it off).
BACKEND = os.environ.get("CHECK_BACKEND")
if BACKEND:
    _compile = ModelMixin.compile_repeated_blocks
    ModelMixin.compile_repeated_blocks = lambda self, *a, **kw: _compile(
        self, *a, backend=BACKEND, **kw
    )
if os.environ.get("CHECK_NO_SPLIT"):
    torch._inductor.config.split_reductions = False
if os.environ.get("CHECK_MIX_ORDER"):  # the library turns it off for training: turn it back on
    tv_compile.training_compile_options = lambda: {}
print(f"backend {BACKEND or 'inductor'}, split reductions "
      f"{torch._inductor.config.split_reductions}, training options "
      f"{tv_compile.training_compile_options()}", flush=True)  # fmt: skip

STEPS = int(sys.argv[1]) if len(sys.argv) > 1 else 40
dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TINY = [] if dev.type == "cuda" else ["--tiny"]  # a CPU smoke run of the script


def make_run(*extra):
    out = tempfile.mkdtemp()
    args = tv.parse_args(["--arm", "dense", "--out", out, "--steps", str(STEPS), "--no-plot", *TINY,
                          *extra])  # fmt: skip
    return tv.prepare(args, dev)


def grads(run, index):
    x0, noise, t = (x.to(dev) for x in tv.make_inputs(run.frames, run.args, index))
    run.model.zero_grad(set_to_none=True)
    with tv.autocast(dev):
        loss = tv.flow_matching_loss(run.model, x0, tv.text_embeds(run.args, 1, dev), t, noise)
    loss.backward()
    out = {n: p.grad.detach().float().clone() for n, p in run.model.named_parameters()
           if p.grad is not None}  # fmt: skip
    run.model.zero_grad(set_to_none=True)
    return loss.item(), out


runs = {"eager": make_run(), "compiled": make_run("--compile", "blocks")}
losses = {}
for name, run in runs.items():
    losses[name] = [tv.train_step(run, s)[0] for s in range(STEPS)]
for s in range(STEPS):
    print(f"step {s:3d}: eager {losses['eager'][s]:.5f}  compiled {losses['compiled'][s]:.5f}")

state = runs["compiled"].model.state_dict()
variants = {**runs, "compiled_nockpt": make_run("--compile", "blocks",
                                                "--no-gradient-checkpointing")}  # fmt: skip
results = {}
for name, run in variants.items():
    run.model.load_state_dict(state)
    results[name] = grads(run, 10_000)
ref_loss, ref = results["eager"]
for name, (loss, g) in results.items():
    print(f"{name}: loss {loss:.6f} (eager {ref_loss:.6f}); params {len(g)} (eager {len(ref)})")
    errors = grad_errors(g, ref)
    worst = sorted(((e, n) for n, e in errors.items()), reverse=True)
    print("  missing:", [n for n in ref if n not in g][:10])
    for r, n in worst[:12]:
        print(f"  {r:.3e}  {n}  |g| {ref[n].norm().item():.3e}")
