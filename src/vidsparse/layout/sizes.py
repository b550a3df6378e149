"""Sizes of a tiled grid from plain ints, for the code that sees no ``VideoGrid`` object.

The tile / untile custom ops and their kernels carry the grid as ``shape`` / ``tile`` int lists
(what ``torch.library`` ops and Dynamo's host constants take); this is ``VideoGrid``'s size
arithmetic for them, in a leaf module both import.
"""

from __future__ import annotations

from vidsparse.utils import ceil_div

__all__ = ["padded_len_of"]


def padded_len_of(shape, tile) -> int:
    """``num_tiles * tile_volume`` of the grid ``shape`` cut into ``tile`` (as VideoGrid)."""
    n = 1
    for size, t in zip(shape, tile):
        n *= ceil_div(size, t) * t
    return n
