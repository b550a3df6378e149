"""Benchmark of ``vidsparse.block_sparse_attn`` against dense SDPA and FlexAttention.

Every provider in fwd, bwd and fwd+bwd, at each density and block size: ``ours`` (the public
API, validation included), ``ours-nondet`` (the same with ``deterministic=False``: its backward
in one pass where that applies), ``ours-fixed`` (the default with the one pass's dQ in fixed
point, ``configs.override(one_pass="fixed")``: a tuning arm, not by default), ``ours-op`` (the
custom op alone, not by default), ``cudnn`` /
``flash`` (dense SDPA on the real tokens, the reference rows) and ``flex`` / ``flex64``
(compiled FlexAttention with a ``BlockMask`` of the same lists at 128x128 / 64x64). Effective
TFLOP/s count attended real pairs, so sparse and dense rows compare directly. Run on a GPU
(``vidsparse bench block_sparse -- OPTIONS`` is the same)::

    python -m vidsparse.bench block_sparse                  # default shape
    python -m vidsparse.bench block_sparse --shapes all --check
    python -m vidsparse.bench block_sparse --dry-run        # CPU, tiny sizes
    python -m vidsparse.bench block_sparse --densities 0.125 --block-sizes 128x128 --rounds 5

``--rounds N`` runs the whole case list N times in turn and reports each case's median (its
ratios taken within each round, then the median of those), with every round's figure beside
it: one run of a table moves a few percent, about the distance to a bar.

``benchmarks/README.md`` ("Block-sparse attention") describes the providers, the ``BlockMask``,
padding, what is timed and the output columns.
"""

from __future__ import annotations

import argparse
import math
import os
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from vidsparse.bench import flex, harness, registry, shapes
from vidsparse.bench.harness import Column, Provider
from vidsparse.bench.sdpa import dense_sdpa
from vidsparse.layout import VideoGrid

DENSE_PROVIDERS = ("cudnn", "flash")
OURS = ("ours", "ours-nondet", "ours-fixed", "ours-op")
# ours-nondet (ours-fixed) runs only where deterministic=False (the override) changes the
# backward (the one pass: 128x128).
NONDET_BLOCKS = ((128, 128),)
ONE_PASS_ARMS = ("ours-nondet", "ours-fixed")
SPARSE_PROVIDERS = (*OURS, "flex", "flex64")
ALL_PROVIDERS = (*SPARSE_PROVIDERS, *DENSE_PROVIDERS)
PROVIDERS = ALL_PROVIDERS
DEFAULT_PROVIDERS = ("ours", "ours-nondet", "cudnn", "flash", "flex", "flex64")
# The block structure each FlexAttention provider is given (ours' lists at that block size).
FLEX_BLOCKS = {"flex": (128, 128), "flex64": (64, 64)}
# ours' rows are compared with the flex provider of the same block size.
FLEX_PARTNER = {blocks: name for name, blocks in FLEX_BLOCKS.items()}

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# Relative L2 error allowed against the fp32 reference in --check, per input dtype.
CHECK_REL_L2 = {torch.bfloat16: 2e-2, torch.float16: 5e-3, torch.float32: 1e-3}
CHECK_QUERY_BLOCKS = 4  # query blocks of head 0 compared in --check

TILE = (4, 4, 4)  # VSA's tile: the unit of the real-shape padding
# The `real` shape group: the op's registered shapes other than the synthetic one.
REAL_SHAPES = tuple(n for n in registry.get("block_sparse").shapes if n in shapes.MODELS)


# ---------------------------------------------------------------------------------------------
# shapes
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Shape:
    """One attention problem. Real video shapes carry their latent ``grid``: block-sparse
    providers then see the tile-ordered, padded sequence (``seq_len``), dense providers the
    ``real_len`` real tokens in natural order."""

    name: str
    batch: int
    heads: int
    seq_len: int
    head_dim: int
    grid: tuple[int, int, int] | None = None

    @property
    def real_len(self) -> int:
        if self.grid is None:
            return self.seq_len
        T, H, W = self.grid
        return T * H * W


