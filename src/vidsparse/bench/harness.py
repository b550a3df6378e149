"""Shared benchmark harness: providers, timing, FLOP counting, run metadata, tables, JSON, plots.

Every benchmark op (``vidsparse.bench.ops.*``) follows the same shape::

    providers = {"ours": Provider("ours", make_ours), "cudnn": Provider("cudnn", make_cudnn)}
    for case in cases:
        row = run_case(providers[case.provider], case, device=dev, flops=..., row=base_row)
    write_results(path, collect_metadata(device=dev), rows); print_table(rows, COLUMNS)

A provider's ``make(case)`` does all the set-up (inputs, masks, block masks, compilation) and
returns a zero-argument function; only that function is timed. ``mode_callable`` turns a forward
function into the function to time for "fwd", "bwd" or "fwd+bwd", so all providers time the
same thing in each mode.

Conventions (benchmarks/BENCHMARK_GUIDELINES.md): ``triton.testing.do_bench`` medians on the GPU;
TFLOP/s counted on the attended query-key pairs (fwd = 4 * D * pairs, bwd = 2.5x, fwd+bwd =
3.5x). On the CPU the timer is a plain ``perf_counter`` loop labelled ``cpu-dry-run``: it only
exercises the code paths, its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import json
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

MODES = ("fwd", "bwd", "fwd+bwd")

# Backward work relative to forward: dQ, dK, dV and the recomputed scores make ~2.5 forward
# matmul volumes (the usual FlashAttention convention); fwd+bwd is then 3.5x the forward.
MODE_FLOP_FACTOR = {"fwd": 1.0, "bwd": 2.5, "fwd+bwd": 3.5}

DO_BENCH_WARMUP_MS = 25
DO_BENCH_REP_MS = 100

CPU_TIMER_LABEL = "cpu-dry-run"
# Printed after every benchmark that ran on the CPU (``runner.run``): its numbers say that the
# code runs, nothing about speed.
CPU_CAVEAT = (
    f"{CPU_TIMER_LABEL}: CPU timings are not meaningful (the PyTorch reference paths on a CPU "
    "shared with everything else): a smoke run of the code, not a measurement"
)


# ---------------------------------------------------------------------------------------------
# providers and the timed function
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Provider:
    """A named way of computing the benchmarked function.

    ``make(case)`` builds everything that must stay out of the timing (inputs, masks, compiled
    functions) and returns the zero-argument function to time (see ``mode_callable``).
    """

    name: str
    make: Callable[[Any], Callable[[], Any]]
    description: str = ""


def under_overrides(call: Callable[[], Any], **overrides) -> Callable[[], Any]:
    """``call`` (a ``mode_callable``) with the engine's ``configs.override(**overrides)`` around
    each run, so that the backward it times, too, runs under them (a tuning arm)."""
    from vidsparse.ops.block_sparse_attn import configs

    def run():
        with configs.override(**overrides):
            return call()

    return run


def mode_callable(
    forward: Callable[..., torch.Tensor], inputs: Sequence[torch.Tensor], mode: str
) -> Callable[[], Any]:
    """The zero-argument function to time for ``mode``, given ``forward(*inputs) -> out``.

    - "fwd": the forward alone, under ``no_grad`` (inference: nothing saved for backward).
    - "bwd": the backward alone. The forward runs once here, outside the timing, and each timed
      call is ``torch.autograd.grad(out, inputs, grad_out, retain_graph=True)`` on that graph.
    - "fwd+bwd": forward and backward together, as in a training step.

    The forward runs once here in every mode, so compilation and shape errors surface in
    ``make`` (recorded as the case's error) rather than inside the timer.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if mode == "fwd":
        plain = [x.detach() for x in inputs]

        def run_fwd():
            with torch.no_grad():
                return forward(*plain)

        run_fwd()
        return run_fwd

    leaves = [x.detach().requires_grad_(True) for x in inputs]
    out = forward(*leaves)
    # A fixed random output gradient: never ones or zeros, which some kernels shortcut.
    grad_out = torch.randn_like(out)
    if mode == "bwd":
        return _backward_only(out, leaves, grad_out)
    del out  # fwd+bwd rebuilds the graph on every call
    return _forward_backward(forward, leaves, grad_out)


def _backward_only(out, leaves, grad_out) -> Callable[[], Any]:
    return lambda: torch.autograd.grad(out, leaves, grad_out, retain_graph=True)


def _forward_backward(forward, leaves, grad_out) -> Callable[[], Any]:
    return lambda: torch.autograd.grad(forward(*leaves), leaves, grad_out)


# ---------------------------------------------------------------------------------------------
# timing, FLOPs, memory
# ---------------------------------------------------------------------------------------------


def synchronize(device: torch.device) -> None:
    """Wait for queued device work; a no-op on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timer_label(device: torch.device) -> str:
    if device.type == "cuda":
        return (
            f"triton.testing.do_bench median, warmup={DO_BENCH_WARMUP_MS} ms, "
            f"rep={DO_BENCH_REP_MS} ms"
        )
    return f"{CPU_TIMER_LABEL} (time.perf_counter median; timings meaningless)"


def cuda_profile(fn: Callable[[], Any], calls: int = 5, warmup: int = 3):
    """``torch.profiler`` of ``calls`` calls of ``fn`` on the GPU, after ``warmup`` calls (the
    per-kernel table: ``.key_averages()``; totals are over all ``calls``)."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return prof


def alternating_ms(arms, enter, make_fn, *, device: torch.device, rounds: int = 3) -> dict:
    """``{arm: [ms of each round]}``: ``time_ms`` of ``make_fn()`` inside ``enter(arm)`` (a
    context manager), the arms taken in turn each round, so drift in the machine's clocks
    spreads over every arm alike (A/Bs in one process: ``benchmarks/tuning/``)."""
    times = {arm: [] for arm in arms}
    for _ in range(rounds):
        for arm in arms:
            with enter(arm):
                times[arm].append(time_ms(make_fn(), device=device))
    return times


def in_rounds(
    rounds: int, run_round: Callable[[int], list[dict]], ratios: Sequence[str]
) -> list[dict]:
    """``run_round(r)`` (one round's rows, each ratio taken within it) for ``r`` in
    ``range(rounds)``, in turn, merged by ``merge_rounds``; one round's rows as they are."""
    if rounds == 1:
        return run_round(0)
    done = []
    for r in range(rounds):
        print(f"round {r + 1} of {rounds}", flush=True)
        done.append(run_round(r))
    return merge_rounds(done, ratios)


def merge_rounds(rounds: list[list[dict]], ratios: Sequence[str]) -> list[dict]:
    """One row a case from rounds of the same case list (rows in the same order): the median
    ms (TFLOP/s from it) and the median over the rounds of each of ``ratios``, each taken
    within its own round, where both sides ran minutes apart rather than a run apart; every
    round's values under ``*_rounds``, and ``ms_spread`` (slowest over fastest round, less 1).
    A case that failed in any round keeps that round's error."""
    merged = []
    for case_rows in zip(*rounds, strict=True):
        failed = [row for row in case_rows if row.get("error") or row.get("ms") is None]
        if failed:
            merged.append(dict(failed[0], rounds=len(case_rows)))
            continue
        row = dict(case_rows[0], rounds=len(case_rows))
        times = [r["ms"] for r in case_rows]
        row.update(ms=statistics.median(times), ms_rounds=times)
        row["ms_spread"] = max(times) / min(times) - 1
        if row.get("flops"):
            row["tflops"] = tflops(row["flops"], row["ms"])
        if row.get("peak_mem_gb") is not None:
            row["peak_mem_gb"] = max(r["peak_mem_gb"] for r in case_rows)
        for key in ratios:
            values = [r[key] for r in case_rows if r.get(key) is not None]
            if len(values) == len(case_rows):
                row.update({key: statistics.median(values), f"{key}_rounds": values})
            elif key in row:  # a ratio some round lacks is not reported
                row[key] = None
        merged.append(row)
    return merged


def add_rounds_argument(parser, ratios: str) -> None:
    """``--rounds N`` (default 1, at least 1) for a benchmark that runs through ``in_rounds``;
    ``ratios`` names, in the help, what is taken within each round."""

    def at_least_one(text: str) -> int:
        n = int(text)
        if n < 1:
            raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
        return n

    parser.add_argument(
        "--rounds",
        type=at_least_one,
        default=1,
        help=f"run every case this many times in turn; report medians ({ratios} per round)",
    )


def with_spread(columns: list, rounds: int) -> list:
    """``columns`` with the rounds' spread (``merge_rounds``' ``ms_spread``) where there were
    several rounds."""
    return [*columns, Column("ms_spread", "rounds' spread", ".1%")] if rounds > 1 else columns


def kernel_ms(fn: Callable[[], Any], contains: str, calls: int = 5) -> dict[str, float]:
    """GPU milliseconds a call of ``fn`` spends in each kernel whose name holds ``contains``
    (``cuda_profile`` over ``calls`` calls, averaged per call)."""
    prof = cuda_profile(fn, calls=calls)
    return {
        e.key: round(e.device_time_total / calls / 1e3, 4)
        for e in prof.key_averages()
        if contains in e.key and e.device_time_total > 0
    }


def summed_kernel_ms(fn: Callable[[], Any], calls: int = 5, warmup: int = 3) -> float:
    """GPU milliseconds of all the kernels one call of ``fn`` launches, summed (``cuda_profile``
    over ``calls`` calls; self times, so no operator counts its kernels twice). Kernels that
    overlap on two streams count in full, so this can exceed the call's wall time."""
    prof = cuda_profile(fn, calls=calls, warmup=warmup)
    return sum(e.self_device_time_total for e in prof.key_averages()) / calls / 1e3


def time_graph_ms(fn: Callable[[], Any], *, device: torch.device) -> tuple[float, str]:
    """``(milliseconds, how)``: on the GPU, the median of ``do_bench`` over replays of ``fn``
    captured in a CUDA graph, i.e. the GPU time of its kernels without the host's launch
    overhead (a sub-millisecond stage timed alone can be bound by the host, where a whole
    model's stream keeps the GPU fed); ``how`` is ``"cuda-graph"``. Where capture fails (or
    on the CPU), :func:`time_ms` of ``fn`` itself and ``how`` says so."""
    if device.type != "cuda":
        return time_ms(fn, device=device), "eager"
    try:
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):  # warm up off the default stream, as capture requires
            for _ in range(3):
                fn()
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
    except Exception as exc:  # noqa: BLE001 - timed eagerly instead, and labelled
        return time_ms(fn, device=device), f"eager (capture failed: {error_message(exc, 80)})"
    return time_ms(graph.replay, device=device), "cuda-graph"


