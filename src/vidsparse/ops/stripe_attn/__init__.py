"""PSA (Parameterized Stripe Attention): static per-head stripe masks on the block-sparse engine."""

from vidsparse.ops.stripe_attn.interface import (
    clear_stripe_attn_cache,
    stripe_attn,
    stripe_attn_density,
)
from vidsparse.ops.stripe_attn.reference import stripe_attn_ref, stripe_token_mask

__all__ = [
    "stripe_attn",
    "stripe_attn_ref",
    "stripe_attn_density",
    "stripe_token_mask",
    "clear_stripe_attn_cache",
]
