"""``vidsparse tune``: sweep the kernels' configs on this GPU and write the tuning file that
the library then loads for it (``utils/tuning_file.py``; ``docs/tuning.md``).

For each job (a kernel at a block size of the shape asked for) every candidate config runs
once and is checked against the PyTorch reference, then timed with the benchmark harness
(``harness.time_ms``: ``triton.testing.do_bench``, CUDA events); the fastest that passed wins,
and never one slower than the default (candidate 0), which a winner must beat twice. The file
is rewritten (atomically) after each candidate, so a run stopped by ``--time-budget``, Ctrl-C
or a crash leaves a valid file that the same command resumes, inside a job at its next
candidate (the file's ``progress``).
"""

from __future__ import annotations

import datetime as _dt
import os
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from vidsparse.bench import harness, shapes
from vidsparse.bench.tune_workloads import (
    DEFAULT_REL_L2,
    KERNEL_CHOICES,
    VSA_KERNELS,
    Job,
    Shape,
    Yardstick,
    base_fields,
    describe_config,
    engine_default,
    make_workload,
    tuned_fields,
)
from vidsparse.utils import tuning_file
from vidsparse.utils.device import CPU_INTERPRETER, Target, target_of

# A winner must beat the default by this much, twice: on an H200 the fastest of 8 timings of
# one kernel beat the same kernel by 3%, and again when both were timed a second time.
MIN_GAIN = 0.03
DEFAULT_BLOCKS = ((64, 64), (128, 128))  # VSA's 4x4x4 tiles; the engine's fast square block

# --model: the shape registry's entry (bench/shapes.py: grid, heads, head_dim at its own
# resolution) and the e2e benchmark's model (bench/ops/e2e_configs.py), whose latent sizes
# give the grid at its other resolutions. Registry names (and its tiny shapes) work too.
MODELS = {
    "wan2.1-1.3b": ("wan1.3b-480p", "wan1.3b"),
    "wan2.1-14b": ("wan14b-720p", "wan14b"),
    "wan2.2-5b": ("wan2.2-5b-720p", "wan2.2-5b"),
    "wan2.2-a14b": ("wan2.2-a14b-720p", None),
    "hunyuanvideo": ("hunyuan-720p", "hunyuanvideo"),
    "hunyuanvideo1.5": ("hunyuan1.5-720p", "hunyuan1.5"),
    "skyreels-v2-14b": ("skyreels-v2-14b-720p", "skyreels-v2"),
    "wan2.1-vace-14b": ("wan-vace-14b-720p", "wan-vace"),
    "chronoedit-14b": ("chronoedit-14b-720p", "chronoedit"),
    "wan2.2-animate-14b": ("wan-animate-14b-720p", "wan-animate"),
    "ltx-video-2b": ("ltx-2b-1216x704", "ltx"),
    "ltx2-19b": ("ltx2-19b-1536x1024", "ltx2"),
    "cosmos-7b": ("cosmos-7b-720p", "cosmos"),
    "kandinsky5-lite": ("kandinsky5-lite-768x512", "kandinsky5"),
}


class TuneUsageError(ValueError):
    """Bad options or an unusable file: one line, exit code 2."""


@dataclass(frozen=True)
class TuneOptions:
    shape: Shape | None
    blocks: tuple[tuple[int, int], ...]
    kernels: tuple[str, ...]
    time_budget: float | None = None
    max_candidates: int | None = None
    out: str | None = None
    fresh: bool = False
    interpreter: bool = False
    seed: int = 0


# ---------------------------------------------------------------------------------------------
# options
# ---------------------------------------------------------------------------------------------


def add_shape_arguments(p) -> None:
    """The options naming a shape, shared by ``vidsparse tune`` and ``vidsparse bench tuned``."""
    p.add_argument("--model", help="a model's shape (--list-models), e.g. wan2.1-1.3b")
    p.add_argument("--resolution", help="with --model: e.g. 480p, 720p (default: the model's)")
    p.add_argument("--seq", type=int, help="explicit shape: tokens per sequence")
    p.add_argument("--batch", type=int, default=1, help="batch size (default 1)")
    p.add_argument("--heads", type=int, help="explicit shape: heads (default 12)")
    p.add_argument("--head-dim", type=int, help="explicit shape: head_dim (default 128)")
    p.add_argument(
        "--masked",
        action="store_true",
        help="explicit shape: key-block sizes mask part of the last block",
    )
    p.add_argument("--blocks", help="engine block sizes BQxBKV, comma list (default 64x64,128x128)")
    p.add_argument(
        "--sparsity",
        type=float,
        default=0.875,
        help="fraction of key blocks skipped per query block (default 0.875)",
    )