def padded_len(grid: tuple[int, int, int], tile: tuple[int, int, int] = TILE) -> int:
    return VideoGrid(grid, tile=tile).padded_len


def video_shape(name: str, grid: tuple[int, int, int], heads: int, head_dim: int) -> Shape:
    return Shape(name, 1, heads, padded_len(grid), head_dim, grid)


def build_shapes(
    which: str,
    tiny: bool,
    *,
    seq_len: int | None = None,
    heads: int | None = None,
    head_dim: int | None = None,
) -> list[Shape]:
    """The shapes of ``--shapes``; ``seq_len``/``heads``/``head_dim`` override the synthetic
    (default) shape, for quick runs."""
    if tiny:
        default = [Shape("tiny", 1, 2, 512, 64)]
        tiny_video = shapes.TINY["tiny-video"]  # 300 real tokens of 768 tile-ordered slots
        real = [video_shape("tiny-video", tiny_video.grid, heads=tiny_video.heads, head_dim=64)]
    else:
        s = shapes.SYNTHETIC_32K
        default = [Shape(s.name, s.batch, s.heads, s.seq_len, s.head_dim)]
        # Video tokens only: HunyuanVideo's joint attention also appends <= 256 text tokens.
        real = [_model_shape(name) for name in REAL_SHAPES]
    if seq_len or heads or head_dim:
        d = default[0]
        S, H, D = seq_len or d.seq_len, heads or d.heads, head_dim or d.head_dim
        default = [Shape(f"synthetic-H{H}-S{S}-D{D}", d.batch, H, S, D)]
    groups = {"default": default, "real": real, "all": default + real}
    if which in groups:
        return groups[which]
    by_name = {s.name: s for s in default + real}
    names = [n.strip() for n in which.split(",") if n.strip()]
    if not tiny:  # any model of the shape registry, by name
        by_name.update({n: _model_shape(n) for n in names if n in shapes.MODELS})
    unknown = [n for n in names if n not in by_name]
    if unknown:
        choices = [*by_name, *shapes.MODELS] if not tiny else list(by_name)
        raise ValueError(f"unknown shapes {unknown}; choose from {list(groups)} or {choices}")
    return [by_name[n] for n in names]


def _model_shape(name: str) -> Shape:
    model = shapes.MODELS[name]
    return video_shape(model.name, model.grid, heads=model.heads, head_dim=model.head_dim)


def real_token_mask(shape: Shape, device: torch.device) -> torch.Tensor:
    """bool [seq_len]: which tile-order slots hold real tokens (all of them without a grid)."""
    if shape.grid is None:
        return torch.ones(shape.seq_len, dtype=torch.bool, device=device)
    return VideoGrid(shape.grid, tile=TILE).real_token_mask(device)


# ---------------------------------------------------------------------------------------------
# block lists shared by ours and flex
# ---------------------------------------------------------------------------------------------


@dataclass
class BlockLists:
    """Random block lists for one (shape, block size, density), shared by every provider and
    mode that runs on them."""

    block: tuple[int, int]
    density: float
    kv_indices: torch.Tensor  # int32 [B, H, NQ, K]
    kv_counts: torch.Tensor  # int32 [B, H, NQ]
    key_valid: torch.Tensor  # bool [S]: real (non-padding) key tokens
    kv_block_sizes: torch.Tensor | None  # int32 [NK] for ours; None: no padding masked
    has_padding: bool
    pairs: int  # attended real (query, key) pairs, summed over batch and heads
    block_density: float  # attended block pairs / all block pairs

    @property
    def padding_masked(self) -> bool:
        return not self.has_padding or self.kv_block_sizes is not None


def stable_seed(*parts) -> int:
    """A seed that depends on the case only (Python's hash() is salted per process)."""
    return zlib.crc32(repr(parts).encode()) & 0x7FFFFFFF


