"""The benchmark ops and their providers: what ``vidsparse bench`` can run.

An op is one benchmark (the block-sparse engine, VSA, PSA, sliding-tile attention, a whole
model step, ...). Its entry declares the default shapes (names in ``shapes.py``), the input
builder, and the providers: the ways of computing the same thing that the op times side by
side (ours, cuDNN, flash, FlexAttention, FastVideo, ...), each with the libraries it needs.
The measuring code lives in ``vidsparse.bench.ops.<module>`` (the tuner's comparison, ``tuned``,
beside the tuner in ``vidsparse.bench``), imported only when the op runs;
it defines ``main(argv) -> rows``, ``build_parser()``, ``PROVIDERS`` (the same names as here)
and the input builder named by ``inputs``.

A provider whose needs are not met here is skipped with a one-line note saying what is
missing (``runnable_providers``; a mode it cannot run here, such as FlexAttention's backward on
the CPU, likewise: ``mode_unavailable``), never an error row or a traceback. On a CPU that
leaves no cuDNN or flash rows: those are GPU backends of SDPA. Importing this module does not
import torch.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where a requirement is checked: listing ops is cheap
    import torch


@dataclass(frozen=True)
class ProviderSpec:
    """One way of computing an op. ``needs``: keys of ``REQUIREMENTS``; ``reference``: the
    op's ratios (speedups) are taken against this provider, measured in the same run."""

    name: str
    description: str
    needs: tuple[str, ...] = ()
    default: bool = True
    reference: bool = False


@dataclass(frozen=True)
class OpSpec:
    """One benchmark op (see the module docstring)."""

    name: str
    description: str
    module: str
    shapes: tuple[str, ...]
    providers: tuple[ProviderSpec, ...]
    inputs: str
    tiny_args: tuple[str, ...] | None = ("--tiny",)  # None: the op has no CPU smoke run
    launcher: str = "python"  # "torchrun": one process per GPU
    results: str = ""  # default JSON under benchmarks/results/
    aliases: tuple[str, ...] = ()
    in_all: bool = False  # part of `vidsparse bench all`

    def load(self) -> ModuleType:
        return importlib.import_module(self.module)

    def input_builder(self) -> Callable:
        return getattr(self.load(), self.inputs)

    def provider(self, name: str) -> ProviderSpec:
        for p in self.providers:
            if p.name == name:
                return p
        raise KeyError(f"{self.name} has no provider {name!r}; it has {self.provider_names}")

    @property
    def provider_names(self) -> list[str]:
        return [p.name for p in self.providers]

    @property
    def default_providers(self) -> list[str]:
        return [p.name for p in self.providers if p.default]


# ---------------------------------------------------------------------------------------------
# requirements: each returns None when met, else why not (one line)
# ---------------------------------------------------------------------------------------------


def _needs_cuda(device: torch.device) -> str | None:
    if device.type != "cuda":
        return "needs a CUDA GPU"
    return None


def _needs_flex(device: torch.device) -> str | None:
    from vidsparse.bench.flex import flex_unavailable

    return flex_unavailable()


def _needs_cudnn(device: torch.device) -> str | None:
    import torch

    if device.type != "cuda":
        return "cuDNN is a GPU backend of SDPA (skipped on the CPU)"
    if not torch.backends.cudnn.is_available():
        return "cuDNN is not available to this torch build"
    return None


def _needs_flash(device: torch.device) -> str | None:
    if device.type != "cuda":
        return "flash is a GPU backend of SDPA (skipped on the CPU)"
    return None


def _needs_fastvideo(device: torch.device) -> str | None:
    from vidsparse.bench.fastvideo import fastvideo_unavailable

    return fastvideo_unavailable()


def _needs_diffusers(device: torch.device) -> str | None:
    if importlib.util.find_spec("diffusers") is None:
        return "diffusers is not installed (the e2e benchmarks build its video transformers)"
    return None


def _needs_sta(device: torch.device) -> str | None:
    try:
        import vidsparse

        vidsparse.sliding_tile_attn  # noqa: B018 - resolving the lazy export is the check
    except (ImportError, AttributeError) as exc:
        return f"vidsparse.sliding_tile_attn is not available in this vidsparse ({exc})"
    return None


