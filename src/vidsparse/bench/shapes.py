"""The attention shapes benchmarks run: one table of video DiT models, shared by every op.

A model's video self-attention sees ``grid = (T, H, W)`` latent tokens after the patch
embedding, ``heads`` heads of ``head_dim``; joint-attention models (HunyuanVideo) append up to
``text_tokens`` text tokens to the same sequence. Benchmarks select shapes by ``name``; the
names are the ``shape`` field of the committed results in ``benchmarks/results/``, so keep
them stable.

Grids are latent sizes: frames ``(F - 1) / 4 + 1`` (the VAEs' 4x temporal compression) and
pixels / 16 per side (8x VAE and a 2x2 patch; Wan 2.2 TI2V-5B: 16x VAE and a 2x2 patch).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from vidsparse.layout import VideoGrid

HEAD_DIM = 128  # every model of MODELS (MORE_MODELS: LTX-Video and Kandinsky 5 have 64)


@dataclass(frozen=True)
class ModelShape:
    """One model's video self-attention at one resolution."""

    name: str
    model: str
    grid: tuple[int, int, int]
    heads: int
    layers: int
    head_dim: int = HEAD_DIM
    resolution: str = ""
    frames: int | None = None
    text_tokens: int = 0  # text tokens joined to the video sequence (joint attention)
    layers_note: str = ""
    estimate: bool = False  # the grid is our estimate, not a published configuration

    @property
    def tokens(self) -> int:
        """Video tokens (the text tokens of joint attention not counted)."""
        return math.prod(self.grid)

    @property
    def hidden(self) -> int:
        return self.heads * self.head_dim

    def video_grid(self, tile: tuple[int, int, int] = (4, 4, 4)) -> VideoGrid:
        return VideoGrid(self.grid, tile=tile)

    def describe(self) -> dict:
        """JSON-friendly fields, for a result file's ``meta``."""
        return {
            "name": self.name,
            "model": self.model,
            "grid": list(self.grid),
            "tokens": self.tokens,
            "heads": self.heads,
            "head_dim": self.head_dim,
            "layers": self.layers,
            "text_tokens": self.text_tokens,
            "estimate": self.estimate,
        }


@dataclass(frozen=True)
class SyntheticShape:
    """A plain ``[B, H, S, D]`` problem with no video grid (kernel sweeps)."""

    name: str
    batch: int
    heads: int
    seq_len: int
    head_dim: int


_MODELS = (
    ModelShape(
        "wan1.3b-480p", "Wan 2.1 T2V 1.3B", (21, 30, 52), heads=12, layers=30,
        resolution="480p (832x480)", frames=81,
    ),
    ModelShape(
        "wan14b-720p", "Wan 2.1 T2V 14B", (21, 45, 80), heads=40, layers=40,
        resolution="720p (1280x720)", frames=81,
    ),
    ModelShape(
        "hunyuan-720p", "HunyuanVideo", (33, 45, 80), heads=24, layers=60,
        resolution="720p (1280x720)", frames=129, text_tokens=256,
        layers_note="20 dual-stream + 40 single-stream blocks",
    ),
    ModelShape(
        "wan2.2-5b-720p", "Wan 2.2 TI2V 5B", (31, 22, 40), heads=24, layers=30,
        resolution="720p (1280x704)", frames=121,
    ),
    ModelShape(
        "wan2.2-a14b-720p", "Wan 2.2 A14B", (21, 45, 80), heads=40, layers=40,
        resolution="720p (1280x720)", frames=81,
        layers_note="40 per expert (high-noise and low-noise experts, Wan 2.1 14B dims)",
    ),
    ModelShape(
        "hunyuan1.5-720p", "HunyuanVideo 1.5", (31, 45, 80), heads=16, layers=54,
        resolution="720p (1280x720)", frames=121, estimate=True,
    ),
)  # fmt: skip

MODELS: dict[str, ModelShape] = {m.name: m for m in _MODELS}

