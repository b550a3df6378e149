"""Tuning files: kernel configs that ``vidsparse tune`` measured on one GPU, which the configs
modules take over their tables' rows.

Pure data: JSON, its schema, the GPU identity it must match, where the file is looked for,
and the one hook the configs modules call (``tuned_config``). Nothing here imports an op or
Triton. The format and the search order are in ``docs/tuning.md``.

A file is used only whole and only on the GPU it was made on: anything wrong with it (not
JSON, another schema, another GPU / target / driver / torch / Triton, an unknown kernel or
field, a value out of range) and it is ignored, with one logged warning naming the reason,
and the tables' defaults apply. Loading happens once per target; after that a lookup is a
dict access (no GPU query, nothing ``torch.compile`` would see: the lookups run on the host
inside the launchers).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.metadata
import json
import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from vidsparse.utils.device import CPU_INTERPRETER, Target, target_of
from vidsparse.utils.files import atomic_write

__all__ = [
    "ENV_VAR",
    "FORMAT",
    "SCHEMA_VERSION",
    "KERNELS",
    "TuningFileError",
    "Loaded",
    "current_identity",
    "machine_targets",
    "target_label",
    "tuning_path",
    "parse_document",
    "read_document",
    "identity_mismatch",
    "new_document",
    "write_document",
    "set_entry",
    "entry_key",
    "describe_key",
    "engine_key",
    "vsa_key",
    "loaded",
    "reload",
    "suspended",
    "tuned_config",
    "entry_status",
    "apply_entry",
    "jsonable",
]

logger = logging.getLogger("vidsparse.tuning")

FORMAT = "vidsparse-tuning"
SCHEMA_VERSION = 1
ENV_VAR = "VIDSPARSE_TUNING_FILE"
OFF_VALUES = ("off", "none", "0")  # $VIDSPARSE_TUNING_FILE=off: no tuning file at all

# ---------------------------------------------------------------------------------------------
# the schema: which kernels, keyed how, with which tunable fields, in which ranges
# ---------------------------------------------------------------------------------------------

_LAUNCH = ("num_warps", "num_stages", "extra")
# (op, kernel) -> the fields a tuned config may set. The engine's rows are keyed as its tables
# are (masked variants apply when key-block sizes mask padding keys); VSA's coarse kernels by
# head_dim ("attn_topk_small": grids of at most SMALL_GRID_TILES tiles).
KERNELS: dict[tuple[str, str], tuple[str, ...]] = {
    ("engine", "fwd"): _LAUNCH,
    ("engine", "fwd_masked"): _LAUNCH,
    ("engine", "bwd_dkdv"): (*_LAUNCH, "sub_m"),
    ("engine", "bwd_dkdv_masked"): (*_LAUNCH, "sub_m"),
    ("engine", "bwd_dq"): (*_LAUNCH, "sub_m"),
    ("engine", "bwd_dq_masked"): (*_LAUNCH, "sub_m"),
    ("vsa", "attn_topk"): ("block_m", "block_n", "num_pivots", *_LAUNCH),
    ("vsa", "attn_topk_small"): ("block_m", "block_n", "num_pivots", *_LAUNCH),
    ("vsa", "pool"): ("tiles_per_program", *_LAUNCH),
}
KEY_FIELDS = {"engine": ("block_q", "block_kv", "head_dim"), "vsa": ("head_dim",)}
IDENTITY_FIELDS = ("target", "gpu", "driver", "triton", "torch")


def _pow2_in(lo: int, hi: int):
    allowed = [1 << i for i in range(12) if lo <= 1 << i <= hi]
    return lambda v: _is_int(v) and v in allowed, f"a power of two in [{lo}, {hi}]"


def _int_in(lo: int, hi: int):
    return lambda v: _is_int(v) and lo <= v <= hi, f"an int in [{lo}, {hi}]"


def _one_of(*values):
    return lambda v: _is_int(v) and v in values, f"one of {list(values)}"


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


# What compiles: warps a power of two (16 at most: 1,024 threads of wave64s on AMD, and twice
# what any row here uses on NVIDIA); software pipelines of 1-8 stages; tiles of at least one
# tl.dot operand (16) and at most 256 (the kernels' register tiles); pivots a power of two
# (tl.arange).
FIELD_RULES = {
    "num_warps": _pow2_in(1, 16),
    "num_stages": _int_in(1, 8),
    "sub_m": _pow2_in(16, 256),
    "block_m": _pow2_in(16, 256),
    "block_n": _pow2_in(16, 256),
    "num_pivots": _pow2_in(2, 16),
    "tiles_per_program": _pow2_in(1, 16),
}
# AMD launch options (Triton's HIP backend): names and ranges.
EXTRA_RULES = {
    "waves_per_eu": _int_in(0, 8),
    "matrix_instr_nonkdim": _one_of(0, 16, 32),
    "kpack": _one_of(1, 2),
}
KEY_RULES = {
    "block_q": _pow2_in(16, 256),
    "block_kv": _pow2_in(16, 256),
    "head_dim": _pow2_in(16, 256),
}


class TuningFileError(ValueError):
    """A tuning file that cannot be used; the message is the reason, one line."""


# ---------------------------------------------------------------------------------------------
# identity and location
# ---------------------------------------------------------------------------------------------


def target_label(target: Target) -> str:
    return f"{target.backend}:{target.arch}"


def current_identity(target: Target) -> dict[str, str]:
    """What a file must have been made with to be used for ``target`` in this process."""
    return {
        "target": target_label(target),
        "gpu": _gpu_name(target),
        "driver": _driver_version(target),
        "torch": torch.__version__,
        "triton": _triton_version(),
    }


def machine_targets() -> tuple[Target, ...]:
    """The targets this process runs kernels for: the CPU interpreter, and the current GPU's."""
    if not torch.cuda.is_available():
        return (CPU_INTERPRETER,)
    return (CPU_INTERPRETER, target_of(torch.device("cuda")))