def prefix_block_sizes(valid: torch.Tensor, block: int) -> torch.Tensor | None:
    """int32 [NB] real tokens per block if each block's real tokens form a prefix (what
    ``kv_block_sizes`` can express), else None."""
    blocks = valid.view(-1, block)
    sizes = blocks.sum(dim=-1)
    prefix = torch.arange(block, device=valid.device) < sizes[:, None]
    if not bool((prefix == blocks).all()):
        return None
    return sizes.to(torch.int32)


def count_pairs(
    kv_indices: torch.Tensor,
    kv_counts: torch.Tensor,
    q_real: torch.Tensor,
    k_real: torch.Tensor,
) -> int:
    """Sum over (batch, head, query block i, listed key block j) of real_q(i) * real_k(j)."""
    K = kv_indices.shape[-1]
    total = 0
    for h in range(kv_indices.shape[1]):  # one head at a time: bounded temporaries
        idx = kv_indices[:, h].long()
        live = torch.arange(K, device=idx.device) < kv_counts[:, h, :, None].long()
        keys = torch.where(live, k_real.long()[idx], 0).sum(dim=-1)  # [B, NQ]
        total += int((keys * q_real.long()).sum())
    return total


def make_block_lists(
    shape: Shape, block: tuple[int, int], density: float, *, device: torch.device, seed: int
) -> BlockLists:
    from vidsparse.masks.block_sparse import random_block_lists

    block_q, block_kv = block
    S = shape.seq_len
    if S % block_q or S % block_kv:
        raise ValueError(f"{shape.name}: seq_len {S} is not a multiple of block {block}")
    nq, nk = S // block_q, S // block_kv
    gen = torch.Generator(device=device)
    gen.manual_seed(stable_seed(seed, shape.name, block, density))
    # count = max(1, round(density * NK)) blocks in every row, distinct, uniform per row/head.
    kv_indices, kv_counts = random_block_lists(
        shape.batch, shape.heads, nq, nk, density=density, generator=gen, device=device
    )
    valid = real_token_mask(shape, device)
    has_padding = not bool(valid.all())
    # Ours masks padded keys only when each key block's real tokens are a prefix: true for
    # block_kv == 64 (one tile per block), false for 128 (two tiles, padding between them).
    kv_block_sizes = prefix_block_sizes(valid, block_kv) if has_padding else None
    q_real = valid.view(nq, block_q).sum(dim=-1)
    k_real = valid.view(nk, block_kv).sum(dim=-1)
    return BlockLists(
        block=block,
        density=density,
        kv_indices=kv_indices,
        kv_counts=kv_counts,
        key_valid=valid,
        kv_block_sizes=kv_block_sizes,
        has_padding=has_padding,
        pairs=count_pairs(kv_indices, kv_counts, q_real, k_real),
        block_density=float(kv_counts.sum(dtype=torch.float64)) / (kv_counts.numel() * nk),
    )


# ---------------------------------------------------------------------------------------------
# cases and providers
# ---------------------------------------------------------------------------------------------


@dataclass
class Case:
    shape: Shape
    provider: str
    mode: str
    density: float = 1.0
    block: tuple[int, int] | None = None
    lists: BlockLists | None = field(default=None, repr=False)


@dataclass(frozen=True)
class Settings:
    device: torch.device
    dtype: torch.dtype
    seed: int
    check: bool
    flex_autotune: bool = False


def random_qkv(shape: Shape, seq_len: int, case_key: tuple, settings: Settings):
    """Fresh N(0, 1) q, k, v [B, H, seq_len, D] (never zeros), reproducible per case."""
    gen = torch.Generator(device=settings.device)
    gen.manual_seed(stable_seed(settings.seed, "qkv", *case_key))
    size = (shape.batch, shape.heads, seq_len, shape.head_dim)
    return tuple(
        torch.randn(size, generator=gen, device=settings.device, dtype=settings.dtype)
        for _ in range(3)
    )


def _case_key(case: Case) -> tuple:
    return (case.shape.name, case.provider, case.block, case.density)