def time_ms(
    fn: Callable[[], Any],
    *,
    device: torch.device,
    warmup: int = DO_BENCH_WARMUP_MS,
    rep: int = DO_BENCH_REP_MS,
    cpu_reps: int = 3,
) -> float:
    """Median milliseconds of one call of ``fn``.

    GPU: ``triton.testing.do_bench`` (CUDA events, L2 flushed between calls; ``warmup`` and
    ``rep`` are milliseconds of calls, not counts). CPU: one warm call, then the median of
    ``cpu_reps`` ``perf_counter`` timings; only good for checking that the code runs.
    """
    if device.type == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))
    fn()
    times = []
    for _ in range(max(1, cpu_reps)):
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def attention_flops(pairs: float, head_dim: int, mode: str) -> float:
    """FLOPs of attention over ``pairs`` attended (query, key) token pairs.

    ``pairs`` is summed over batch and heads: 4 * B * H * D * pairs-per-head for the forward
    (QK^T and PV, 2 FLOPs per multiply-add each); the backward counts 2.5x, fwd+bwd 3.5x.
    """
    return 4.0 * head_dim * float(pairs) * MODE_FLOP_FACTOR[mode]


def dense_pairs(batch: int, heads: int, seq_q: int, seq_kv: int) -> int:
    """Attended pairs of dense (non-causal) attention over real tokens."""
    return batch * heads * seq_q * seq_kv


