"""Block-sparse index format (lists per query block) and PSA stripe masks. Pure PyTorch."""

from vidsparse.masks.block_sparse import (
    block_density,
    dense_from_lists,
    lists_from_dense,
    random_block_lists,
    transpose_block_lists,
    validate_block_lists,
)
from vidsparse.masks.stripe import (
    SPATIAL_UNITS,
    StripeSpec,
    clear_stripe_cache,
    stripe_block_lists,
    stripe_block_mask,
    stripe_predicate,
    stripe_sparsity,
)

__all__ = [
    "validate_block_lists",
    "lists_from_dense",
    "dense_from_lists",
    "transpose_block_lists",
    "random_block_lists",
    "block_density",
    "SPATIAL_UNITS",
    "StripeSpec",
    "stripe_predicate",
    "stripe_block_mask",
    "stripe_block_lists",
    "stripe_sparsity",
    "clear_stripe_cache",
]