def check_against_reference(name: str, out: torch.Tensor, q, k, v, lists: BlockLists) -> float:
    """Relative L2 error of the first query blocks of head 0 against vidsparse's fp32
    reference; raises if it is above the dtype's bound (a wrong kernel gets no timing)."""
    from vidsparse.ops.block_sparse_attn.reference import block_sparse_attn_ref
    from vidsparse.testing import rel_l2

    block_q, block_kv = lists.block
    rows = min(CHECK_QUERY_BLOCKS, lists.kv_counts.shape[-1])
    sq = rows * block_q
    ref, _ = block_sparse_attn_ref(
        q[:1, :1, :sq].float(),
        k[:1, :1].float(),
        v[:1, :1].float(),
        lists.kv_indices[:1, :1, :rows],
        lists.kv_counts[:1, :1, :rows],
        block_q=block_q,
        block_kv=block_kv,
        kv_block_sizes=lists.kv_block_sizes,
    )
    err = rel_l2(out[:1, :1, :sq].float(), ref)
    bound = CHECK_REL_L2[q.dtype]
    if not err <= bound:
        raise AssertionError(f"{name} check failed: rel L2 {err:.3e} > {bound:.0e} vs reference")
    return err


def _ours_forward(lists: BlockLists, deterministic: bool = True) -> Callable:
    import vidsparse

    def forward(q, k, v):
        return vidsparse.block_sparse_attn(
            q,
            k,
            v,
            lists.kv_indices,
            lists.kv_counts,
            block_size=lists.block,
            kv_block_sizes=lists.kv_block_sizes,
            deterministic=deterministic,
        )

    return forward


def _ours_op_forward(lists: BlockLists, device: torch.device, head_dim: int) -> Callable:
    # Importing the interface registers torch.ops.vidsparse.*; resolve the backend once, as
    # block_sparse_attn would on every call.
    import vidsparse.ops.block_sparse_attn.interface  # noqa: F401
    from vidsparse.ops.block_sparse_attn.epilogue import MAX_TENSORS
    from vidsparse.utils.backend import resolve_backend

    backend = resolve_backend(device)
    scale = 1.0 / math.sqrt(head_dim)
    block_q, block_kv = lists.block
    op = torch.ops.vidsparse.block_sparse_attn_fwd

    def forward(q, k, v):
        # no padding promise, no epilogue: the op's (o, lse, epilogue's saved tensor)
        o, _, _ = op(
            q, k, v, lists.kv_indices, lists.kv_counts, lists.kv_block_sizes,
            block_q, block_kv, scale, backend, False, "none", *[None] * MAX_TENSORS,
        )  # fmt: skip
        return o

    return forward


# ---- FlexAttention -----------------------------------------------------------------------


def flex_block_mask(lists: BlockLists, *, token_mask_mod: bool = False):
    """A ``BlockMask`` computing exactly what ``ours`` computes on ``lists``: the dense block
    map of the lists, with padded keys masked where ours masks them (``kv_block_sizes``: real
    shapes at 64-token key blocks). See ``flex.block_mask_from_map``."""
    from vidsparse.masks.block_sparse import dense_from_lists

    block_q, block_kv = lists.block
    nk = lists.key_valid.numel() // block_kv
    block_map = dense_from_lists(lists.kv_indices, lists.kv_counts, nk)  # [B, H, NQ, NK]
    masked = lists.has_padding and lists.kv_block_sizes is not None
    return flex.block_mask_from_map(
        block_map,
        lists.block,
        key_valid=lists.key_valid if masked else None,
        token_mask_mod=token_mask_mod,
    )


def _flex_forward(
    lists: BlockLists, provider: str, device: torch.device, autotune: bool
) -> Callable:
    block_mask = flex_block_mask(lists, token_mask_mod=device.type != "cuda")
    kernel_options = flex.kernel_options(FLEX_BLOCKS[provider])
    fn = flex.flex_function(device, max_autotune=autotune or provider == "flex64")

    def forward(q, k, v):
        return fn(q, k, v, block_mask, kernel_options)

    return forward


