"""Launch configurations of the layout's row-copy kernels (``permute.py``), as data.

Three kernels move whole rows (one token's ``D`` contiguous elements): ``tile`` and ``untile``
(``VideoGrid.tile`` / ``untile`` in one pass) and ``copy_rows`` (the layout changes of Ulysses'
exchange). All three are bandwidth bound: each program moves a block of rows, and what matters
is how many bytes it has in flight, so a config sizes that block in bytes, not rows.

Pure Python (no Triton): ``permute_ops`` reads the row bounds when it decides whether a tensor
fits the kernels, before any kernel is imported.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["RowCopyConfig", "KERNELS", "row_copy_config", "MIN_BLOCK_ROWS", "MAX_BLOCK_ROWS"]


@dataclass(frozen=True)
class RowCopyConfig:
    num_warps: int = 4
    # Bytes each program moves: 16 KB is 32 fp32 registers of data per thread at 4 warps,
    # several 16-byte vectors in flight per thread (what a bandwidth-bound copy needs), no spills.
    bytes_per_program: int = 16 * 1024
    # Rows per program: the byte budget above, as a power of two clamped to this range. The
    # support check (``permute_ops``) bounds the launch grid with the smallest block.
    min_block_rows: int = 16
    max_block_rows: int = 256


# kernel -> config. A row of this table is the launch config of one kernel; the three share
# one setting today, kept per kernel so that a retune of one does not move the others.
KERNELS: dict[str, RowCopyConfig] = {
    "tile": RowCopyConfig(),
    "untile": RowCopyConfig(),
    "copy_rows": RowCopyConfig(),
}

# Bounds over every kernel: the support check (``permute_ops``) sizes the launch grid with them.
MIN_BLOCK_ROWS = min(c.min_block_rows for c in KERNELS.values())
MAX_BLOCK_ROWS = max(c.max_block_rows for c in KERNELS.values())


def row_copy_config(kernel: str) -> RowCopyConfig:
    """The launch config of ``kernel`` (``"tile"``, ``"untile"`` or ``"copy_rows"``)."""
    try:
        return KERNELS[kernel]
    except KeyError:
        raise ValueError(f"kernel must be one of {sorted(KERNELS)}, got {kernel!r}") from None