def tflops(flops: float, ms: float) -> float:
    return flops / (ms * 1e-3) / 1e12


def peak_memory_gb(fn: Callable[[], Any], device: torch.device) -> float | None:
    """Peak allocated GPU memory (GB) during one call of ``fn``, counting what was already
    allocated (inputs, saved activations); None on the CPU."""
    if device.type != "cuda":
        return None
    synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    synchronize(device)
    return torch.cuda.max_memory_allocated(device) / 1e9


def release_memory(device: torch.device) -> None:
    """Drop cached blocks between cases so one case's leftovers do not cause the next's OOM."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def error_message(exc: BaseException, limit: int = 300) -> str:
    """``Type: first line`` of an exception, short enough for a table cell and a JSON row."""
    text = str(exc).strip().splitlines()
    first = text[0] if text else ""
    message = f"{type(exc).__name__}: {first}" if first else type(exc).__name__
    return message if len(message) <= limit else message[: limit - 3] + "..."


def run_case(
    provider: Provider,
    case: Any,
    *,
    device: torch.device,
    flops: float | None,
    row: dict,
    warmup: int = DO_BENCH_WARMUP_MS,
    rep: int = DO_BENCH_REP_MS,
    measure_memory: bool = True,
) -> dict:
    """Build, time and measure one case; returns ``row`` completed with ms, tflops, peak memory.

    Any exception (out of memory, a compile failure, a kernel refusing a shape) is recorded as
    ``row["error"]`` instead of propagating: one failing provider must not end a long run.
    """
    row = dict(row)
    row.setdefault("provider", provider.name)
    fn = None
    try:
        fn = provider.make(case)
        ms = time_ms(fn, device=device, warmup=warmup, rep=rep)
        row["ms"] = ms
        row["tflops"] = tflops(flops, ms) if flops else None
        if measure_memory:
            row["peak_mem_gb"] = peak_memory_gb(fn, device)
    except Exception as exc:  # noqa: BLE001 - recorded, the run goes on
        row["error"] = error_message(exc)
    finally:
        del fn
        release_memory(device)
    return row


# ---------------------------------------------------------------------------------------------
# metadata
# ---------------------------------------------------------------------------------------------


def repo_root() -> Path | None:
    """The source checkout this package runs from (src layout, editable install), else the
    working directory if it holds ``benchmarks/``; ``None`` for an installed wheel elsewhere."""
    for root in (Path(__file__).resolve().parents[3], Path.cwd().resolve()):
        if (root / "benchmarks").is_dir() and (root / "src" / "vidsparse").is_dir():
            return root
    return None


def results_dir() -> Path:
    """Where a benchmark writes its JSON by default: the checkout's ``benchmarks/results``
    (where committed results live), else ``./bench-results``."""
    root = repo_root()
    return root / "benchmarks" / "results" if root is not None else Path("bench-results")


def _git(args: list[str], cwd: Path) -> str | None:
    try:
        done = subprocess.run(
            ["git", *args], cwd=cwd, capture_output=True, text=True, timeout=10, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip()


def git_info(cwd: Path | None = None) -> dict:
    """Commit and dirty flag of the repository holding ``cwd``.

    ``VIDSPARSE_GIT_COMMIT``, when set, wins: a copy of the tree sent to a GPU machine may
    have no ``.git`` or a stale one (one such copy reported an old commit for every run), so
    pass the commit from where the repository is. Else git, else "unknown".
    """
    given = os.environ.get("VIDSPARSE_GIT_COMMIT")
    if given:
        return {"git_commit": given, "git_dirty": "unknown"}
    cwd = Path(cwd or Path(__file__).resolve().parent)
    commit = _git(["rev-parse", "HEAD"], cwd)
    if not commit:
        return {"git_commit": "unknown", "git_dirty": "unknown"}
    status = _git(["status", "--porcelain", "--untracked-files=no"], cwd)
    return {"git_commit": commit, "git_dirty": "unknown" if status is None else bool(status)}


def _triton_version() -> str:
    try:
        import triton
    except ImportError:
        return "not installed"
    return triton.__version__


def gpu_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return "cpu"


def device_name(device: torch.device) -> str:
    """The device in words, for titles: the GPU's name, or ``CPU (<model>, N cores)``."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f
                          if line.startswith("model name")), model)  # fmt: skip
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"CPU ({model}, {cores} cores)" if model else f"CPU ({cores} cores)"


