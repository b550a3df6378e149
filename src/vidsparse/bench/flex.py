"""FlexAttention as a benchmark peer: one compiled ``flex_attention`` per configuration, and a
``BlockMask`` built from a block map (what our kernels attend to, block by block).

On the GPU, flex runs compiled (eager flex materialises S x S scores); on the CPU it runs
eagerly, forward only, which exercises the mask code and nothing more.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

FLEX_MISSING = (
    "FlexAttention is not available in this torch ({version}): it needs "
    "torch.nn.attention.flex_attention (torch >= 2.5)"
)

# Why 64-token blocks are compiled with max_autotune (seen with torch 2.11 on an H200):
# inductor's one default backward config for head_dim 128 on sm90 uses 128-wide tiles
# (BLOCK_N1 = BLOCK_M2 = 128), which cannot tile 64-token sparse blocks; it is dropped, nothing
# is left, and the backward fails to compile (NoValidChoicesError). kernel_options cannot
# override it (configs are filtered before the options apply). max_autotune adds configs with
# 32/64-wide tiles.
FLEX64_NOTE = "compiled with max_autotune: the default bwd config cannot tile 64-blocks"

# Flex's default forward tile on Hopper is 128x64 (or larger), which a 64-token query block
# cannot hold: without these options 64-blocks are refused.
KERNEL_OPTIONS_64 = {"BLOCK_M": 64, "BLOCK_N": 64}


def flex_unavailable() -> str | None:
    """Why FlexAttention cannot run here, or ``None``."""
    try:
        from torch.nn.attention import flex_attention  # noqa: F401
    except ImportError:
        return FLEX_MISSING.format(version=torch.__version__)
    return None


def kernel_options(block: tuple[int, int]) -> dict | None:
    """``kernel_options`` that let flex tile ``block`` (64-token blocks need 64x64 tiles)."""
    return dict(KERNEL_OPTIONS_64) if min(block) < 128 else None


def _flex_call(q, k, v, block_mask, kernel_options):
    from torch.nn.attention.flex_attention import flex_attention

    return flex_attention(q, k, v, block_mask=block_mask, kernel_options=kernel_options)


def _flex_call_autotuned(q, k, v, block_mask, kernel_options):
    # A separate function (code object) from _flex_call: dynamo caches compiled graphs per code
    # object, so the two compile configurations can never pick up each other's graphs.
    from torch.nn.attention.flex_attention import flex_attention

    return flex_attention(q, k, v, block_mask=block_mask, kernel_options=kernel_options)


_COMPILED_FLEX: dict[bool, Callable] = {}


def compiled_flex_attention(max_autotune: bool) -> Callable:
    """``torch.compile`` of flex_attention, made once per configuration for the whole run
    (compiled graphs are then cached per shape, mode, mask_mod and kernel options).

    Static shapes: an automatic dynamic recompile would time a slower, shape-generic kernel.
    The recompile limit is raised because every shape, block size, mode and mask_mod is its
    own graph; hitting the limit would fall back to eager flex, which materialises S x S
    scores. ``max_autotune``: inductor autotunes the flex kernels' tiles, stages and warps
    (needed for 64-blocks, see FLEX64_NOTE)."""
    if max_autotune not in _COMPILED_FLEX:
        import torch._dynamo

        for name, value in (
            ("cache_size_limit", 256),
            ("recompile_limit", 256),
            ("accumulated_cache_size_limit", 1024),
            ("accumulated_recompile_limit", 1024),
        ):
            if hasattr(torch._dynamo.config, name):
                setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), value))
        if max_autotune:
            fn = torch.compile(_flex_call_autotuned, dynamic=False, options={"max_autotune": True})
        else:
            fn = torch.compile(_flex_call, dynamic=False)
        _COMPILED_FLEX[max_autotune] = fn
    return _COMPILED_FLEX[max_autotune]


def flex_function(device: torch.device, *, max_autotune: bool) -> Callable:
    """The flex to time: compiled on the GPU; eager on the CPU (compiling for the CPU costs
    minutes and means nothing)."""
    if device.type == "cuda":
        return compiled_flex_attention(max_autotune)
    return _flex_call


def _ordered_blocks(block_map: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense bool [B, H, NQ, NK] -> (num_blocks int32 [B, H, NQ], indices int32 [B, H, NQ, NK]):
    FlexAttention's own format, listed blocks first in ascending order (what
    ``create_block_mask`` produces: a stable descending argsort of the map)."""
    counts = block_map.sum(dim=-1, dtype=torch.int32)
    order = torch.argsort(block_map.to(torch.int8), dim=-1, descending=True, stable=True)
    return counts.contiguous(), order.to(torch.int32).contiguous()