def make_provider(name: str, settings: Settings) -> Provider:
    def make(case: Case):
        registry.require("block_sparse", name, settings.device)
        if name in DENSE_PROVIDERS:
            q, k, v = random_qkv(case.shape, case.shape.real_len, _case_key(case), settings)
            forward = dense_sdpa(name, settings.device)
            return harness.mode_callable(forward, (q, k, v), case.mode)
        lists = case.lists
        q, k, v = random_qkv(case.shape, case.shape.seq_len, _case_key(case), settings)
        if name == "ours-fixed":
            call = harness.mode_callable(_ours_forward(lists), (q, k, v), case.mode)
            return harness.under_overrides(call, one_pass="fixed")
        if name in ("ours", "ours-nondet"):
            forward = _ours_forward(lists, deterministic=name == "ours")
        elif name == "ours-op":
            forward = _ours_op_forward(lists, settings.device, case.shape.head_dim)
        else:
            forward = _flex_forward(lists, name, settings.device, settings.flex_autotune)
        if settings.check and case.mode == "fwd":
            with torch.no_grad():
                check_against_reference(name, forward(q, k, v), q, k, v, lists)
        return harness.mode_callable(forward, (q, k, v), case.mode)

    return Provider(name, make)


# ---------------------------------------------------------------------------------------------
# the run
# ---------------------------------------------------------------------------------------------


def block_label(block: tuple[int, int] | None) -> str:
    return "dense" if block is None else f"{block[0]}x{block[1]}"


def plan_cases(
    shapes: Sequence[Shape],
    providers: Sequence[str],
    modes: Sequence[str],
    densities: Sequence[float],
    blocks: Sequence[tuple[int, int]],
) -> list[Case]:
    """All cases in run order. Cases sharing block lists are consecutive, so that only one set
    of lists is alive at a time; flex providers need their block size even when ours does not
    run it."""
    cases = []
    for shape in shapes:
        for provider in providers:
            if provider in DENSE_PROVIDERS:
                cases += [Case(shape, provider, mode) for mode in modes]
        needed = list(blocks)
        for provider, block in FLEX_BLOCKS.items():
            if provider in providers and block not in needed:
                needed.append(block)
        for density in densities:
            for block in needed:
                for provider in providers:
                    ours = provider in OURS and block in blocks
                    ours &= provider not in ONE_PASS_ARMS or block in NONDET_BLOCKS
                    if ours or FLEX_BLOCKS.get(provider) == block:
                        cases += [Case(shape, provider, m, density, block) for m in modes]
    return cases


def runnable_cases(cases: list[Case], device: torch.device) -> list[Case]:
    """``cases`` less the modes a provider cannot run on ``device`` (FlexAttention's backward
    on the CPU), each skipped with one note."""
    kept, noted = [], set()
    for case in cases:
        reason = registry.mode_unavailable("block_sparse", case.provider, case.mode, device)
        if reason is None:
            kept.append(case)
        elif reason not in noted:
            noted.add(reason)
            registry.note_skipped(reason)
    return kept


def base_row(case: Case, settings: Settings) -> dict:
    shape = case.shape
    row = {
        "shape": shape.name,
        "provider": case.provider,
        "block": block_label(case.block),
        "density": case.density,
        "mode": case.mode,
        "batch": shape.batch,
        "heads": shape.heads,
        "head_dim": shape.head_dim,
        "seq_len": shape.real_len if case.block is None else shape.seq_len,
        "real_tokens": shape.real_len,
        "grid": list(shape.grid) if shape.grid else None,
        "dtype": str(settings.dtype).replace("torch.", ""),
    }
    if case.lists is not None:
        row["block_density"] = case.lists.block_density
        row["padding_masked"] = case.lists.padding_masked
    return row


def case_pairs(case: Case) -> int:
    if case.lists is not None:
        return case.lists.pairs
    s = case.shape.real_len
    return harness.dense_pairs(case.shape.batch, case.shape.heads, s, s)