def _needs_sta_masks(device: torch.device) -> str | None:
    try:
        from vidsparse.masks.sliding_tile import sliding_tile_block_mask  # noqa: F401
    except ImportError as exc:
        return f"vidsparse.masks.sliding_tile is not available in this vidsparse ({exc})"
    return None


REQUIREMENTS: dict[str, Callable[[torch.device], str | None]] = {
    "cuda": _needs_cuda,
    "flex": _needs_flex,
    "cudnn": _needs_cudnn,
    "flash": _needs_flash,
    "fastvideo": _needs_fastvideo,
    "diffusers": _needs_diffusers,
    "sta": _needs_sta,
    "sta-masks": _needs_sta_masks,
}


def unavailable(op: str, provider: str, device: torch.device) -> str | None:
    """``None`` if ``provider`` of ``op`` can run on ``device``, else a one-line reason."""
    spec = get(op).provider(provider)
    for need in spec.needs:
        reason = REQUIREMENTS[need](device)
        if reason:
            return f"{provider}: {reason}"
    return None


def mode_unavailable(op: str, provider: str, mode: str, device: torch.device) -> str | None:
    """``None`` if ``provider`` of ``op`` can run ``mode`` on ``device``, else a one-line
    reason (FlexAttention has no backward on the CPU)."""
    spec = get(op).provider(provider)
    if "flex" in spec.needs and mode != "fwd" and device.type != "cuda":
        return f"{provider} {mode}: FlexAttention has no backward on the CPU"
    return None


def note_skipped(reason: str) -> None:
    """The one-line note of a provider (or mode) skipped because it cannot run here."""
    print(f"note: skipped {reason}", flush=True)


def runnable_providers(op: str, providers, device: torch.device) -> list[str]:
    """``providers`` less those whose needs are not met on ``device``, each dropped one with
    a one-line note (``note_skipped``)."""
    kept = []
    for name in providers:
        reason = unavailable(op, name, device)
        if reason:
            note_skipped(reason)
        else:
            kept.append(name)
    return kept


class ProviderUnavailable(RuntimeError):
    """Raised in a provider's set-up when ``unavailable`` gives a reason: the case's row
    records it as its error."""


def require(op: str, provider: str, device: torch.device) -> None:
    reason = unavailable(op, provider, device)
    if reason:
        raise ProviderUnavailable(reason)


# ---------------------------------------------------------------------------------------------
# the ops
# ---------------------------------------------------------------------------------------------

