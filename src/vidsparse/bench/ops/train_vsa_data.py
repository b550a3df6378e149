"""``train_vsa``'s data (``train_vsa.py`` describes it): crops of the shipped clip, their
augmentation and noise, and the held-out set, each a function of the seed and the data index,
so every arm, and a resumed one, sees the same samples in the same order."""

from __future__ import annotations

import hashlib

import torch

from vidsparse.data import load_clip

EVAL_LEVELS = (0.25, 0.5, 0.75)  # the held-out set's noise levels t


def mix_seed(*parts) -> int:
    """A 63-bit seed per purpose and index: streams a resumed run recomputes, not restores."""
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:8], "little") >> 1


def load_frames() -> torch.Tensor:
    """The shipped clip as uint8 ``[3, frames, height, width]``."""
    return torch.from_numpy(load_clip()).permute(3, 0, 1, 2).contiguous()


def crop_pixels(frames, start, crop, flip=False, reverse=False) -> torch.Tensor:
    """One crop ``[3, f, h, w]`` at ``start = (t, y, x)``, in [-1, 1]."""
    (t, y, x), (f, h, w) = start, crop
    out = frames[:, t : t + f, y : y + h, x : x + w].float() / 127.5 - 1.0
    dims = [d for d, on in ((3, flip), (1, reverse)) if on]
    return out.flip(dims) if dims else out


def random_start(generator, frames_range, size, crop) -> tuple[int, int, int]:
    (first, stop), (height, width) = frames_range, size
    limits = (stop - crop[0] - first + 1, height - crop[1] + 1, width - crop[2] + 1)
    t, y, x = (int(torch.randint(n, (), generator=generator)) for n in limits)
    return first + t, y, x


def train_frames(args) -> tuple[int, int]:
    return 0, args.clip_frames - args.holdout_frames


def make_inputs(frames, args, index: int):
    """The training batch of data index ``index``: ``(x0, noise, t)`` on the CPU; crops from
    the training frames, random flips and time reversal, uniform ``t``."""
    generator = torch.Generator().manual_seed(mix_seed(args.seed, "train", index))
    crops = []
    for _ in range(args.batch_size):
        start = random_start(generator, train_frames(args), frames.shape[2:], args.crop)
        flip, reverse = torch.rand(2, generator=generator) < 0.5
        crops.append(crop_pixels(frames, start, args.crop, bool(flip), bool(reverse)))
    x0 = torch.stack(crops)
    noise = torch.randn(x0.shape, generator=generator)
    return x0, noise, torch.rand(args.batch_size, generator=generator)


def make_eval_set(frames, args) -> dict:
    """The held-out crops (the last ``holdout_frames`` frames, fixed positions) and one fixed
    noise tensor per level."""
    generator = torch.Generator().manual_seed(mix_seed(args.seed, "eval"))
    held_out = (args.clip_frames - args.holdout_frames, args.clip_frames)
    starts = [random_start(generator, held_out, frames.shape[2:], args.crop)
              for _ in range(args.eval_crops)]  # fmt: skip
    x0 = torch.stack([crop_pixels(frames, s, args.crop) for s in starts])
    noise = [torch.randn(x0.shape, generator=generator) for _ in EVAL_LEVELS]
    return {"x0": x0, "noise": noise, "starts": starts}