def options_from_args(args) -> TuneOptions:
    """Checked options of ``vidsparse tune``; ``TuneUsageError`` naming the first bad one."""
    _require(0.0 <= args.sparsity < 1.0, f"--sparsity must be in [0, 1), got {args.sparsity}")
    _require(
        args.time_budget is None or args.time_budget > 0,
        f"--time-budget must be > 0 seconds, got {args.time_budget}",
    )
    _require(
        args.max_candidates is None or args.max_candidates >= 1,
        f"--max-candidates must be >= 1, got {args.max_candidates}",
    )
    blocks = parse_blocks(args.blocks) if args.blocks else DEFAULT_BLOCKS
    kernels = parse_kernels(args.kernels)
    shape = shape_from_args(
        args, blocks if set(VSA_KERNELS).isdisjoint(kernels) else (*blocks, (64, 64))
    )  # VSA's kernels take 64-token tiles
    _require(
        shape is not None or args.show,
        "give --model NAME (--list-models names them) or an explicit shape (--seq S ...)",
    )
    return TuneOptions(
        shape,
        blocks,
        kernels,
        args.time_budget,
        args.max_candidates,
        args.out,
        args.fresh,
        args.interpreter,
        args.seed,
    )


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise TuneUsageError(message)


def parse_blocks(text: str) -> tuple[tuple[int, int], ...]:
    out = []
    for item in (t.strip() for t in text.split(",") if t.strip()):
        parts = item.lower().split("x")
        ok = len(parts) == 2 and all(p.isdigit() and _pow2_in(int(p), 16, 256) for p in parts)
        _require(ok, f"--blocks takes BQxBKV items, powers of two in [16, 256], got {item!r}")
        out.append((int(parts[0]), int(parts[1])))
    _require(bool(out), "--blocks is empty")
    return tuple(dict.fromkeys(out))


def _pow2_in(n: int, lo: int, hi: int) -> bool:
    return lo <= n <= hi and n & (n - 1) == 0


def parse_kernels(text: str | None) -> tuple[str, ...]:
    if not text or text == "all":
        return KERNEL_CHOICES
    items = tuple(dict.fromkeys(t.strip() for t in text.split(",") if t.strip()))
    unknown = [k for k in items if k not in KERNEL_CHOICES]
    _require(
        bool(items) and not unknown,
        f"--kernels: unknown {unknown or text!r}; choose from {','.join(KERNEL_CHOICES)}",
    )
    return items


def shape_from_args(args, blocks) -> Shape | None:
    """The shape asked for; ``blocks``: the block sizes an explicit length must divide into."""
    from vidsparse.ops.block_sparse_attn.configs import SUPPORTED_HEAD_DIMS

    density = 1.0 - args.sparsity
    explicit = [n for n in ("seq", "heads", "head_dim") if getattr(args, n) is not None]
    _require(args.batch >= 1, f"--batch must be >= 1, got {args.batch}")
    if args.model is not None:
        _require(
            not explicit and not args.masked,
            "--seq, --heads, --head-dim and --masked describe an explicit shape, not a --model's",
        )
        model = model_shape(args.model, args.resolution)
        label = args.model + (f" {args.resolution}" if args.resolution else "")
        _require(model.head_dim in SUPPORTED_HEAD_DIMS, f"{label}: head_dim {model.head_dim}")
        return Shape(label, args.batch, model.heads, model.head_dim, density, grid=model.grid)
    _require(args.resolution is None, "--resolution goes with --model")
    if args.seq is None:
        _require(not explicit and not args.masked, "an explicit shape needs --seq S")
        return None
    heads, head_dim = args.heads or 12, args.head_dim or 128
    _require(args.seq >= 1 and heads >= 1, "--seq and --heads must be >= 1")
    _require(
        head_dim in SUPPORTED_HEAD_DIMS,
        f"--head-dim must be one of {SUPPORTED_HEAD_DIMS}, got {head_dim}",
    )
    for bq, bk in blocks:
        _require(
            args.seq % bq == 0 and args.seq % bk == 0,
            f"--seq {args.seq} must be a multiple of every block size ({bq}x{bk}; VSA's"
            " kernels take 64-token tiles)",
        )
    return Shape("custom", args.batch, heads, head_dim, density, seq=args.seq, masked=args.masked)