def run_all(cases: list[Case], settings: Settings, args, on_row: Callable[[list], None]):
    providers = {name: make_provider(name, settings) for name in {c.provider for c in cases}}
    rows: list[dict] = []
    lists_key, lists, lists_error = None, None, None
    for i, case in enumerate(cases, 1):
        if case.block is not None:
            key = (case.shape.name, case.block, case.density)
            if key != lists_key:
                lists_key, lists, lists_error = key, None, None
                harness.release_memory(settings.device)
                try:
                    lists = make_block_lists(
                        case.shape, case.block, case.density,
                        device=settings.device, seed=settings.seed,
                    )  # fmt: skip
                except Exception as exc:  # noqa: BLE001 - recorded on each case using them
                    lists_error = harness.error_message(exc)
            case.lists = lists
        row = base_row(case, settings)
        if case.block is not None and lists is None:
            row["error"] = f"block lists: {lists_error}"
        else:
            pairs = case_pairs(case)
            row["pairs"] = pairs
            row["effective_density"] = pairs / harness.dense_pairs(
                case.shape.batch, case.shape.heads, case.shape.real_len, case.shape.real_len
            )
            flops = harness.attention_flops(pairs, case.shape.head_dim, case.mode)
            row["flops"] = flops
            row = harness.run_case(
                providers[case.provider], case, device=settings.device, flops=flops, row=row,
                warmup=args.warmup, rep=args.rep,
            )  # fmt: skip
        case.lists = None  # the cache above holds them; rows must not
        rows.append(row)
        _print_progress(i, len(cases), row)
        on_row(rows)
    return rows


def run_rounds(
    cases: list[Case], settings: Settings, args, on_row: Callable[[list], None]
) -> list[dict]:
    """``run_all`` ``args.rounds`` times over the same cases (their lists and inputs too: the
    seeds depend on the case only), each round's rows with their ratios, merged into one row a
    case (``harness.in_rounds``); with several rounds ``on_row`` sees all rounds' rows so far,
    tagged ``round``."""
    finished: list[dict] = []

    def run_round(r: int) -> list[dict]:
        def on_round_row(rows):
            on_row(finished + [dict(row, round=r) for row in rows])

        rows = run_all(cases, settings, args, on_row if args.rounds == 1 else on_round_row)
        add_ratios(rows)
        finished.extend(dict(row, round=r) for row in rows)
        return rows

    return harness.in_rounds(args.rounds, run_round, RATIOS)


def _print_progress(i: int, n: int, row: dict) -> None:
    what = (
        f"[{i}/{n}] {row['shape']} {row['provider']} {row['block']} "
        f"d={row['density']:g} {row['mode']}"
    )
    harness.print_progress(what, row)


# ---- ratios ---------------------------------------------------------------------------------


def _find(rows, **match):
    for row in rows:
        if row.get("error") or row.get("ms") is None:
            continue
        if all(
            math.isclose(row[k], v) if isinstance(v, float) else row[k] == v
            for k, v in match.items()
        ):
            return row
    return None


# The ratios add_ratios sets, merged over --rounds.
RATIOS = ("vs_cudnn", "speedup_vs_cudnn", "ours_over_flex", "time_vs_density1")


def add_ratios(rows: list[dict]) -> None:
    """Ratios between rows of the same run:

    - ``vs_cudnn``: effective TFLOP/s over cuDNN's dense TFLOP/s (same shape and mode);
    - ``speedup_vs_cudnn``: cuDNN dense time over this row's time;
    - ``ours_over_flex``: ours' TFLOP/s over flex's at the same density, block and mode (flex
      at 128x128 for ours at 128x128, flex64 for 64x64); equal work, so also flex_ms / ours_ms;
    - ``time_vs_density1``: this row's time over the same provider's at density 1.
    """
    for row in rows:
        if row.get("error") or row.get("ms") is None or row["block"] == "dense":
            continue
        common = {"shape": row["shape"], "mode": row["mode"]}
        cudnn = _find(rows, provider="cudnn", block="dense", **common)
        if cudnn:
            row["vs_cudnn"] = row["tflops"] / cudnn["tflops"]
            row["speedup_vs_cudnn"] = cudnn["ms"] / row["ms"]
        full = _find(rows, provider=row["provider"], block=row["block"], density=1.0, **common)
        if full:
            row["time_vs_density1"] = row["ms"] / full["ms"]
        partner = FLEX_PARTNER.get(_parse_block(row["block"]))
        if row["provider"] in OURS and partner:
            flex = _find(
                rows, provider=partner, block=row["block"], density=row["density"], **common
            )
            if flex:
                row["ours_over_flex"] = row["tflops"] / flex["tflops"]