_P = ProviderSpec
_OPS = (
    OpSpec(
        "block_sparse",
        "block-sparse engine vs dense SDPA and FlexAttention on the same block lists",
        "vidsparse.bench.ops.block_sparse",
        shapes=("synthetic-32k", "wan1.3b-480p", "wan14b-720p", "hunyuan-720p"),
        providers=(
            _P("ours", "vidsparse.block_sparse_attn (public API, validation included)"),
            _P("ours-nondet", "the same with deterministic=False (the one-pass backward)"),
            _P("ours-fixed", "the default with the one pass's dQ in fixed point (override)",
               default=False),
            _P("ours-op", "the registered custom op called directly (kernels alone)",
               default=False),
            _P("cudnn", "dense SDPA pinned to cuDNN, real tokens", ("cudnn",), reference=True),
            _P("flash", "dense SDPA pinned to the flash backend, real tokens", ("flash",)),
            _P("flex", "compiled flex_attention, BlockMask of ours' lists at 128x128", ("flex",)),
            _P("flex64", "compiled flex_attention at 64x64 blocks (kernel_options 64)",
               ("flex",)),
        ),
        inputs="random_qkv",
        tiny_args=(
            "--tiny", "--densities", "0.25", "--block-sizes", "128x64", "--modes", "fwd,fwd+bwd",
        ),
        results="block_sparse_<gpu>[_<shapes>].json",
        aliases=("engine",),
        in_all=True,
    ),
    OpSpec(
        "vsa",
        "video sparse attention vs cuDNN dense and FastVideo's VSA, with the coarse/fine split",
        "vidsparse.bench.ops.vsa",
        shapes=("wan1.3b-480p", "wan14b-720p"),
        providers=(
            _P("ours", "vidsparse.video_sparse_attn(tiled=True) on pre-tiled inputs"),
            _P("ours-natural", "the same on natural order (tiling timed)"),
            _P("cudnn", "dense SDPA pinned to cuDNN, real tokens", ("cudnn",), reference=True),
            _P("fastvideo", "fastvideo_kernel's VSA, Triton path", ("fastvideo",)),
        ),
        inputs="make_inputs",
        results="vsa_<gpu>.json",
        in_all=True,
    ),
    OpSpec(
        "psa",
        "stripe attention (PSA) vs cuDNN dense, and the offline search's run time",
        "vidsparse.bench.ops.psa",
        shapes=("wan14b-720p", "hunyuan-720p", "wan1.3b-480p"),
        providers=(
            _P("ours", "vidsparse.stripe_attn with mixed per-head stripe specs"),
            _P("cudnn", "dense SDPA pinned to cuDNN", ("cudnn",), reference=True),
            _P("search", "wall time of build_loss_table for one layer"),
        ),
        inputs="make_inputs",
        results="psa_<gpu>.json",
        in_all=True,
    ),
    OpSpec(
        "sta",
        "sliding-tile attention vs FlexAttention (same block mask, 64-token tiles) and cuDNN",
        "vidsparse.bench.ops.sta",
        shapes=("wan1.3b-480p",),
        providers=(
            _P("ours", "vidsparse.sliding_tile_attn(tiled=True) on pre-tiled inputs", ("sta",)),
            _P("flex", "compiled flex_attention, the window's block mask at 64x64 blocks",
               ("flex", "sta-masks")),
            _P("cudnn", "dense SDPA pinned to cuDNN, real tokens", ("cudnn",), reference=True),
            _P("masked-sdpa", "SDPA with the window as a token mask (materialised S x S)",
               ("sta-masks",), default=False),
        ),
        inputs="make_inputs",
        tiny_args=("--tiny", "--providers", "ours,flex,cudnn,masked-sdpa", "--check"),
        results="sta_<gpu>.json",
        in_all=True,
    ),
    OpSpec(
        "e2e",
        "one denoising step of a diffusers video transformer (Wan 2.1, Wan 2.2 5B, HunyuanVideo"
        " 1.5): dense vs VSA vs PSA",
        "vidsparse.bench.ops.e2e",
        shapes=("wan1.3b-480p", "wan14b-720p", "wan2.2-5b-720p", "hunyuan1.5-720p"),
        providers=(
            _P("dense", "stock diffusers attention (SDPA, cuDNN first)", ("diffusers",),
               reference=True),
            _P("vsa", "apply_sparse_attention(model, 'vsa')", ("diffusers",)),
            _P("psa", "apply_sparse_attention(model, 'psa') with a synthetic plan",
               ("diffusers",)),
            _P("psa-plan", "a searched plan file (--psa-plan)", ("diffusers",), default=False),
        ),
        inputs="make_inputs",
        results="e2e[_<model>-<res>][_compiled]_<gpu>.json",
    ),
    OpSpec(
        "e2e_ulysses",
        "a diffusers Wan step on 1 vs P GPUs: context parallelism with vidsparse's processors",
        "vidsparse.bench.ops.e2e_ulysses",
        shapes=("wan1.3b-480p",),
        providers=(
            _P("dense", "diffusers' own Ulysses attention", ("cuda", "diffusers"),
               reference=True),
            _P("vsa", "VSA through UlyssesAttention", ("cuda", "diffusers")),
        ),
        inputs="make_inputs",
        tiny_args=None,
        launcher="torchrun",
        results="e2e_ulysses_h200.json",
    ),
    OpSpec(
        "vsa_multi",
        "VSA with a KV cache (kv_grid) vs cuDNN dense, a packed batch vs its videos alone, "
        "tiles of 64/128/256 tokens",
        "vidsparse.bench.ops.vsa_multi",
        shapes=("wan1.3b-480p",),
        providers=(
            _P("ours", "vidsparse.video_sparse_attn, natural order, with a gate"),
            _P("cudnn", "dense SDPA pinned to cuDNN, the same q, k, v", ("cudnn",),
               reference=True),
        ),
        inputs="make_inputs",
        results="vsa_multi_h200.json",
        aliases=("vsa-multi",),
    ),
    OpSpec(
        "tuned",
        "a tuning file (vidsparse tune) against the tables' defaults: the engine and VSA at "
        "the tuned shape, both in one run, alternating",
        "vidsparse.bench.tuned",  # beside the tuner it measures (bench.ops sits below it)
        shapes=("wan1.3b-480p",),
        providers=(
            _P("default", "the tables' configs (the tuning file set aside)", ("cuda",),
               reference=True),
            _P("tuned", "the tuning file loaded as a user's process does", ("cuda",)),
        ),
        inputs="make_inputs",
        tiny_args=None,  # a tuning file is made on, and for, a GPU
        results="tuned_<model>_h200.json",
    ),
    OpSpec(
        "train_vsa",
        "training a small Wan on real video pixels (32,768 tokens a sample): dense vs VSA "
        "from scratch and as a fine-tune; one arm (provider) a call, --arm",
        "vidsparse.bench.ops.train_vsa",
        shapes=("synthetic-32k",),  # its token count; the model has 6 heads of 128, 8 blocks
        providers=(
            _P("dense", "the stock model, dense attention (SDPA)", ("diffusers",),
               reference=True),
            _P("vsa0.875", "apply_sparse_attention(model, 'vsa', sparsity=0.875, gate=True), "
               "from scratch", ("diffusers",)),
            _P("vsa0.9", "the same at sparsity 0.9", ("diffusers",)),
            _P("vsa0.875-warmup", "VSA 0.875 from scratch after dense steps, SparsitySchedule "
               "0 -> 0.875", ("diffusers",)),
            _P("finetune-dense", "the dense arm's weights trained on, dense", ("diffusers",)),
            _P("finetune-vsa", "the dense arm's weights trained on with VSA, SparsitySchedule "
               "0 -> 0.875", ("diffusers",)),
        ),
        inputs="make_inputs",
        results="train_vsa/<arm>.json",
        aliases=("train-vsa",),
    ),
    OpSpec(
        "parallel",
        "one attention layer on 1 vs P GPUs (Ulysses), the exchange alone too",
        "vidsparse.bench.ops.parallel",
        shapes=("wan14b-720p",),
        providers=(
            _P("vsa", "ulysses_video_sparse_attn, natural order, with a gate"),
            _P("block_sparse", "ulysses_block_sparse_attn on the tile-ordered sequence"),
            _P("comm", "the exchange alone (q, k, v, gate in; o out)"),
        ),
        inputs="seeded",
        tiny_args=("--dry-run", "--head-chunks", "1,2"),  # 2 heads a rank on 2 CPU ranks
        launcher="torchrun",
        results="parallel_<gpu>_<P>gpu.json",
    ),
)  # fmt: skip