def model_shape(name: str, resolution: str | None) -> shapes.ModelShape:
    """The registry's shape of ``--model name`` at ``resolution`` (default: its own)."""
    registry_name, e2e_name = MODELS.get(name, (name, None))
    try:
        base = shapes.get(registry_name)
    except KeyError:
        raise TuneUsageError(
            f"unknown model {name!r}; choose from {', '.join(MODELS)} (or a name of "
            "`vidsparse bench --list`'s shapes)"
        ) from None
    _require(isinstance(base, shapes.ModelShape), f"{name!r} is no model shape (no grid)")
    own = base.resolution.split()[0] if base.resolution else None
    if resolution is None or resolution == own:
        return base
    hw = _latent_sizes(e2e_name)
    _require(
        resolution in hw and own in hw,
        f"{name} has resolutions {sorted({own, *hw} - {None})}, not {resolution!r}",
    )
    # The patch, from the registry's grid at its own resolution; frames stay the same.
    patch = [hw[own][i] // base.grid[i + 1] for i in range(2)]
    grid = (base.grid[0], hw[resolution][0] // patch[0], hw[resolution][1] // patch[1])
    return replace(base, name=f"{name}-{resolution}", grid=grid, resolution=resolution)


def _latent_sizes(e2e_name: str | None) -> dict:
    if e2e_name is None:
        return {}
    from vidsparse.bench.ops import e2e_configs

    return dict(e2e_configs.MODELS[e2e_name].latent_hw)


def describe_models() -> str:
    lines = []
    for name, (registry_name, e2e_name) in MODELS.items():
        base = shapes.get(registry_name)
        own = base.resolution.split()[0]
        others = sorted(set(_latent_sizes(e2e_name)) - {own})
        res = ", ".join([f"{own} (default)", *others])
        lines.append(f"{name:20s} {base.heads} heads x {base.head_dim}, {res}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# jobs
# ---------------------------------------------------------------------------------------------


def plan_jobs(opts: TuneOptions) -> list[Job]:
    """The engine's kernels at each block size, then VSA's (64-token tiles)."""
    jobs = []
    for block in opts.blocks:
        jobs += [
            Job(k, block, opts.shape) for k in ("fwd", "bwd_dkdv", "bwd_dq") if k in opts.kernels
        ]
    jobs += [Job(k, (64, 64), opts.shape) for k in VSA_KERNELS if k in opts.kernels]
    return jobs


@dataclass
class Session:
    """Where a run tunes and what it has written so far."""

    opts: TuneOptions
    target: Target
    device: torch.device
    dtype: torch.dtype
    path: Path
    doc: dict
    log: object
    deadline: float | None

    def over_budget(self) -> bool:
        return self.deadline is not None and time.monotonic() > self.deadline


class BudgetReached(Exception):
    """``--time-budget`` ran out: the job under way is dropped, the file stays valid."""


def device_for(opts: TuneOptions) -> torch.device:
    if opts.interpreter:
        from vidsparse.utils.backend import triton_interpret_enabled

        _require(
            triton_interpret_enabled(),
            "--interpreter needs TRITON_INTERPRET=1 before the kernels are imported",
        )
        return torch.device("cpu")
    _require(
        torch.cuda.is_available(),
        "no GPU visible: vidsparse tune times the kernels on the GPU it tunes for",
    )
    return torch.device("cuda", torch.cuda.current_device())


def open_session(opts: TuneOptions, log) -> Session:
    device = device_for(opts)
    target = target_of(device)
    path = Path(opts.out).expanduser() if opts.out else tuning_file.tuning_path(target)[0]
    _require(
        path is not None, f"no tuning file to write: give --out PATH or set ${tuning_file.ENV_VAR}"
    )
    identity = tuning_file.current_identity(target)
    doc = None if opts.fresh else _resumable(path, identity)
    if doc is None:
        doc = tuning_file.new_document(identity, vidsparse=_version())
    elif doc["done"]:
        log(f"resuming {path}: {len(doc['done'])} jobs already done")
    dtype = torch.float16 if device.type == "cpu" else torch.bfloat16  # the interpreter: no bf16
    deadline = time.monotonic() + opts.time_budget if opts.time_budget else None
    return Session(opts, target, device, dtype, path, doc, log, deadline)


def _resumable(path: Path, identity: dict) -> dict | None:
    """The document at ``path`` to continue, None if there is none; a file that cannot be
    continued is a usage error (``--fresh`` starts it over), never silently overwritten."""
    if not path.exists():
        return None
    try:
        doc = tuning_file.read_document(path)
    except (OSError, tuning_file.TuningFileError) as exc:
        raise TuneUsageError(f"{path}: {exc}; --fresh starts it over") from None
    reason = tuning_file.identity_mismatch(doc["identity"], identity)
    _require(reason is None, f"{path}: {reason}; --fresh starts it over")
    return doc


def _version() -> str:
    from vidsparse import __version__

    return __version__


def run_tune(opts: TuneOptions, progress: bool = True) -> dict:
    """Tune every job not yet done; returns a summary (path, jobs done, stopped early). What
    it reports as it goes goes to stderr (under the progress bar, where there is one)."""
    from tqdm import tqdm

    session = open_session(opts, lambda m: tqdm.write(m, file=sys.stderr))
    jobs = plan_jobs(opts)
    todo = [j for j in jobs if j.job_id not in set(session.doc["done"])]
    _save(session)  # a valid file from the start, whatever stops the run
    stopped = False
    with tqdm(
        total=len(todo),
        desc="vidsparse tune",
        unit="job",
        file=sys.stderr,
        disable=None if progress else True,
    ) as bar:
        for job in todo:
            bar.set_postfix_str(job.describe())
            try:
                _record(session, job, tune_job(session, job))
            except BudgetReached:
                stopped = True
                break
            finally:
                harness.release_memory(session.device)  # the job's inputs, before the next's
            bar.update(1)
    tuning_file.reload()  # this process's next lookups see the new file
    done = sum(j.job_id in set(session.doc["done"]) for j in jobs)
    library_path = tuning_file.tuning_path(session.target)[0]
    return {
        "path": str(session.path),
        "jobs": len(jobs),
        "done": done,
        "stopped": stopped,
        "entries": len(session.doc["entries"]),
        "loaded_by_library": library_path is not None and library_path == session.path,
    }


def _record(session: Session, job: Job, entry: dict | None) -> None:
    if entry is not None:
        tuning_file.set_entry(session.doc, entry)
    session.doc["done"].append(job.job_id)
    session.doc.pop("progress", None)
    _save(session)


def _progress(session: Session, job: Job) -> dict:
    """The candidates of ``job`` already timed or skipped by an earlier run stopped inside it
    (keyed by their description), else a fresh record; kept in the file after each one."""
    progress = session.doc.get("progress")
    if not progress or progress["job"] != job.job_id:
        progress = {"job": job.job_id, "times": {}, "skipped": []}
        session.doc["progress"] = progress
    elif progress["times"] or progress["skipped"]:
        session.log(
            f"{job.describe()}: resuming after {len(progress['times'])} timed and "
            f"{len(progress['skipped'])} skipped candidates"
        )
    return progress


def _note_progress(session: Session, progress: dict, name: str, ms=None, why=None) -> None:
    if ms is not None:
        progress["times"][name] = ms
    else:
        progress["skipped"].append({"config": name, "why": why})
    _save(session)


def _save(session: Session) -> None:
    session.doc["updated_utc"] = _now()
    tuning_file.write_document(session.path, session.doc)


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


# ---------------------------------------------------------------------------------------------
# one job
# ---------------------------------------------------------------------------------------------


def tune_job(session: Session, job: Job) -> dict | None:
    """The entry of ``job``'s winner, or None (and a logged reason) where the default itself
    fails; ``BudgetReached`` when the time budget runs out first."""
    if session.over_budget():
        raise BudgetReached
    generator = torch.Generator(session.device).manual_seed(session.opts.seed)
    wl = make_workload(
        job,
        session.target,
        session.device,
        session.dtype,
        generator,
        partner=_partner(session, job),
    )
    candidates = wl.candidates()[: session.opts.max_candidates]
    refs = wl.reference()
    default = candidates[0]
    try:
        outs = wl.run(default)
        yardstick = Yardstick(*wl.compared(outs, refs))
        bad = wl.failure(outs, refs, yardstick)
        if not yardstick.default_rel <= DEFAULT_REL_L2:
            bad = bad or f"relative L2 error {yardstick.default_rel:.2e} > {DEFAULT_REL_L2}"
        if bad:
            raise ValueError(bad)
        times = {0: _time(session, wl, default)}
    except (BudgetReached, KeyboardInterrupt):
        raise
    except Exception as exc:  # noqa: BLE001 - reported; the run goes on with the next job
        session.log(
            f"{job.describe()}: not tuned, the default config fails here "
            f"({harness.error_message(exc)}); please report it"
        )
        return None
    progress = _progress(session, job)
    names = [describe_config(job, cfg) for cfg in candidates]
    seen = {s["config"] for s in progress["skipped"]}
    for i, name in enumerate(names[1:], start=1):
        if name in progress["times"]:  # timed before the run stopped inside this job
            times[i] = progress["times"][name]
    for i, cfg in enumerate(candidates[1:], start=1):
        if i in times or names[i] in seen:
            continue
        if session.over_budget():
            raise BudgetReached
        why = _try(session, wl, cfg, refs, yardstick, times, i)
        if why:
            session.log(f"{job.describe()}: skipped {names[i]}: {why}")
        _note_progress(session, progress, names[i], times.get(i), why)
    best = _confirmed_best(session, wl, candidates, times)
    return _entry(session, job, candidates, best, times, progress["skipped"])


def _try(session, wl, cfg, refs, yardstick, times, i) -> str | None:
    """Check candidate ``i`` and time it into ``times``; the reason it was skipped, if it was."""
    try:
        why = wl.failure(wl.run(cfg), refs, yardstick)
        if why is None:
            times[i] = _time(session, wl, cfg)
        return why
    except (BudgetReached, KeyboardInterrupt):
        raise
    except Exception as exc:  # noqa: BLE001 - out of resources, a compile error: skipped
        return harness.error_message(exc, 160)


def _time(session: Session, wl, cfg) -> float:
    return harness.time_ms(lambda: wl.run(cfg), device=session.device, cpu_reps=1)


def _confirmed_best(session, wl, candidates, times) -> int:
    """The fastest candidate, if it beats the default by MIN_GAIN in the sweep and again in a
    second timing of both; else the default (0)."""
    best = min(times, key=times.get)
    if best == 0 or times[best] > times[0] * (1 - MIN_GAIN):
        return 0
    again_default = _time(session, wl, candidates[0])
    again_best = _time(session, wl, candidates[best])
    return best if again_best <= again_default * (1 - MIN_GAIN) else 0


def _partner(session: Session, job: Job):
    """For a backward job: the other gradient kernel's tuned config where the file has one
    (the backward is timed whole), else None (its default)."""
    if job.kernel not in ("bwd_dkdv", "bwd_dq"):
        return None
    other = replace(job, kernel="bwd_dq" if job.kernel == "bwd_dkdv" else "bwd_dkdv")
    entries = {tuning_file.entry_key(e): e for e in session.doc["entries"]}
    entry = entries.get(other.key)
    if entry is None:
        return None
    default = engine_default(session.target, other)
    cfg, reason = tuning_file.apply_entry(entry, default)
    return None if reason else cfg


def _entry(session: Session, job: Job, candidates, best: int, times, skipped) -> dict:
    op, kernel, *key = job.key
    names = tuning_file.KEY_FIELDS[op]
    winner, default = candidates[best], candidates[0]
    session.log(
        f"{job.describe()}: {'default' if best == 0 else 'tuned'} {describe_config(job, winner)}"
        f" {times[best]:.3f} ms (default {times[0]:.3f} ms; {len(times)} of "
        f"{len(candidates)} candidates passed)"
    )
    return {
        "op": op,
        "kernel": kernel,
        **dict(zip(names, key)),
        "config": tuned_fields(job, winner),
        "base": base_fields(job, default),
        "measured": {
            "shape": job.shape.describe(),
            "dtype": str(session.dtype).replace("torch.", ""),
            "ms": times[best],
            "default_ms": times[0],
            "candidates": len(candidates),
            "passed": len(times),
            "skipped": skipped,
            "date_utc": _now(),
            "timer": harness.timer_label(session.device),
        },
    }


# ---------------------------------------------------------------------------------------------
# --show
# ---------------------------------------------------------------------------------------------


def show(opts: TuneOptions) -> str:
    """What is in effect for this GPU: the file, its match, and per entry (and per job of the
    shape asked for, if any) whether the tuned or the default config applies."""
    if not opts.interpreter and not torch.cuda.is_available():
        given = os.environ.get(tuning_file.ENV_VAR)
        where = given or f"{tuning_file.cache_dir()}/<gpu>.json"
        return (
            f"no GPU visible: tuning files apply to the GPU kernels only (on CPU tensors "
            f"the PyTorch reference runs)\ntuning file looked for at: {where}"
        )
    target = CPU_INTERPRETER if opts.interpreter else target_of(device_for(opts))
    state = tuning_file.loaded(target)
    lines = [
        f"tuning file: {state.path or '-'} ({state.source})",
        f"status: {state.status}" + (f": {state.reason}" if state.reason else ""),
        f"this process: {_identity_text(state.identity)}",
    ]
    doc = _readable(state.path)
    if doc is not None:
        lines.append(f"the file's:   {_identity_text(doc['identity'])}")
        lines.append(f"entries ({len(doc['entries'])}):")
        lines += [_entry_line(target, tuning_file.entry_key(e), e) for e in doc["entries"]]
    if opts.shape is not None:
        lines.append(f"for {opts.shape.describe()}:")
        lines += [_entry_line(target, job.key, None) for job in plan_jobs(opts)]
    return "\n".join(lines)


def _readable(path: Path | None) -> dict | None:
    if path is None or not path.exists():
        return None
    try:
        return tuning_file.read_document(path)
    except (OSError, tuning_file.TuningFileError):
        return None


def _identity_text(identity: dict) -> str:
    return ", ".join(f"{k} {identity.get(k, '?')}" for k in tuning_file.IDENTITY_FIELDS)


def _entry_line(target: Target, key: tuple, entry: dict | None) -> str:
    default, effective = configs_for_key(target, key)
    applies, why = tuning_file.entry_status(target, key, default)
    if not applies:
        state = f"default ({why}): {_fields_text(key, default)}"
    elif effective == default:
        state = f"tuned, the same as the default: {_fields_text(key, effective)}"
    else:
        state = f"tuned: {_fields_text(key, effective)} (default {_fields_text(key, default)})"
    measured = (entry or {}).get("measured", {})
    if "ms" in measured:
        state += f"; measured {measured['ms']:.3f} ms, the default {measured['default_ms']:.3f} ms"
    return f"  {tuning_file.describe_key(key)}: {state}"


def _fields_text(key: tuple, cfg) -> str:
    names = [n for n in tuning_file.KERNELS[key[:2]] if n != "extra" or cfg.extra]
    return " ".join(f"{n}={tuning_file.jsonable(getattr(cfg, n))}" for n in names)


def configs_for_key(target: Target, key: tuple):
    """``(table default, config in effect)`` of a tuning-file key (coarse: before the fit)."""
    from vidsparse.ops.block_sparse_attn import configs
    from vidsparse.ops.video_sparse_attn.configs import (
        SMALL_GRID_TILES,
        coarse_attn_config,
        pool_config,
    )

    op, kernel, *rest = key
    if op == "engine":
        masked = kernel.endswith("_masked")
        plain = kernel.removesuffix("_masked")
        get = lambda: configs.lookup(target, plain, rest[0], rest[1], rest[2], masked)  # noqa: E731
    elif kernel == "pool":
        get = lambda: pool_config(target, rest[0])  # noqa: E731
    else:
        tiles = SMALL_GRID_TILES if kernel == "attn_topk_small" else 4 * SMALL_GRID_TILES
        get = lambda: coarse_attn_config(target, rest[0], tiles)  # noqa: E731
    with tuning_file.suspended():
        default = get()
    return default, get()