def block_mask_from_map(
    block_map: torch.Tensor,
    block: tuple[int, int],
    *,
    key_valid: torch.Tensor | None = None,
    token_mask_mod: bool = False,
):
    """A ``BlockMask`` attending exactly to the blocks of ``block_map`` (bool [B, H, NQ, NK];
    B and H may be 1, broadcast by flex), with the keys where ``key_valid`` (bool [S]) is
    false masked out.

    Built with ``BlockMask.from_kv_blocks`` (its ``kv_indices`` must be NK wide: it derives the
    transposed lists for the backward from them), in O(B * H * NQ * NK) with no S x S mask.
    Listed blocks whose keys are all valid are "full" blocks, which flex runs without calling
    ``mask_mod``, as ``create_block_mask`` classifies a block-aligned mask; so without
    ``key_valid`` there is no mask_mod at all. Blocks holding invalid keys (padding of partial
    tiles) are "partial" blocks with a ``mask_mod`` reading ``key_valid``.

    ``token_mask_mod``: give instead a ``mask_mod`` reproducing the whole mask token by token
    (block map and key validity). Eager flex (the CPU run) ignores the block structure and
    applies only ``mask_mod``; compiled flex never calls it on full blocks.
    """
    from torch.nn.attention.flex_attention import BlockMask

    block_q, block_kv = block
    nq, nk = block_map.shape[-2:]
    mask_mod = None
    if key_valid is not None:
        complete = key_valid.view(nk, block_kv).all(dim=-1)  # [NK]
        full_map = block_map & complete
        partial_map = block_map & ~complete

        def mask_mod(b, h, q_idx, kv_idx):
            return key_valid[kv_idx]

    else:
        full_map, partial_map = block_map, torch.zeros_like(block_map)
    if token_mask_mod:
        key_ok = (
            key_valid
            if key_valid is not None
            else torch.ones(nk * block_kv, dtype=torch.bool, device=block_map.device)
        )
        mask_mod = _token_mask_mod(block_map, block, key_ok)
    partial_counts, partial_indices = _ordered_blocks(partial_map)
    full_counts, full_indices = _ordered_blocks(full_map)
    return BlockMask.from_kv_blocks(
        partial_counts,
        partial_indices,
        full_counts,
        full_indices,
        BLOCK_SIZE=(block_q, block_kv),
        mask_mod=mask_mod,
        seq_lengths=(nq * block_q, nk * block_kv),
    )


def _token_mask_mod(block_map: torch.Tensor, block: tuple[int, int], key_ok: torch.Tensor):
    block_q, block_kv = block
    if block_map.shape[0] == 1 and block_map.shape[1] == 1:
        # One map broadcast over batch and heads: index it without b and h, which run over
        # the full batch and head counts.
        shared = block_map[0, 0]

        def mask_mod(b, h, q_idx, kv_idx):
            return shared[q_idx // block_q, kv_idx // block_kv] & key_ok[kv_idx]

        return mask_mod

    def mask_mod(b, h, q_idx, kv_idx):
        return block_map[b, h, q_idx // block_q, kv_idx // block_kv] & key_ok[kv_idx]

    return mask_mod