OPS: dict[str, OpSpec] = {op.name: op for op in _OPS}
ALIASES: dict[str, str] = {alias: op.name for op in _OPS for alias in op.aliases}


def names() -> list[str]:
    return list(OPS)


def get(name: str) -> OpSpec:
    """The op called ``name`` (or one of its aliases); ``KeyError`` lists the ops."""
    key = ALIASES.get(name, name)
    if key not in OPS:
        raise KeyError(f"unknown benchmark {name!r}; choose from {[*OPS, *ALIASES]}")
    return OPS[key]


def describe() -> str:
    """A listing of every op with its shapes and providers (``vidsparse bench --list``)."""
    lines = []
    for op in OPS.values():
        alias = f" (alias {', '.join(op.aliases)})" if op.aliases else ""
        launch = "  [torchrun]" if op.launcher == "torchrun" else ""
        lines.append(f"{op.name}{alias}: {op.description}{launch}")
        lines.append(f"    shapes: {', '.join(op.shapes)}")
        for p in op.providers:
            flags = [f"needs {', '.join(p.needs)}"] if p.needs else []
            if p.reference:
                flags.append("reference")
            if not p.default:
                flags.append("not default")
            extra = f"  ({'; '.join(flags)})" if flags else ""
            lines.append(f"    {p.name:<13} {p.description}{extra}")
    return "\n".join(lines)