def slug(text: str) -> str:
    """'NVIDIA H200' -> 'nvidia-h200' (for file names)."""
    out = "".join(c.lower() if c.isalnum() else "-" for c in text)
    while "--" in out:
        out = out.replace("--", "-")
    return out.strip("-") or "unknown"


def portable_command(argv: list[str], cwd: str | None = None) -> str:
    """The command line as someone else would type it: ``python -m vidsparse.bench ...`` for
    the package's entry, no interpreter path, and absolute paths relative to the working
    folder (else their file name), so a result file names no folder of the machine it ran on."""
    cwd = os.path.realpath(cwd or os.getcwd())

    def portable(arg: str) -> str:
        if not os.path.isabs(arg):
            return arg
        real = os.path.realpath(arg)
        inside = os.path.commonpath([real, cwd]) == cwd
        return os.path.relpath(real, cwd) if inside else os.path.basename(arg)

    program, *args = argv or [""]
    if program.endswith(os.path.join("vidsparse", "bench", "__main__.py")):
        head = ["python", "-m", "vidsparse.bench"]
    elif os.path.basename(program) == "vidsparse":
        head = ["vidsparse"]
    else:
        head = ["python", portable(program)]
    return shlex.join([*head, *(portable(a) for a in args)])


def collect_metadata(device: torch.device, **extra) -> dict:
    """Where and how a run was made: GPU, library versions, git commit, date, command line."""
    meta = {
        "gpu": gpu_name(device),
        "device": str(device),
        "torch": torch.__version__,
        "triton": _triton_version(),
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "platform": platform.platform(),
        **git_info(),
        "date_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": portable_command(sys.argv),
        "timer": timer_label(device),
        "flops_convention": (
            "4*D*attended (query, key) token pairs summed over batch and heads; "
            "bwd 2.5x, fwd+bwd 3.5x the forward"
        ),
        "env": {k: v for k, v in os.environ.items() if k.startswith(("VIDSPARSE_", "TRITON_"))},
    }
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        props = torch.cuda.get_device_properties(device)
        meta["capability"] = f"sm_{major}{minor}"
        meta["sm_count"] = props.multi_processor_count
        meta["gpu_memory_gb"] = round(props.total_memory / 1e9, 1)
        meta["cudnn"] = torch.backends.cudnn.version()
    meta.update(extra)
    return meta