# Further published shapes, the e2e benchmark's other diffusers families (selectable by name;
# not in MODELS, whose set the committed results and the ops' default shape lists pin). Their
# VAEs differ from the note at the top: LTX-Video and LTX-2 compress 32x32 spatially and 8x
# in time (patch 1), Cosmos 1.0 8x8x8 (CV8x8x8 tokenizer, patch 1x2x2); Kandinsky 5 uses the
# HunyuanVideo VAE (8x8x4, patch 1x2x2). LTX-Video and Kandinsky 5 Lite have head_dim 64.
_MORE = (
    ModelShape(
        "skyreels-v2-14b-720p", "SkyReels-V2 T2V 14B", (31, 45, 80), heads=40, layers=40,
        resolution="720p (1280x720)", frames=121,
    ),
    ModelShape(
        "wan-vace-14b-720p", "Wan 2.1 VACE 14B", (21, 45, 80), heads=40, layers=40,
        resolution="720p (1280x720)", frames=81,
        layers_note="40 blocks + 8 VACE blocks (at 0, 5, ..., 35) on the control video's tokens",
    ),
    # ChronoEdit-14B's edit: the input image's and the edited image's latent frames (5 frames);
    # with temporal reasoning (29 frames) the reasoning frames between them too: 8x45x80.
    ModelShape(
        "chronoedit-14b-720p", "ChronoEdit-14B (Wan 2.1 I2V 14B)", (2, 45, 80), heads=40,
        layers=40, resolution="720p (1280x720)", frames=5,
    ),
    # A 77-frame segment (20 latent frames) after the reference character's latent frame.
    ModelShape(
        "wan-animate-14b-720p", "Wan 2.2 Animate 14B", (21, 45, 80), heads=40, layers=40,
        resolution="720p (1280x720)", frames=77,
        layers_note="40 blocks + 8 face adapters (after blocks 0, 5, ..., 35), cross-attention "
        "to the face motion tokens",
    ),
    ModelShape(
        "ltx-2b-1216x704", "LTX-Video 2B", (16, 22, 38), heads=32, layers=28, head_dim=64,
        resolution="1216x704", frames=121,
    ),
    ModelShape(
        "ltx2-19b-1536x1024", "LTX-2 19B (video stream)", (16, 32, 48), heads=32, layers=48,
        resolution="1536x1024", frames=121,
        layers_note="48 audio-video blocks; the audio stream (32 heads x 64) is not counted",
    ),
    ModelShape(
        "cosmos-7b-720p", "Cosmos-1.0-Diffusion-7B-Text2World", (16, 44, 80), heads=32,
        layers=28, resolution="720p (1280x704)", frames=121,
    ),
    ModelShape(
        "kandinsky5-lite-768x512", "Kandinsky 5.0 Video Lite 2B", (31, 32, 48), heads=28,
        layers=32, head_dim=64, resolution="768x512", frames=121,
        layers_note="32 visual blocks (+ 2 text-only blocks)",
    ),
)  # fmt: skip
MORE_MODELS: dict[str, ModelShape] = {m.name: m for m in _MORE}

SYNTHETIC_32K = SyntheticShape("synthetic-32k", batch=1, heads=12, seq_len=32768, head_dim=128)
SYNTHETIC: dict[str, SyntheticShape] = {SYNTHETIC_32K.name: SYNTHETIC_32K}

# Smoke-test shapes (CPU, reference backend). 5x6x10 tokens make 2x2x3 tiles of 4x4x4, partial
# at every edge: 300 real tokens in 768 tile-ordered slots.
TINY: dict[str, ModelShape] = {
    m.name: m
    for m in (
        ModelShape("tiny-video", "smoke test", (5, 6, 10), heads=2, layers=2, head_dim=32),
        ModelShape("tiny-stripes", "smoke test", (4, 8, 8), heads=2, layers=1, head_dim=16),
        ModelShape("tiny-parallel", "smoke test", (5, 8, 8), heads=4, layers=1, head_dim=32),
        # 3x3x3 tiles of 4x4x4, the last along each axis partial: STA windows up to 3x3x3.
        ModelShape("tiny-sta", "smoke test", (9, 10, 11), heads=2, layers=1, head_dim=32),
    )
}


def get(name: str) -> ModelShape | SyntheticShape:
    """A model, synthetic or tiny shape by name; ``KeyError`` lists the names."""
    for table in (MODELS, MORE_MODELS, SYNTHETIC, TINY):
        if name in table:
            return table[name]
    raise KeyError(
        f"unknown shape {name!r}; choose from {sorted(MODELS)} or {sorted(SYNTHETIC)}"
        f" (smoke tests: {sorted(TINY)})"
    )


def select(names: str | list[str] | tuple[str, ...]) -> list[ModelShape | SyntheticShape]:
    """Shapes of a comma list (or sequence) of names, in order; ``ValueError`` on an unknown
    name."""
    if isinstance(names, str):
        names = [n.strip() for n in names.split(",") if n.strip()]
    try:
        return [get(n) for n in names]
    except KeyError as exc:
        raise ValueError(exc.args[0]) from None
