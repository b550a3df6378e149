"""Calibration samples for the PSA search: q/k/v of one attention layer at one denoising step.

Calibration files (written by ``save_calibration_sample``, e.g. through the diffusers
integration's ``capture_calibration``; read by ``load_calibration``) hold one sample each.

Version 2, ``*.safetensors`` (what the capture writes): the tensors ``q``, ``k``, ``v``
(``[H, S, D]`` or ``[B, H, S, D]``, any float dtype) and string metadata (safetensors keeps
``str -> str``); every value but ``format`` is JSON::

    format      "vidsparse-calibration"
    version     "2"
    step        "12"            the denoising step (0-based)
    layer       "3"             the attention layer's index
    tiled       "false"         "true": S is in tile order (VideoGrid.padded_len tokens)
    grid_shape  "[21, 30, 52]"  optional: the latent grid (T, H, W) in tokens
    num_steps   "50"            optional: the denoising steps of the schedule it came from
    transformer "\"transformer_2\""  optional: the pipeline member it came from (a JSON string)

Version 1, ``*.pt`` (older, still read): ``torch.save`` of a dict (read back with
``weights_only=True``, memory-mapped)::

    {"format": "vidsparse-calibration", "version": 1, "step": int, "layer": int,
     "q": Tensor, "k": Tensor, "v": Tensor,
     "tiled": bool,                                  optional, default False (natural order)
     "grid_shape": [T, H, W]}                        optional

A folder of such files is read lazily, one sample at a time, so a whole model's calibration
never has to fit in memory; its metadata (``CalibrationFiles.infos``, ``.recorded``) is read
without the tensors. The search checks a recorded grid and step count against its own, and
``vidsparse search`` takes them from the files when they are not given.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from vidsparse.utils.checks import (
    check_non_negative_int,
    check_positive_int,
    check_positive_ints,
)
from vidsparse.utils.files import atomic_write

__all__ = [
    "CALIBRATION_FORMAT",
    "CALIBRATION_VERSION",
    "CALIBRATION_SUFFIXES",
    "CalibrationSample",
    "CalibrationInfo",
    "CalibrationFiles",
    "load_calibration",
    "save_calibration_sample",
]

CALIBRATION_FORMAT = "vidsparse-calibration"
CALIBRATION_VERSION = 2  # what save_calibration_sample writes to a .safetensors file
# The suffixes of calibration files (version 1, version 2): a folder's files with these are
# its samples (load_calibration), and a capture refuses a folder that holds any.
CALIBRATION_SUFFIXES = (".pt", ".safetensors")

_TENSORS = ("q", "k", "v")
_V1_KEYS = {"format", "version", "step", "layer", *_TENSORS}
_V1_OPTIONAL = {"tiled", "grid_shape"}
_V2_KEYS = {"format", "version", "step", "layer", "tiled"}
_V2_OPTIONAL = {"grid_shape", "num_steps", "transformer"}
_RECORDED = ("grid_shape", "num_steps", "transformer")  # fields the search takes from files


def _check_fields(step, layer, tiled, grid_shape, num_steps) -> tuple | None:
    """Validate the small fields of a sample; returns ``grid_shape`` as a tuple (or None)."""
    check_non_negative_int("step", step)
    check_non_negative_int("layer", layer)
    if not isinstance(tiled, bool):
        raise TypeError(f"tiled must be a bool, got {tiled!r}")
    if num_steps is not None:
        check_positive_int("num_steps", num_steps)
        if step >= num_steps:
            raise ValueError(f"step {step} is outside num_steps={num_steps}")
    if grid_shape is None:
        return None
    return check_positive_ints("grid_shape", grid_shape, length=3)


def _check_transformer(transformer) -> None:
    if transformer is not None and (not isinstance(transformer, str) or not transformer):
        raise TypeError(f"transformer must be a non-empty str or None, got {transformer!r}")


@dataclass
class CalibrationSample:
    """q/k/v of one attention layer at one denoising step (one prompt).

    ``q``, ``k``, ``v``: ``[H, S, D]`` or ``[B, H, S, D]`` of one shape, in natural token order
    (``S == grid.num_tokens``) or tile order (``tiled=True``, ``S == grid.padded_len``).
    Several samples may share a (step, layer): their statistics are pooled. ``grid_shape``
    and ``num_steps``: where it was captured (the latent grid, the schedule's step count),
    when recorded; the search checks them against its own. ``transformer``: the pipeline
    member it came from (``"transformer_2"``), when recorded; the plan carries it.
    """

    step: int
    layer: int
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    tiled: bool = False
    grid_shape: tuple[int, int, int] | None = None  # where it was captured, if recorded
    num_steps: int | None = None  # denoising steps of the schedule it came from, if recorded
    transformer: str | None = None  # the pipeline member it came from, if recorded

    def __post_init__(self) -> None:
        self.grid_shape = _check_fields(
            self.step, self.layer, self.tiled, self.grid_shape, self.num_steps
        )
        _check_transformer(self.transformer)
        shapes = set()
        for name in _TENSORS:
            x = getattr(self, name)
            if not isinstance(x, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
            if x.ndim not in (3, 4) or not x.is_floating_point():
                raise ValueError(
                    f"{name} must be a float tensor [H, S, D] or [B, H, S, D], got "
                    f"{x.dtype} {tuple(x.shape)}"
                )
            shapes.add(tuple(x.shape))
        if len(shapes) != 1:
            raise ValueError(f"q, k, v must share one shape, got {sorted(shapes)}")

    @property
    def num_heads(self) -> int:
        return self.q.shape[-3]


@dataclass(frozen=True)
class CalibrationInfo:
    """The metadata of one calibration file (read without its tensors)."""

    path: Path
    step: int
    layer: int
    tiled: bool = False
    grid_shape: tuple[int, int, int] | None = None
    num_steps: int | None = None
    transformer: str | None = None

    def __post_init__(self) -> None:
        shape = _check_fields(self.step, self.layer, self.tiled, self.grid_shape, self.num_steps)
        _check_transformer(self.transformer)
        object.__setattr__(self, "grid_shape", shape)


# ---------------------------------------------------------------------------------------------
# writing
# ---------------------------------------------------------------------------------------------


def save_calibration_sample(
    sample: CalibrationSample,
    path: str | os.PathLike,
    *,
    grid=None,
    num_steps: int | None = None,
) -> None:
    """Write one sample as a calibration file (atomically).

    ``path`` ending in ``.safetensors`` writes version 2 (q/k/v and string metadata); ``.pt``
    the older version 1 (``torch.save``; it cannot record ``num_steps`` or ``transformer``).
    ``grid`` (a ``VideoGrid``) and ``num_steps`` default to the sample's ``grid_shape`` and
    ``num_steps``.
    """
    path = Path(path)
    shape = tuple(grid.shape) if grid is not None else sample.grid_shape
    steps = sample.num_steps if num_steps is None else num_steps
    _check_fields(sample.step, sample.layer, sample.tiled, shape, steps)
    if path.suffix == ".safetensors":
        _write_v2(sample, path, shape, steps)
    elif path.suffix == ".pt":
        if steps is not None or sample.transformer is not None:
            raise ValueError(
                f"{str(path)!r}: the .pt calibration format (version 1) cannot record "
                "num_steps or transformer; write a .safetensors file"
            )
        _write_v1(sample, path, shape)
    else:
        raise ValueError(
            f"{str(path)!r}: a calibration file ends in .safetensors (or .pt, the older format)"
        )


def _cpu_tensors(sample: CalibrationSample) -> dict[str, torch.Tensor]:
    out, storages = {}, set()
    for name in _TENSORS:
        x = getattr(sample, name).detach().to("cpu").contiguous()
        ptr = x.untyped_storage().data_ptr()
        if ptr in storages:  # views of one buffer (q/k/v of a fused projection): own copies
            x = x.clone()
        storages.add(x.untyped_storage().data_ptr())
        out[name] = x
    return out


def _write_v2(sample: CalibrationSample, path: Path, shape, num_steps) -> None:
    meta = {
        "format": CALIBRATION_FORMAT,
        "version": json.dumps(CALIBRATION_VERSION),
        "step": json.dumps(sample.step),
        "layer": json.dumps(sample.layer),
        "tiled": json.dumps(sample.tiled),
    }
    if shape is not None:
        meta["grid_shape"] = json.dumps(list(shape))
    if num_steps is not None:
        meta["num_steps"] = json.dumps(num_steps)
    if sample.transformer is not None:
        meta["transformer"] = json.dumps(sample.transformer)
    data = _safetensors().torch.save(_cpu_tensors(sample), meta)
    atomic_write(path, lambda f: f.write(data))


def _write_v1(sample: CalibrationSample, path: Path, shape) -> None:
    data: dict[str, Any] = {
        "format": CALIBRATION_FORMAT,
        "version": 1,
        "step": sample.step,
        "layer": sample.layer,
        **_cpu_tensors(sample),
        "tiled": sample.tiled,
    }
    if shape is not None:
        data["grid_shape"] = list(shape)
    atomic_write(path, lambda f: torch.save(data, f))


def _safetensors():
    """The safetensors package (with its torch functions), imported on first use."""
    try:
        import safetensors
        import safetensors.torch
    except ImportError:  # pragma: no cover - only an install without safetensors lacks it
        raise ImportError(
            "calibration files (.safetensors) need the safetensors package (pip install it)"
        ) from None
    return safetensors


# ---------------------------------------------------------------------------------------------
# reading
# ---------------------------------------------------------------------------------------------


def _where(path: Path) -> str:
    return f"calibration file {str(path)!r}"


def _check_keys(where: str, found, required, optional, what="fields") -> None:
    found = set(found)
    missing, extra = sorted(required - found), sorted(found - required - optional)
    if missing or extra:
        raise ValueError(f"{where}: missing {what} {missing}, unexpected {what} {extra}")


def _read_v1(path: Path) -> dict[str, Any]:
    """The fields of a version-1 file (tensors memory-mapped)."""
    where = _where(path)
    try:
        data = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:  # torch raises many kinds for a bad file
        raise ValueError(f"{where} cannot be read: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{where}: expected a dict, got {type(data).__name__}")
    if data.get("format") != CALIBRATION_FORMAT:
        raise ValueError(f"{where}: field 'format' must be {CALIBRATION_FORMAT!r}")
    if data.get("version") != 1:
        raise ValueError(
            f"{where}: unsupported version {data.get('version')!r} in a .pt file (expected 1; "
            f"version {CALIBRATION_VERSION} files are .safetensors)"
        )
    _check_keys(where, data, _V1_KEYS, _V1_OPTIONAL)
    return {k: v for k, v in data.items() if k not in ("format", "version")}


def _read_v2(path: Path, *, tensors: bool) -> dict[str, Any]:
    """The fields of a version-2 file, with its tensors if ``tensors`` (else only the header
    is read)."""
    where = _where(path)
    safe_open = _safetensors().safe_open
    try:
        file = safe_open(str(path), framework="pt", device="cpu")  # reads the header only
    except Exception as exc:  # SafetensorError, OSError, ...
        raise ValueError(f"{where} cannot be read: {exc}") from None
    with file:
        meta = file.metadata() or {}
        _check_v2_header(where, meta, set(file.keys()))
        try:
            data = {name: file.get_tensor(name) for name in _TENSORS} if tensors else {}
        except Exception as exc:
            raise ValueError(f"{where} cannot be read: {exc}") from None
    for key, text in meta.items():
        if key in ("format", "version"):
            continue
        try:
            data[key] = json.loads(text)
        except json.JSONDecodeError:
            raise ValueError(f"{where}: metadata {key!r} is not JSON: {text!r}") from None
    return data


def _check_v2_header(where: str, meta: dict[str, str], names: set[str]) -> None:
    if meta.get("format") != CALIBRATION_FORMAT:
        raise ValueError(f"{where}: metadata 'format' must be {CALIBRATION_FORMAT!r}")
    if meta.get("version") != str(CALIBRATION_VERSION):
        raise ValueError(
            f"{where}: unsupported version {meta.get('version')!r} in a .safetensors file "
            f"(expected {str(CALIBRATION_VERSION)!r})"
        )
    _check_keys(where, meta, _V2_KEYS, _V2_OPTIONAL, "metadata")
    _check_keys(where, names, set(_TENSORS), set(), "tensors")


def _info_fields(fields: dict[str, Any]) -> dict[str, Any]:
    return {k: fields.get(k) for k in ("step", "layer", *_RECORDED)} | {
        "tiled": fields.get("tiled", False)
    }


def read_calibration_info(path: str | os.PathLike) -> CalibrationInfo:
    """The metadata of one calibration file (a ``.safetensors`` file's tensors are not read)."""
    path = Path(path)
    fields = _read_v2(path, tensors=False) if path.suffix == ".safetensors" else _read_v1(path)
    try:
        return CalibrationInfo(path, **_info_fields(fields))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{_where(path)}: {exc}") from None


def read_calibration_sample(path: str | os.PathLike) -> CalibrationSample:
    """One calibration file, either version (``.safetensors``: 2; otherwise 1)."""
    path = Path(path)
    fields = _read_v2(path, tensors=True) if path.suffix == ".safetensors" else _read_v1(path)
    try:
        return CalibrationSample(**_info_fields(fields), **{k: fields[k] for k in _TENSORS})
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{_where(path)}: {exc}") from None


class CalibrationFiles(Sequence):
    """Calibration samples stored one per file, loaded on access (one at a time)."""

    def __init__(self, paths: Iterable[str | os.PathLike]):
        self.paths = [Path(p) for p in paths]
        if not self.paths:
            raise ValueError("no calibration files given")

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> CalibrationSample:
        return read_calibration_sample(self.paths[i])

    def __iter__(self) -> Iterator[CalibrationSample]:
        for p in self.paths:
            yield read_calibration_sample(p)

    def infos(self) -> list[CalibrationInfo]:
        """The metadata of every file (no tensor is read from a ``.safetensors`` file)."""
        return [read_calibration_info(p) for p in self.paths]

    def steps(self) -> list[int]:
        """The step of every file."""
        return [info.step for info in self.infos()]

    def recorded(self, field: str) -> tuple[Any, Path] | None:
        """``(value, first file recording it)`` of ``field`` (``"grid_shape"``,
        ``"num_steps"`` or ``"transformer"``) across the files that record it; ``None`` if none
        does.

        ``ValueError`` naming two files when they record different values.
        """
        if field not in _RECORDED:
            raise ValueError(f"field must be one of {list(_RECORDED)}, got {field!r}")
        first: tuple[Any, Path] | None = None
        for info in self.infos():
            value = getattr(info, field)
            if value is None:
                continue
            if first is None:
                first = (value, info.path)
            elif value != first[0]:
                raise ValueError(
                    f"the calibration files disagree on {field}: {str(first[1])!r} records "
                    f"{_show(first[0])}, {str(info.path)!r} records {_show(value)}"
                )
        return first


def _show(value) -> str:
    return "x".join(map(str, value)) if isinstance(value, tuple) else str(value)


def load_calibration(path: str | os.PathLike) -> CalibrationFiles:
    """Calibration samples from a file, or a folder of them (its ``.safetensors`` and ``.pt``
    files, sorted by name)."""
    path = Path(path)
    if path.is_dir():
        files = sorted(
            p for p in path.iterdir() if p.suffix in CALIBRATION_SUFFIXES and p.is_file()
        )
        if not files:
            raise ValueError(
                f"calibration folder {str(path)!r} holds no {' or '.join(CALIBRATION_SUFFIXES)} "
                "files"
            )
        return CalibrationFiles(files)
    if not path.exists():
        raise FileNotFoundError(f"calibration path {str(path)!r} does not exist")
    return CalibrationFiles([path])
