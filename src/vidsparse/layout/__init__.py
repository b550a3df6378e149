"""Token layouts: the map between a video's natural raster order and tile order."""

from vidsparse.layout.grid import TileIndex, VideoGrid

__all__ = ["VideoGrid", "TileIndex"]