COLUMNS = [
    Column("shape", "shape"),
    Column("provider", "provider"),
    Column("block", "block"),
    Column("density", "density", ".4g"),
    Column("mode", "mode"),
    Column("ms", "ms", ".3f"),
    Column("tflops", "eff TFLOP/s", ".4g"),
    Column("ours_over_flex", "ours/flex", ".2f"),
    Column("vs_cudnn", "/cuDNN TFLOP/s", ".2f"),
    Column("speedup_vs_cudnn", "speedup vs cuDNN", ".2f"),
    Column("time_vs_density1", "t/t(d=1)", ".3f"),
]


# ---------------------------------------------------------------------------------------------
# command line
# ---------------------------------------------------------------------------------------------


def _parse_list(text: str, cast=str) -> list:
    return [cast(x.strip()) for x in text.split(",") if x.strip()]


def _parse_block(text: str) -> tuple[int, int] | None:
    if text == "dense":
        return None
    q, _, kv = text.lower().partition("x")
    return (int(q), int(kv or q))


def _parse_density(text: str) -> float:
    value = float(text)
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"densities must lie in (0, 1], got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Block-sparse attention: ours vs cuDNN / flash SDPA (dense) and "
        "FlexAttention (same block structure).",
    )
    p.add_argument(
        "--shapes",
        default="default",
        help="default | real | all, or a comma list of shape names (e.g. wan1.3b-480p)",
    )
    p.add_argument("--densities", default="1,0.5,0.25,0.125,0.0625")
    p.add_argument("--modes", default="fwd,bwd,fwd+bwd")
    p.add_argument(
        "--providers",
        default=",".join(DEFAULT_PROVIDERS),
        help=f"comma list of {', '.join(ALL_PROVIDERS)}",
    )
    p.add_argument(
        "--block-sizes", default="128x64,128x128,64x64", help="block_q x block_kv, for ours"
    )
    p.add_argument("--dtype", choices=tuple(DTYPES), default="bf16")
    p.add_argument("--device", choices=("cuda", "cpu"), default=None)
    p.add_argument("--tiny", action="store_true", help="B=1 H=2 S=512 D=64 (smoke test)")
    p.add_argument("--seq-len", type=int, default=None, help="override the default shape's S")
    p.add_argument("--heads", type=int, default=None, help="override the default shape's H")
    p.add_argument("--head-dim", type=int, default=None, help="override the default shape's D")
    p.add_argument(
        "--dry-run", action="store_true", help="--device cpu --tiny: exercise the code paths"
    )
    p.add_argument(
        "--out", default=None, help="JSON path (default results/block_sparse_<gpu>[_<shapes>].json)"
    )
    p.add_argument("--plot", default=None, help="PNG path (default: the JSON's, .png)")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--check", action="store_true", help="compare fwd outputs to the reference")
    p.add_argument(
        "--flex-autotune",
        action="store_true",
        help="compile flex (128-blocks) with max_autotune too (flex64 always is)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=harness.DO_BENCH_WARMUP_MS, help="ms")
    p.add_argument("--rep", type=int, default=harness.DO_BENCH_REP_MS, help="ms")
    harness.add_rounds_argument(p, "ratios")
    return p


def parse_args(argv: Sequence[str] | None):
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.dry_run:
        args.device, args.tiny = "cpu", True
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is visible (use --dry-run on a CPU)")
    if args.device == "cpu" and not args.tiny:
        print("CPU run: switching to --tiny sizes (full sizes take hours on the CPU)", flush=True)
        args.tiny = True
    args.providers = _parse_list(args.providers)
    bad = [p for p in args.providers if p not in ALL_PROVIDERS]
    if bad:
        parser.error(f"unknown providers {bad}; choose from {list(ALL_PROVIDERS)}")
    args.modes = _parse_list(args.modes)
    bad = [m for m in args.modes if m not in harness.MODES]
    if bad:
        parser.error(f"unknown modes {bad}; choose from {list(harness.MODES)}")
    try:
        args.densities = _parse_list(args.densities, _parse_density)
        args.block_sizes = _parse_list(args.block_sizes, _parse_block)
    except (ValueError, argparse.ArgumentTypeError) as exc:
        parser.error(str(exc))
    return args


def flex_compile_description(device: torch.device, flex_autotune: bool) -> dict:
    if device.type != "cuda":
        return {"flex": "eager (CPU dry run)", "flex64": "eager (CPU dry run)"}
    return {
        "flex": "torch.compile(dynamic=False)" + (", max_autotune" if flex_autotune else ""),
        "flex64": "torch.compile(dynamic=False), kernel_options BLOCK_M=BLOCK_N=64, "
        + flex.FLEX64_NOTE,
    }


def default_out(device: torch.device, shapes: str) -> Path:
    """results/block_sparse_<gpu>.json; other shape selections get their own file, so runs
    split by shape (each under a time limit) do not overwrite each other."""
    name = f"block_sparse_{harness.slug(harness.gpu_name(device))}"
    if shapes != "default":
        name += f"_{harness.slug(shapes)}"
    return harness.results_dir() / f"{name}.json"


def main(argv: Sequence[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cpu":
        # The reference path, not the Triton interpreter (tests set TRITON_INTERPRET=1).
        os.environ["VIDSPARSE_BACKEND"] = "torch"
    settings = Settings(device, DTYPES[args.dtype], args.seed, args.check, args.flex_autotune)
    try:
        shapes = build_shapes(
            args.shapes, args.tiny, seq_len=args.seq_len, heads=args.heads, head_dim=args.head_dim
        )
    except ValueError as exc:
        build_parser().error(str(exc))
    providers = registry.runnable_providers("block_sparse", args.providers, device)
    cases = plan_cases(shapes, providers, args.modes, args.densities, args.block_sizes)
    cases = runnable_cases(cases, device)
    out = Path(args.out) if args.out else default_out(device, args.shapes)
    meta = harness.collect_metadata(
        device,
        benchmark="block_sparse",
        dtype=args.dtype,
        tiny=args.tiny,
        seed=args.seed,
        check=args.check,
        flex_compile=flex_compile_description(device, args.flex_autotune),
        shapes=[vars(s) | {"real_len": s.real_len} for s in shapes],
        rounds=args.rounds,
        complete=False,
    )
    print(f"{len(cases)} cases on {meta['gpu']} ({meta['timer']}); results -> {out}", flush=True)
    # Written after every case: a crash hours in must not lose what was measured.
    rows = run_rounds(cases, settings, args, lambda rows: harness.write_results(out, meta, rows))
    meta["complete"] = True
    harness.write_results(out, meta, rows)
    print()
    harness.print_table(rows, harness.with_spread(COLUMNS, args.rounds))
    print(f"\nwrote {out}", flush=True)
    if not args.no_plot:
        png = harness.plot(
            args.plot or out.with_suffix(".png"),
            rows,
            x="density",
            y="tflops",
            series=("provider", "block"),
            panels=("shape", "mode"),
            reference=lambda r: r["block"] == "dense",
            ylabel="effective TFLOP/s",
            title=f"block-sparse attention on {harness.device_name(device)}, {args.dtype} "
            f"({meta['timer']})",
        )
        if png:
            print(f"wrote {png}", flush=True)
    return rows


if __name__ == "__main__":
    main()