def _gpu_name(target: Target) -> str:
    if target.backend == "cpu":
        return "cpu"
    return torch.cuda.get_device_name(torch.cuda.current_device())


def _driver_version(target: Target) -> str:
    """The kernel driver's version, read from the files the drivers publish (no library to
    load, no GPU call); "unknown" where there is none."""
    if target.backend == "cpu":
        return "none"
    sources = {
        "cuda": ("/proc/driver/nvidia/version", r"Kernel Module(?: for \S+)?\s+(\d+(?:\.\d+)+)"),
        "hip": ("/sys/module/amdgpu/version", r"(\S+)"),
    }
    path, pattern = sources.get(target.backend, ("", ""))
    try:
        with open(path) as f:
            match = re.search(pattern, f.read())
    except OSError:
        return "unknown"
    return match.group(1) if match else "unknown"


def _triton_version() -> str:
    """The installed Triton's full version, from its package metadata (not imported)."""
    for dist in ("triton", "pytorch-triton-rocm", "pytorch-triton"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            return importlib.metadata.version(dist)
    return "none"


def _slug(text: str) -> str:
    out = re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")
    return out or "unknown"


def tuning_path(target: Target) -> tuple[Path | None, str]:
    """``(path, where it comes from)``: ``$VIDSPARSE_TUNING_FILE`` if set (``off``: none), else
    ``$XDG_CACHE_HOME/vidsparse/tuning/<gpu>.json`` (``~/.cache`` by default). The CPU
    interpreter reads only a file named by the variable, so that no file in a user's cache
    changes what the CPU test suite runs."""
    given = os.environ.get(ENV_VAR, "").strip()
    if given.lower() in OFF_VALUES:
        return None, f"${ENV_VAR}={given}"
    if given:
        return Path(given).expanduser(), f"${ENV_VAR}"
    if target.backend == "cpu":
        return None, f"${ENV_VAR} unset (the CPU interpreter reads no cached file)"
    return cache_dir() / f"{_slug(_gpu_name(target))}.json", "user cache"


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME", "").strip() or os.path.join("~", ".cache")
    return Path(base).expanduser() / "vidsparse" / "tuning"


# ---------------------------------------------------------------------------------------------
# the document: parse and check (whole file or nothing), build, write
# ---------------------------------------------------------------------------------------------


def engine_key(kernel: str, block_q: int, block_kv: int, head_dim: int, masked: bool) -> tuple:
    """The key of an engine row: its kernel (``_masked`` when key-block sizes mask keys)."""
    return ("engine", f"{kernel}_masked" if masked else kernel, block_q, block_kv, head_dim)


def vsa_key(kernel: str, head_dim: int) -> tuple:
    return ("vsa", kernel, head_dim)


def entry_key(entry: dict) -> tuple:
    return (entry["op"], entry["kernel"], *(entry[k] for k in KEY_FIELDS[entry["op"]]))


def parse_document(text: str) -> dict:
    """The checked document of a file's ``text``; ``TuningFileError`` saying what is wrong."""
    try:
        doc = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise TuningFileError(f"not valid JSON ({str(exc)[:80]})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise TuningFileError(f'not a vidsparse tuning file (no "format": "{FORMAT}")')
    if doc.get("schema") != SCHEMA_VERSION:
        raise TuningFileError(
            f"schema version {doc.get('schema')!r}, this vidsparse reads {SCHEMA_VERSION} "
            "(re-run vidsparse tune)"
        )
    identity = doc.get("identity")
    if not isinstance(identity, dict) or not all(
        isinstance(identity.get(k), str) for k in IDENTITY_FIELDS
    ):
        raise TuningFileError(f'"identity" must hold the strings {list(IDENTITY_FIELDS)}')
    entries = doc.get("entries")
    if not isinstance(entries, list):
        raise TuningFileError('"entries" must be a list')
    seen = set()
    for i, entry in enumerate(entries):
        key = _check_entry(i, entry)
        if key in seen:
            raise TuningFileError(f"entries[{i}]: a second entry for {describe_key(key)}")
        seen.add(key)
    done = doc.setdefault("done", [])
    if not isinstance(done, list) or not all(isinstance(d, str) for d in done):
        raise TuningFileError('"done" must be a list of strings')
    _check_progress(doc.get("progress"))
    return doc


def _check_progress(progress) -> None:
    """``progress``, where present: the tuner's unfinished job (``{"job": id, "times":
    {config: ms}, "skipped": [...]}``), so that a job longer than a time budget resumes at
    its next candidate. The library never reads it."""
    if progress is None:
        return
    times = progress.get("times") if isinstance(progress, dict) else None
    if not (
        isinstance(progress, dict)
        and isinstance(progress.get("job"), str)
        and isinstance(times, dict)
        and all(isinstance(ms, (int, float)) and ms > 0 for ms in times.values())
        and isinstance(progress.get("skipped"), list)
    ):
        raise TuningFileError(
            '"progress" must be {"job": str, "times": {config: ms > 0}, "skipped": list}'
        )


def _check_entry(i: int, entry) -> tuple:
    where = f"entries[{i}]"
    if not isinstance(entry, dict):
        raise TuningFileError(f"{where} must be an object")
    op, kernel = entry.get("op"), entry.get("kernel")
    if (op, kernel) not in KERNELS:
        known = sorted({f"{o}/{k}" for o, k in KERNELS})
        raise TuningFileError(f"{where}: unknown kernel {op}/{kernel}; known: {known}")
    for name in KEY_FIELDS[op]:
        ok, expected = KEY_RULES[name]
        if not ok(entry.get(name)):
            raise TuningFileError(f"{where}: {name} must be {expected}, got {entry.get(name)!r}")
    config = entry.get("config")
    if not isinstance(config, dict):
        raise TuningFileError(f'{where}: "config" must be an object')
    for name, value in config.items():
        _check_field(f"{where} ({op}/{kernel})", KERNELS[op, kernel], name, value)
    for extra in ("base", "measured"):
        if not isinstance(entry.get(extra, {}), dict):
            raise TuningFileError(f'{where}: "{extra}" must be an object')
    return entry_key(entry)


def _check_field(where: str, allowed: tuple[str, ...], name: str, value) -> None:
    if name not in allowed:
        raise TuningFileError(f"{where}: unknown field {name!r}; tunable: {list(allowed)}")
    if name == "extra":
        if not isinstance(value, dict):
            raise TuningFileError(f'{where}: "extra" must be an object')
        for knob, setting in value.items():
            if knob not in EXTRA_RULES:
                raise TuningFileError(
                    f"{where}: unknown extra {knob!r}; known: {list(EXTRA_RULES)}"
                )
            _check_range(where, f"extra.{knob}", EXTRA_RULES[knob], setting)
        return
    if name == "sub_m" and value is None:
        return  # the whole query block
    _check_range(where, name, FIELD_RULES[name], value)


def _check_range(where: str, name: str, rule, value) -> None:
    ok, expected = rule
    if not ok(value):
        raise TuningFileError(f"{where}: {name} must be {expected}, got {value!r}")


def describe_key(key: tuple) -> str:
    op, kernel, *rest = key
    if op == "engine":
        return f"engine/{kernel} {rest[0]}x{rest[1]} head_dim {rest[2]}"
    return f"vsa/{kernel} head_dim {rest[0]}"


def read_document(path: Path) -> dict:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise TuningFileError("not UTF-8 text") from None
    return parse_document(text)


def identity_mismatch(file_identity: dict, identity: dict) -> str | None:
    """Why a file made with ``file_identity`` must not be used here; None if it may."""
    for name in IDENTITY_FIELDS:
        if file_identity.get(name) != identity[name]:
            return (
                f"made for {name} {file_identity.get(name)!r}, this process has "
                f"{identity[name]!r} (re-run vidsparse tune here)"
            )
    return None


def new_document(identity: dict, **info) -> dict:
    return {"format": FORMAT, "schema": SCHEMA_VERSION, "identity": dict(identity), **info,
            "entries": [], "done": []}  # fmt: skip


def set_entry(doc: dict, entry: dict) -> None:
    """Add ``entry``, replacing one with the same key (the last tuned shape wins its key)."""
    key = entry_key(entry)
    doc["entries"] = [e for e in doc["entries"] if entry_key(e) != key] + [entry]


def write_document(path: Path, doc: dict) -> None:
    """Write ``doc`` atomically, checked first: the tuner never writes a file it would reject."""
    text = json.dumps(doc, indent=1) + "\n"
    parse_document(text)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, lambda f: f.write(text.encode("utf-8")))


def jsonable(value):
    """A config field as JSON holds it (tuples as lists)."""
    if isinstance(value, tuple):
        return [jsonable(v) for v in value]
    return value


# ---------------------------------------------------------------------------------------------
# the store: loaded once per target, consulted by the configs modules
# ---------------------------------------------------------------------------------------------


@dataclass
class Loaded:
    """What this process took from the tuning file for one target."""

    path: Path | None
    source: str
    status: str  # "in effect" | "absent" | "ignored" | "off"
    reason: str = ""
    identity: dict = field(default_factory=dict)
    file_identity: dict = field(default_factory=dict)
    entries: dict[tuple, dict] = field(default_factory=dict)


_loaded: dict[Target, Loaded] = {}
_built: dict[tuple, Any] = {}
_suspended = 0


def loaded(target: Target) -> Loaded:
    """The tuning file's state for ``target``, read on the first call only."""
    state = _loaded.get(target)
    if state is None:
        state = _loaded[target] = _load(target)
    return state


def _load(target: Target) -> Loaded:
    if target not in machine_targets():  # a cross-target compile check: no GPU of it here
        return Loaded(None, "-", "off", f"no {target_label(target)} GPU in this process")
    path, source = tuning_path(target)
    if path is None:
        return Loaded(None, source, "off")
    identity = current_identity(target)
    if not path.exists():
        return Loaded(path, source, "absent", identity=identity)
    try:
        doc = read_document(path)
    except (OSError, TuningFileError) as exc:
        return _ignored(path, source, identity, {}, str(exc))
    reason = identity_mismatch(doc["identity"], identity)
    if reason:
        return _ignored(path, source, identity, doc["identity"], reason)
    entries = {entry_key(e): e for e in doc["entries"]}
    logger.info("vidsparse: tuning file %s in effect (%d entries)", path, len(entries))
    return Loaded(path, source, "in effect", "", identity, doc["identity"], entries)


def _ignored(path, source, identity, file_identity, reason) -> Loaded:
    logger.warning("vidsparse: tuning file %s ignored, defaults used: %s", path, reason)
    return Loaded(path, source, "ignored", reason, identity, file_identity)


def reload() -> None:
    """Forget what was loaded: the next lookup reads the file again (after a tune, in tests)."""
    _loaded.clear()
    _built.clear()


@contextlib.contextmanager
def suspended():
    """Inside the block every lookup gets the tables' defaults (the tuner's candidate 0)."""
    global _suspended
    _suspended += 1
    try:
        yield
    finally:
        _suspended -= 1


def tuned_config(target: Target, key: tuple, default):
    """``default`` (a table's config, a frozen dataclass) with the tuned fields of the file's
    entry ``key`` for ``target`` where there is one that fits it; else ``default``."""
    if _suspended:
        return default
    entry = loaded(target).entries.get(key)
    if entry is None:
        return default
    memo = (target, key, default)
    cfg = _built.get(memo)
    if cfg is None:
        cfg, reason = apply_entry(entry, default)
        if reason:
            logger.warning(
                "vidsparse: tuned %s ignored, default used: %s", describe_key(key), reason
            )
        _built[memo] = cfg
    return cfg


def entry_status(target: Target, key: tuple, default) -> tuple[bool, str]:
    """``(the tuned config applies, why not)`` for ``--show``."""
    state = loaded(target)
    if state.status != "in effect":
        return False, f"tuning file {state.status}" + (f": {state.reason}" if state.reason else "")
    entry = state.entries.get(key)
    if entry is None:
        return False, "no tuned entry"
    _, reason = apply_entry(entry, default)
    return (not reason), reason


def apply_entry(entry: dict, default) -> tuple[Any, str]:
    """``(config, "")``, or ``(default, reason)`` where the entry does not fit ``default``'s
    dataclass or was measured against another default."""
    names = {f.name for f in dataclasses.fields(default)}
    base = entry.get("base", {})
    unknown = [n for n in (*entry["config"], *base) if n not in names]
    if unknown:
        return default, f"{type(default).__name__} has no field {unknown[0]!r}"
    for name, tuned_with in base.items():
        now = jsonable(getattr(default, name))
        if now != tuned_with:
            return default, (
                f"the library's default changed since tuning ({name}: {tuned_with!r} then, "
                f"{now!r} now; re-run vidsparse tune)"
            )
    changes = dict(entry["config"])
    if "extra" in changes:  # merged into the default's knobs, in their order
        changes["extra"] = tuple({**dict(default.extra), **changes["extra"]}.items())
    try:
        return dataclasses.replace(default, **changes), ""
    except (TypeError, ValueError) as exc:
        return default, f"{type(exc).__name__}: {exc}"