# ---------------------------------------------------------------------------------------------
# output: JSON, table, plot
# ---------------------------------------------------------------------------------------------


def _json_safe(value):
    """NaN and inf are not JSON: write them as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def write_results(path: str | Path, meta: dict, rows: list[dict]) -> Path:
    """Write ``{"meta": ..., "rows": [...]}`` as indented JSON, creating parent folders."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = _json_safe({"meta": meta, "rows": rows})
    path.write_text(json.dumps(payload, indent=2, allow_nan=False) + "\n")
    return path


def emit_tuning_rows(filename: str, rows: list[dict], benchmark: str, **meta_extra) -> None:
    """A tuning script's ending (``benchmarks/tuning/``): ``$OUT/<filename>`` where ``OUT`` is
    set (the GPU run's metadata with ``benchmark`` and ``meta_extra``), then each row printed
    as JSON."""
    out = os.environ.get("OUT")
    if out:
        meta = collect_metadata(torch.device("cuda"), benchmark=benchmark, **meta_extra)
        write_results(Path(out) / filename, meta, rows)
    for row in rows:
        print(json.dumps(_json_safe(row)))


def report_results(path, meta: dict, rows: list[dict], columns, shown=None) -> Path:
    """A benchmark's ending: the JSON written, its table printed (``shown`` rows, default
    all), and where the JSON went."""
    path = write_results(path, meta, rows)
    print_table(rows if shown is None else shown, columns)
    print(f"wrote {path}", flush=True)
    return path


@dataclass(frozen=True)
class Column:
    """A table column: the row key, its header and a format spec for numbers."""

    key: str
    header: str
    fmt: str = ""


def _cell(value, fmt: str) -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and fmt:
        return "-" if not math.isfinite(value) else format(value, fmt)
    return str(value)


def format_table(rows: Iterable[dict], columns: Sequence[Column]) -> str:
    """Aligned text table; numbers right-aligned, text left-aligned. A row with an ``error``
    shows it after the columns (errors are long; they would widen every row)."""
    rows = list(rows)
    cells = [[_cell(row.get(c.key), c.fmt) for c in columns] for row in rows]
    widths = [max([len(c.header)] + [len(r[i]) for r in cells]) for i, c in enumerate(columns)]
    numeric = [
        all(isinstance(row.get(c.key), (int, float)) or row.get(c.key) is None for row in rows)
        for c in columns
    ]

    def line(values):
        parts = [v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric)]
        return "  ".join(parts).rstrip()

    out = [line([c.header for c in columns]), line(["-" * w for w in widths])]
    for row, values in zip(rows, cells):
        text = line(values)
        if row.get("error"):
            text += f"  ERROR {row['error']}"
        out.append(text)
    return "\n".join(out)


def print_table(rows: Iterable[dict], columns: Sequence[Column]) -> None:
    print(format_table(rows, columns), flush=True)


