"""PSA plan files: the per-(step bucket, layer, head) stripe specs a search chose.

A plan is JSON, versioned and validated strictly on load (a wrong format name or version,
a missing, extra or mistyped field, a plan for another model or grid: ``ValueError`` naming the
field). Version 1::

    {
      "format": "vidsparse-psa-plan",
      "version": 1,
      "checksum": "sha256:4be1...",                  optional: of every other field (below)
      "model": "wan2.1-t2v-1.3b",                     free string, checked by expect_model
      "transformer": "transformer_2",                optional: the pipeline member searched
      "grid": {"shape": [21, 30, 52], "tile": [4, 4, 4], "block_grid": [6, 8, 13]},
      "spatial_units": ["block", "row"],             units of the searched family
      "num_heads": 12,
      "num_steps": 50,                               the denoising schedule
      "dense_steps": 10,                             steps [0, dense_steps) run dense
      "selection": {"mode": "alpha", "alpha": 0.05, "target_sparsity": null, "metric": "rel_l2"},
      "search": {"num_candidates": 100, "query_fraction": 1.0, "num_samples": 120},
      "buckets": [                                   contiguous, cover [dense_steps, num_steps)
        {"start": 10, "end": 20, "layers": [
          {"layer": 0, "heads": [                    exactly num_heads entries
            {"spec": {"t_width": 1, "t_offset": 0, "t_stride": null,
                      "s_width": 2, "s_offset": 0, "s_stride": 3},
             "spatial_unit": "row", "sparsity": 0.83, "rel_l2": 0.041, "cosine": 0.999},
            ...]}, ...]}, ...]
    }

``sparsity`` counts the skipped (query block, key block) pairs of the padded block grid;
``rel_l2`` and ``cosine`` are the search objective of the chosen spec, pooled over the
bucket's calibration samples. ``Plan.specs_for(step, layer)`` gives the specs to run, all in
``spatial_unit="block"`` (row-unit specs are converted exactly for the plan's grid).

``save_plan`` writes atomically: a temporary file in the target folder, then ``os.replace``;
on any error the previous file is left as it was and no temporary file remains (and the
temporaries that an interrupted save left behind are removed by the next save of that file).

**Integrity.** ``save_plan`` writes a ``checksum``: the SHA-256 of the canonical JSON of every
other field (keys sorted, no spaces), so a flipped byte that would load as other numbers is
refused (``ValueError``). Files without one (written before checksums, or by hand: delete the
field after editing a plan) load unverified, with a logged note. Integers are bounded as the
grids they describe are (``MAX_GRID_EXTENT`` for stripe fields, ``2**31 - 1`` for counts);
``load_plan`` refuses files over ``MAX_PLAN_BYTES`` and nesting its parser cannot follow.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import reprlib
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from vidsparse.layout.grid import VideoGrid
from vidsparse.masks.stripe import MAX_GRID_EXTENT, SPATIAL_UNITS, StripeSpec
from vidsparse.search.candidates import Candidate
from vidsparse.utils.files import atomic_write

__all__ = [
    "PLAN_FORMAT",
    "PLAN_VERSION",
    "MAX_PLAN_BYTES",
    "plan_checksum",
    "HeadChoice",
    "PlanBucket",
    "Plan",
    "save_plan",
    "load_plan",
    "atomic_write",
]

PLAN_FORMAT = "vidsparse-psa-plan"
PLAN_VERSION = 1
SELECTION_MODES = ("alpha", "target")
# The largest plan file load_plan reads: a plan of 60 layers x 48 heads x 100 step buckets is
# ~60 MB; a bigger file is no plan (and would take its size in memory many times over).
MAX_PLAN_BYTES = 256 << 20
# Bound of the plan's counts (heads, steps, layers, candidates, samples): int32, as elsewhere.
_MAX_COUNT = 2**31 - 1
_CHECKSUM = re.compile(r"sha256:[0-9a-f]{64}")

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------
# in-memory plan
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class HeadChoice:
    """The spec chosen for one head, with its sparsity and objective values."""

    spec: StripeSpec
    spatial_unit: str
    sparsity: float
    rel_l2: float
    cosine: float

    @property
    def candidate(self) -> Candidate:
        return Candidate(self.spec, self.spatial_unit)

    def to_dict(self) -> dict[str, Any]:
        return {
            "spec": self.spec.to_dict(),
            "spatial_unit": self.spatial_unit,
            "sparsity": float(self.sparsity),
            "rel_l2": float(self.rel_l2),
            "cosine": float(self.cosine),
        }


@dataclass(frozen=True)
class PlanBucket:
    """Steps ``[start, end)`` share one choice per (layer, head)."""

    start: int
    end: int
    layers: dict[int, tuple[HeadChoice, ...]]

    def to_dict(self) -> dict[str, Any]:
        return {
            "start": self.start,
            "end": self.end,
            "layers": [
                {"layer": layer, "heads": [c.to_dict() for c in heads]}
                for layer, heads in sorted(self.layers.items())
            ],
        }


@dataclass(frozen=True)
class Plan:
    """A PSA plan (see the module docstring for the file layout)."""

    model: str
    grid: VideoGrid
    num_heads: int
    num_steps: int
    dense_steps: int
    buckets: tuple[PlanBucket, ...]
    selection: dict[str, Any]
    spatial_units: tuple[str, ...] = SPATIAL_UNITS
    search: dict[str, Any] = field(
        default_factory=lambda: {"num_candidates": 1, "query_fraction": 1.0, "num_samples": 0}
    )
    # The pipeline member it was searched on ("transformer", "transformer_2" of Wan 2.2
    # A14B), where the calibration recorded one: the experts share a shape, so only this tells
    # their plans apart. None: not recorded (a bare transformer's capture, older files).
    transformer: str | None = None

    # ---- lookups -------------------------------------------------------------------------

    def bucket_for(self, step: int) -> PlanBucket | None:
        """The bucket holding ``step``; ``None`` for a dense step."""
        if isinstance(step, bool) or not isinstance(step, int):
            raise TypeError(f"step must be an int, got {step!r}")
        if not 0 <= step < self.num_steps:
            raise ValueError(f"step must lie in [0, num_steps={self.num_steps}), got {step}")
        if step < self.dense_steps:
            return None
        for bucket in self.buckets:
            if bucket.start <= step < bucket.end:
                return bucket
        raise ValueError(f"no bucket of the plan holds step {step}")  # prevented by validation

    def choices_for(self, step: int, layer: int) -> tuple[HeadChoice, ...] | None:
        """Per-head choices at ``(step, layer)``; ``None`` at a dense step."""
        bucket = self.bucket_for(step)
        if bucket is None:
            return None
        if layer not in bucket.layers:
            raise ValueError(
                f"the plan has no entry for layer {layer} at step {step} (bucket "
                f"[{bucket.start}, {bucket.end}) holds layers {sorted(bucket.layers)})"
            )
        return bucket.layers[layer]

    def specs_for(self, step: int, layer: int) -> list[StripeSpec]:
        """One ``StripeSpec`` per head for ``stripe_attn(..., spatial_unit="block")``.

        Dense specs at dense steps; row-unit choices are converted to the equivalent
        block-unit spec of the plan's grid.
        """
        choices = self.choices_for(step, layer)
        if choices is None:
            return [StripeSpec.dense()] * self.num_heads
        wb = self.grid.tiles[2]
        return [c.candidate.block_spec(wb) for c in choices]

    @property
    def layers(self) -> list[int]:
        return sorted({layer for b in self.buckets for layer in b.layers})

    # ---- statistics ----------------------------------------------------------------------

    def summary(self) -> dict[str, Any]:
        """Sparsity and error per layer and bucket, and a histogram of the chosen patterns.

        Means over searched steps weight each bucket by its number of steps;
        ``schedule_sparsity`` also counts the dense steps (as 0), i.e. the fraction of
        attention block pairs skipped over the whole denoising schedule.
        """
        per_layer: dict[int, dict[str, float]] = {}
        patterns: Counter[str] = Counter()
        total_w = total_sparsity = 0.0
        for layer in self.layers:
            w_sum = s_sum = e_sum = 0.0
            e_max = 0.0
            for b in self.buckets:
                heads = b.layers.get(layer)
                if heads is None:
                    continue
                w = (b.end - b.start) / len(heads)
                for c in heads:
                    w_sum += w
                    s_sum += w * c.sparsity
                    e_sum += w * c.rel_l2
                    e_max = max(e_max, c.rel_l2)
                    patterns[str(c.candidate)] += 1
            per_layer[layer] = {
                "sparsity": s_sum / w_sum,
                "rel_l2_mean": e_sum / w_sum,
                "rel_l2_max": e_max,
            }
            total_w += w_sum
            total_sparsity += s_sum
        searched = total_sparsity / total_w if total_w else 0.0
        searched_steps = self.num_steps - self.dense_steps
        per_bucket = [
            {
                "start": b.start,
                "end": b.end,
                "sparsity": _mean(c.sparsity for heads in b.layers.values() for c in heads),
                "rel_l2_mean": _mean(c.rel_l2 for heads in b.layers.values() for c in heads),
            }
            for b in self.buckets
        ]
        return {
            "model": self.model,
            "transformer": self.transformer,
            "grid": {"shape": list(self.grid.shape), "tile": list(self.grid.tile_shape)},
            "num_heads": self.num_heads,
            "num_layers": len(self.layers),
            "dense_steps": self.dense_steps,
            "num_steps": self.num_steps,
            "selection": dict(self.selection),
            "sparsity": searched,
            "schedule_sparsity": searched * searched_steps / self.num_steps,
            "per_layer": per_layer,
            "per_bucket": per_bucket,
            "patterns": dict(patterns.most_common()),
        }

    def format_summary(self, top_patterns: int = 10) -> str:
        """The summary as a short text report (for the command line)."""
        s = self.summary()
        sel = s["selection"]
        rule = (
            f"alpha={sel['alpha']}"
            if sel["mode"] == "alpha"
            else f"target={sel['target_sparsity']}"
        )
        member = f" ({s['transformer']})" if s["transformer"] else ""
        lines = [
            f"PSA plan for {s['model'] or '(unnamed model)'}{member}: grid "
            f"{tuple(s['grid']['shape'])}, "
            f"tile {tuple(s['grid']['tile'])}, {s['num_heads']} heads, {s['num_layers']} layers",
            f"selection {rule}; steps [0, {s['dense_steps']}) dense of {s['num_steps']}; "
            f"sparsity {s['sparsity']:.3f} on searched steps, {s['schedule_sparsity']:.3f} over "
            "the schedule",
            "",
            f"{'layer':>5}  {'sparsity':>8}  {'rel_l2 mean':>11}  {'rel_l2 max':>10}",
        ]
        for layer, row in s["per_layer"].items():
            lines.append(
                f"{layer:>5}  {row['sparsity']:>8.3f}  {row['rel_l2_mean']:>11.4f}  "
                f"{row['rel_l2_max']:>10.4f}"
            )
        total = sum(s["patterns"].values()) or 1
        lines += ["", f"most chosen patterns (of {total} head choices):"]
        for label, n in list(s["patterns"].items())[:top_patterns]:
            lines.append(f"  {n:>6}  {100 * n / total:5.1f}%  {label}")
        return "\n".join(lines)

    # ---- (de)serialisation ---------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        out = {
            "format": PLAN_FORMAT,
            "version": PLAN_VERSION,
            "model": self.model,
            **({} if self.transformer is None else {"transformer": self.transformer}),
            "grid": {
                "shape": list(self.grid.shape),
                "tile": list(self.grid.tile_shape),
                "block_grid": list(self.grid.tiles),
            },
            "spatial_units": list(self.spatial_units),
            "num_heads": self.num_heads,
            "num_steps": self.num_steps,
            "dense_steps": self.dense_steps,
            "selection": dict(self.selection),
            "search": dict(self.search),
            "buckets": [b.to_dict() for b in self.buckets],
        }
        return out

    @classmethod
    def from_dict(
        cls,
        data: Any,
        *,
        expect_grid: VideoGrid | None = None,
        expect_model: str | None = None,
    ) -> Plan:
        """Validate a parsed plan file strictly and build the plan (``ValueError`` otherwise)."""
        return _PlanReader(expect_grid, expect_model).read(data)


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else 0.0


# ---------------------------------------------------------------------------------------------
# validation
# ---------------------------------------------------------------------------------------------


def _field_error(path: str, message: str) -> ValueError:
    return ValueError(f"plan field '{path}': {message}")


_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = 60
_REPR.maxlong = 40


def _short(value) -> str:
    """``repr`` cut to a line (a hostile file's value may be megabytes long, or deeply nested)."""
    return _REPR.repr(value)


def _short_text(text: str, limit: int = 300) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


def plan_checksum(data: dict[str, Any]) -> str:
    """``"sha256:<hex>"`` of a plan's fields other than ``checksum``, as canonical JSON (sorted
    keys, no spaces, ASCII): what ``save_plan`` writes and ``load_plan`` checks."""
    body = {k: v for k, v in data.items() if k != "checksum"}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return "sha256:" + hashlib.sha256(text.encode("ascii")).hexdigest()


def _type_name(value) -> str:
    return "null" if value is None else type(value).__name__


class _PlanReader:
    """Reads a parsed plan, checking every field; errors name the field by its path."""

    def __init__(self, expect_grid, expect_model):
        if expect_grid is not None and not isinstance(expect_grid, VideoGrid):
            raise TypeError(f"expect_grid must be a VideoGrid, got {type(expect_grid).__name__}")
        if expect_model is not None and not isinstance(expect_model, str):
            raise TypeError(f"expect_model must be a str, got {type(expect_model).__name__}")
        self.expect_grid = expect_grid
        self.expect_model = expect_model
        self._specs: dict[tuple, StripeSpec] = {}
        self.checksummed = False  # set by read()

    # ---- primitives ----------------------------------------------------------------------

    @staticmethod
    def obj(value, path: str, keys: tuple[str, ...], optional: tuple[str, ...] = ()) -> dict:
        if not isinstance(value, dict):
            raise _field_error(path, f"expected an object, got {_type_name(value)}")
        missing = [k for k in keys if k not in value]
        if missing:
            where = f"{path}.{missing[0]}" if path != "<root>" else missing[0]
            raise _field_error(where, f"missing (required fields here: {list(keys)})")
        extra = sorted(set(value) - set(keys) - set(optional))
        if extra:
            where = f"{path}.{extra[0]}" if path != "<root>" else extra[0]
            allowed = list(keys) + list(optional)
            raise _field_error(where, f"unexpected field (allowed here: {allowed})")
        return value

    @staticmethod
    def int_(value, path: str, lo: int | None = None, hi: int = _MAX_COUNT) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise _field_error(
                path, f"expected an integer, got {_type_name(value)} {_short(value)}"
            )
        if lo is not None and value < lo:
            raise _field_error(path, f"must be >= {lo}, got {_short(value)}")
        if value > hi:
            raise _field_error(path, f"must be <= {hi}, got {_short(value)}")
        return value

    @staticmethod
    def float_(value, path: str, lo: float | None = None, hi: float | None = None) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _field_error(path, f"expected a number, got {_type_name(value)} {_short(value)}")
        value = float(value)
        if not math.isfinite(value):
            raise _field_error(path, f"must be finite, got {value}")
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            raise _field_error(path, f"must lie in [{lo}, {hi}], got {value}")
        return value

    @staticmethod
    def str_(value, path: str) -> str:
        if not isinstance(value, str):
            raise _field_error(path, f"expected a string, got {_type_name(value)} {_short(value)}")
        return value

    @staticmethod
    def list_(value, path: str) -> list:
        if not isinstance(value, list):
            raise _field_error(path, f"expected a list, got {_type_name(value)}")
        return value

    def ints3(self, value, path: str) -> tuple[int, int, int]:
        value = self.list_(value, path)
        if len(value) != 3:
            raise _field_error(path, f"expected 3 integers, got {_short(value)}")
        hi = MAX_GRID_EXTENT
        return tuple(self.int_(v, f"{path}[{i}]", lo=1, hi=hi) for i, v in enumerate(value))

    # ---- sections ------------------------------------------------------------------------

    def read(self, data) -> Plan:
        if not isinstance(data, dict):
            raise _field_error("<root>", f"expected an object, got {_type_name(data)}")
        # Format and version first: an old file's other fields may legitimately differ.
        if "format" not in data:
            raise _field_error("format", f"missing (expected {PLAN_FORMAT!r})")
        if data["format"] != PLAN_FORMAT:
            raise _field_error("format", f"expected {PLAN_FORMAT!r}, got {data['format']!r}")
        if "version" not in data:
            raise _field_error("version", f"missing (expected {PLAN_VERSION})")
        version = data["version"]
        if isinstance(version, bool) or not isinstance(version, int) or version != PLAN_VERSION:
            raise _field_error(
                "version",
                f"unsupported plan version {_short(version)}; this vidsparse reads version "
                f"{PLAN_VERSION} (re-run `vidsparse search` to regenerate the plan)",
            )
        keys = (
            "format",
            "version",
            "model",
            "grid",
            "spatial_units",
            "num_heads",
            "num_steps",
            "dense_steps",
            "selection",
            "search",
            "buckets",
        )
        self.obj(data, "<root>", keys, optional=("transformer", "checksum"))
        checksum = data.get("checksum")
        if checksum is not None and not (
            isinstance(checksum, str) and _CHECKSUM.fullmatch(checksum)
        ):
            raise _field_error(
                "checksum", f"expected 'sha256:' and 64 hex digits, got {_short(checksum)}"
            )
        model = self.str_(data["model"], "model")
        transformer = data.get("transformer")
        if transformer is not None:
            transformer = self.str_(transformer, "transformer")
        if self.expect_model is not None and model != self.expect_model:
            raise _field_error(
                "model", f"the plan is for model {model!r}, expected {self.expect_model!r}"
            )
        grid = self.grid(data["grid"])
        units = self.units(data["spatial_units"])
        num_heads = self.int_(data["num_heads"], "num_heads", lo=1)
        num_steps = self.int_(data["num_steps"], "num_steps", lo=1)
        dense_steps = self.int_(data["dense_steps"], "dense_steps", lo=0)
        if dense_steps > num_steps:
            raise _field_error(
                "dense_steps", f"must be <= num_steps={num_steps}, got {dense_steps}"
            )
        selection = self.selection(data["selection"])
        search = self.search(data["search"])
        buckets = self.buckets(data["buckets"], num_heads, num_steps, dense_steps, units)
        # Last: every field is checked (and nests as a plan does), so the canonical dump is safe.
        self.checksummed = checksum is not None
        if checksum is not None and plan_checksum(data) != checksum:
            raise _field_error(
                "checksum",
                "does not match the plan's content: the file is corrupted (or was edited by "
                "hand: delete the checksum field to load an edited plan unverified)",
            )
        return Plan(
            model=model,
            grid=grid,
            num_heads=num_heads,
            num_steps=num_steps,
            dense_steps=dense_steps,
            buckets=buckets,
            selection=selection,
            spatial_units=units,
            search=search,
            transformer=transformer,
        )

    def grid(self, value) -> VideoGrid:
        value = self.obj(value, "grid", ("shape", "tile", "block_grid"))
        shape = self.ints3(value["shape"], "grid.shape")
        tile = self.ints3(value["tile"], "grid.tile")
        grid = VideoGrid(shape, tile)
        if grid.num_tiles > MAX_GRID_EXTENT:
            raise _field_error(
                "grid.shape",
                f"{list(shape)} in tiles {list(tile)} is {grid.num_tiles} blocks, more than "
                f"MAX_GRID_EXTENT = {MAX_GRID_EXTENT}",
            )
        block_grid = self.ints3(value["block_grid"], "grid.block_grid")
        if block_grid != grid.tiles:
            raise _field_error(
                "grid.block_grid",
                f"{list(block_grid)} does not match shape {list(shape)} cut into tiles "
                f"{list(tile)} (expected {list(grid.tiles)})",
            )
        expect = self.expect_grid
        if expect is not None and grid != expect:
            raise _field_error(
                "grid",
                f"the plan is for grid shape {shape} tile {tile}, expected shape "
                f"{expect.shape} tile {expect.tile_shape}",
            )
        return grid

    def units(self, value) -> tuple[str, ...]:
        value = self.list_(value, "spatial_units")
        for i, u in enumerate(value):
            if u not in SPATIAL_UNITS:
                raise _field_error(
                    f"spatial_units[{i}]", f"expected one of {SPATIAL_UNITS}, got {_short(u)}"
                )
        if not value or len(set(value)) != len(value):
            raise _field_error("spatial_units", f"expected distinct units, got {_short(value)}")
        return tuple(value)

    def selection(self, value) -> dict[str, Any]:
        value = self.obj(value, "selection", ("mode", "alpha", "target_sparsity", "metric"))
        mode = value["mode"]
        if mode not in SELECTION_MODES:
            raise _field_error(
                "selection.mode", f"expected one of {SELECTION_MODES}, got {_short(mode)}"
            )
        if value["metric"] != "rel_l2":
            raise _field_error(
                "selection.metric", f"expected 'rel_l2', got {_short(value['metric'])}"
            )
        alpha, target = value["alpha"], value["target_sparsity"]
        if mode == "alpha":
            alpha = self.float_(alpha, "selection.alpha", lo=0.0)
            if target is not None:
                raise _field_error("selection.target_sparsity", "must be null when mode is 'alpha'")
        else:
            target = self.float_(target, "selection.target_sparsity", lo=0.0, hi=1.0)
            if alpha is not None:
                raise _field_error("selection.alpha", "must be null when mode is 'target'")
        return {"mode": mode, "alpha": alpha, "target_sparsity": target, "metric": "rel_l2"}

    def search(self, value) -> dict[str, Any]:
        value = self.obj(value, "search", ("num_candidates", "query_fraction", "num_samples"))
        return {
            "num_candidates": self.int_(value["num_candidates"], "search.num_candidates", lo=1),
            "query_fraction": self.float_(
                value["query_fraction"], "search.query_fraction", lo=0.0, hi=1.0
            ),
            "num_samples": self.int_(value["num_samples"], "search.num_samples", lo=0),
        }

    def buckets(self, value, num_heads, num_steps, dense_steps, units) -> tuple[PlanBucket, ...]:
        value = self.list_(value, "buckets")
        out = []
        expected_start = dense_steps
        for i, raw in enumerate(value):
            path = f"buckets[{i}]"
            raw = self.obj(raw, path, ("start", "end", "layers"))
            start = self.int_(raw["start"], f"{path}.start", lo=0)
            end = self.int_(raw["end"], f"{path}.end", lo=1)
            if start != expected_start:
                raise _field_error(
                    f"{path}.start",
                    f"buckets must be contiguous from dense_steps={dense_steps}: expected "
                    f"{expected_start}, got {start}",
                )
            if not start < end <= num_steps:
                raise _field_error(
                    f"{path}.end", f"must lie in ({start}, num_steps={num_steps}], got {end}"
                )
            layers = self.layers(raw["layers"], f"{path}.layers", num_heads, units)
            out.append(PlanBucket(start, end, layers))
            expected_start = end
        if expected_start != num_steps:
            raise _field_error(
                "buckets",
                f"the buckets cover steps [{dense_steps}, {expected_start}) but must reach "
                f"num_steps={num_steps}",
            )
        return tuple(out)

    def layers(self, value, path, num_heads, units) -> dict[int, tuple[HeadChoice, ...]]:
        value = self.list_(value, path)
        out: dict[int, tuple[HeadChoice, ...]] = {}
        for i, raw in enumerate(value):
            lpath = f"{path}[{i}]"
            raw = self.obj(raw, lpath, ("layer", "heads"))
            layer = self.int_(raw["layer"], f"{lpath}.layer", lo=0)
            if layer in out:
                raise _field_error(f"{lpath}.layer", f"layer {layer} appears twice in this bucket")
            heads = self.list_(raw["heads"], f"{lpath}.heads")
            if len(heads) != num_heads:
                raise _field_error(
                    f"{lpath}.heads", f"expected num_heads={num_heads} entries, got {len(heads)}"
                )
            out[layer] = tuple(
                self.head(h, f"{lpath}.heads[{j}]", units) for j, h in enumerate(heads)
            )
        return out

    def spec(self, value, path: str) -> StripeSpec:
        # Plans repeat a few specs thousands of times: parse each distinct one once.
        try:
            key = tuple(sorted(value.items())) if isinstance(value, dict) else None
            cached = self._specs.get(key) if key is not None else None
        except TypeError:  # unhashable values: parse (and fail) below
            key = cached = None
        if cached is not None:
            return cached
        if isinstance(value, dict):  # each field by its own path, with the StripeSpec bounds
            for name, v in value.items():
                if isinstance(v, int) and not isinstance(v, bool) and abs(v) > MAX_GRID_EXTENT:
                    lo = -MAX_GRID_EXTENT if str(name).endswith("_offset") else 1
                    raise _field_error(
                        f"{path}.{name}",
                        f"must lie in [{lo}, {MAX_GRID_EXTENT}] (MAX_GRID_EXTENT), got {_short(v)}",
                    )
        try:
            spec = StripeSpec.from_dict(value)
        except (TypeError, ValueError) as exc:
            raise _field_error(path, _short_text(str(exc))) from None
        if key is not None:
            self._specs[key] = spec
        return spec

    def head(self, value, path, units) -> HeadChoice:
        keys = ("spec", "spatial_unit", "sparsity", "rel_l2", "cosine")
        value = self.obj(value, path, keys)
        spec = self.spec(value["spec"], f"{path}.spec")
        unit = value["spatial_unit"]
        if unit not in units:
            raise _field_error(
                f"{path}.spatial_unit",
                f"expected one of spatial_units {list(units)}, got {_short(unit)}",
            )
        return HeadChoice(
            spec=spec,
            spatial_unit=unit,
            sparsity=self.float_(value["sparsity"], f"{path}.sparsity", lo=0.0, hi=1.0),
            rel_l2=self.float_(value["rel_l2"], f"{path}.rel_l2", lo=0.0),
            cosine=self.float_(value["cosine"], f"{path}.cosine", lo=-1.0, hi=1.0),
        )


# ---------------------------------------------------------------------------------------------
# files
# ---------------------------------------------------------------------------------------------


def save_plan(plan: Plan, path: str | os.PathLike) -> None:
    """Validate ``plan`` and write it as JSON to ``path`` atomically."""
    if not isinstance(plan, Plan):
        raise TypeError(f"plan must be a Plan, got {type(plan).__name__}")
    data = plan.to_dict()
    Plan.from_dict(data)  # never write a file that load_plan would refuse
    checksum = plan_checksum(data)
    data = {"format": data.pop("format"), "version": data.pop("version"), "checksum": checksum,
            **data}  # fmt: skip
    text = _plan_json(data)
    atomic_write(path, lambda f: f.write(text.encode("utf-8")))


def _plan_json(data: dict[str, Any]) -> str:
    """JSON text with one line per header field and per (bucket, layer).

    Readable and diffable, and fast: the per-layer lines go through the C encoder (an
    indented dump of a 40-layer, 40-bucket plan is several times slower).
    """

    def compact(x) -> str:
        return json.dumps(x, allow_nan=False, separators=(", ", ": "))

    head_text = "{\n" + ",\n".join(
        f" {compact(k)}: {compact(v)}" for k, v in data.items() if k != "buckets"
    )
    buckets = []
    for b in data["buckets"]:
        layers = ",\n".join("   " + compact(layer) for layer in b["layers"])
        buckets.append(
            f'  {{"start": {compact(b["start"])}, "end": {compact(b["end"])}, "layers": [\n'
            f"{layers}\n  ]}}"
        )
    return head_text + ',\n "buckets": [\n' + ",\n".join(buckets) + "\n ]\n}\n"


def load_plan(
    path: str | os.PathLike,
    *,
    expect_grid: VideoGrid | None = None,
    expect_model: str | None = None,
) -> Plan:
    """Read and strictly validate a plan file.

    ``expect_grid`` / ``expect_model``: refuse a plan made for another grid or model.
    Raises ``ValueError`` naming the offending field (or saying the JSON is corrupt, its
    checksum does not match, or the file is larger than ``MAX_PLAN_BYTES``); ``OSError`` if the
    file cannot be read. A file without a checksum loads with a logged note.
    """
    with open(path, "rb") as f:
        text = f.read(MAX_PLAN_BYTES + 1)  # never more: a hostile "file" may be endless
    if len(text) > MAX_PLAN_BYTES:
        raise ValueError(
            f"plan file {str(path)!r} is larger than MAX_PLAN_BYTES = {MAX_PLAN_BYTES} bytes: "
            "not a plan (corrupted?)"
        )
    try:
        data = json.loads(text.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"plan file {str(path)!r} is not valid JSON (corrupted?): {exc}") from None
    except RecursionError:  # json's parser recurses once per nested [ or {
        raise ValueError(
            f"plan file {str(path)!r} nests too deeply to be a plan (corrupted?)"
        ) from None
    reader = _PlanReader(expect_grid, expect_model)
    plan = reader.read(data)
    if not reader.checksummed:
        logger.info(
            "plan file %r has no checksum (written by an older vidsparse, or edited by hand): "
            "loaded unverified; save_plan writes one",
            str(path),
        )
    return plan
