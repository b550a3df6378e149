"""Block-sparse flash attention: the engine every sparse method in vidsparse runs on."""

from vidsparse.ops.block_sparse_attn.epilogue import Epilogue, register_epilogue
from vidsparse.ops.block_sparse_attn.interface import (
    block_sparse_attn,
    block_sparse_attn_unchecked,
)
from vidsparse.ops.block_sparse_attn.reference import (
    block_sparse_attn_bwd_ref,
    block_sparse_attn_ref,
)

__all__ = [
    "block_sparse_attn",
    "block_sparse_attn_unchecked",
    "Epilogue",
    "register_epilogue",
    "block_sparse_attn_ref",
    "block_sparse_attn_bwd_ref",
]