def print_progress(what: str, row: dict) -> None:
    """One finished case's line: ``what``, then its time and TFLOP/s, or its error."""
    if row.get("error"):
        print(f"{what}: ERROR {row['error']}", flush=True)
    else:
        print(f"{what}: {row['ms']:.3f} ms, {row['tflops']:.1f} TFLOP/s", flush=True)


def split_choices(
    text: str, allowed: Sequence[str], what: str, *, allow_empty: bool = False
) -> list[str]:
    """The items of the comma list ``text``, in order, each one of ``allowed``; else
    ``SystemExit`` naming the unknown ``what`` (an empty list too, unless ``allow_empty``)."""
    items = [t.strip() for t in text.split(",") if t.strip()]
    unknown = [t for t in items if t not in allowed]
    if unknown or not (items or allow_empty):
        raise SystemExit(f"unknown {what} {unknown}; choose from {list(allowed)}")
    return items


def plot(
    path: str | Path,
    rows: list[dict],
    *,
    x: str,
    y: str,
    series: Sequence[str],
    panels: Sequence[str],
    reference: Callable[[dict], bool] | None = None,
    xlabel: str | None = None,
    ylabel: str | None = None,
    title: str = "",
    logx: bool = True,
) -> Path | None:
    """One panel per distinct value of ``panels`` keys, one line per ``series`` keys, ``y``
    against ``x``; rows for which ``reference(row)`` is true are drawn as horizontal dashed
    lines (dense baselines have no x). Rows with an error or no ``y`` are skipped.

    matplotlib is imported here, lazily; without it the plot is skipped with a message.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib is not installed: skipping the plot {path}", flush=True)
        return None

    good = [r for r in rows if not r.get("error") and r.get(y) is not None]
    panel_keys = sorted({tuple(r.get(k) for k in panels) for r in good}, key=str)
    if not panel_keys:
        print(f"nothing to plot: no successful rows for {path}", flush=True)
        return None
    styles = series_styles(good, series)
    ncols = min(3, len(panel_keys))
    nrows = math.ceil(len(panel_keys) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(5.5 * ncols, 4.2 * nrows), squeeze=False)
    for ax, pkey in zip(axes.flat, panel_keys):
        in_panel = [r for r in good if tuple(r.get(k) for k in panels) == pkey]
        _plot_panel(ax, in_panel, x=x, y=y, series=series, reference=reference, styles=styles)
        ax.set_title(" / ".join(str(v) for v in pkey), fontsize=9)
        ax.set_xlabel(xlabel or x)
        ax.set_ylabel(ylabel or y)
        if logx:
            ax.set_xscale("log", base=2)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panel_keys) :]:
        ax.set_visible(False)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


_COLOURS = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown",
            "tab:pink", "tab:gray", "tab:olive", "tab:cyan")  # fmt: skip
_LINESTYLES = ("-", "--", "-.", ":", (0, (5, 1, 1, 1, 1, 1)), (0, (3, 1)))
_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")


def series_styles(rows: list[dict], series: Sequence[str]) -> dict[tuple, dict]:
    """One style per series over all panels: its own colour, line style and marker, so that
    no two lines look alike and a provider keeps its colour from panel to panel."""
    names = sorted({tuple(r.get(k) for k in series) for r in rows}, key=str)
    return {
        name: {
            "color": _COLOURS[i % len(_COLOURS)],
            "linestyle": _LINESTYLES[i % len(_LINESTYLES)],
            "marker": _MARKERS[i % len(_MARKERS)],
        }
        for i, name in enumerate(names)
    }


def _plot_panel(ax, rows, *, x, y, series, reference, styles):
    refs = [r for r in rows if reference is not None and reference(r)]
    lines = [r for r in rows if r not in refs]
    names = sorted({tuple(r.get(k) for k in series) for r in lines}, key=str)
    for name in names:
        pts = sorted((r[x], r[y]) for r in lines if tuple(r.get(k) for k in series) == name)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], label=" ".join(map(str, name)),
                **styles[name])  # fmt: skip
    for r in refs:
        name = tuple(r.get(k) for k in series)
        style = styles[name]
        label = " ".join(map(str, name)) + " (dense)"
        ax.axhline(r[y], linewidth=1.2, label=label, color=style["color"],
                   linestyle=style["linestyle"])  # fmt: skip
