"""Run one ``vidsparse.bench`` command under ``configs.override(...)``: a whole benchmark
measured with a tuning switch set, before that switch becomes the library's default (e.g. the
compiled training step's time and peak memory with o stored through the token map)::

    PYTHONPATH=src python benchmarks/tuning/bench_with_override.py out_rows=true -- \\
        e2e --train --compile blocks --out out/e2e_train_compiled_out_rows.json

Each ``name=value`` before ``--`` is a field of ``configs.Overrides`` (``true``/``false``,
integers, or ``none``), or ``gluon.NAME=value`` a field of the Hopper forward's
``configs.GluonOptions`` (the library's ``configs.GLUON`` with those fields replaced, e.g.
``gluon.PERSISTENT=true``); what follows ``--`` is the bench command line. The JSON the command
writes (its ``--out``) gets the overrides in its ``meta``, so the file says what it measured.
A command that starts with ``pytest`` runs those tests under the overrides instead (e.g. a GPU
test with a new default switched off: ``tile_pool=false -- pytest -m gpu tests/...``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

_WORDS = {"true": True, "false": False, "none": None}


def parse_overrides(pairs: list[str]) -> dict:
    """``{"out_rows": True, "gluon.PERSISTENT": True, ...}`` from ``["out_rows=true",
    "gluon.PERSISTENT=true", ...]``."""
    from vidsparse.ops.block_sparse_attn import configs

    fields = set(configs.Overrides.__dataclass_fields__)
    fields |= {f"gluon.{name}" for name in configs.GluonOptions.__dataclass_fields__}
    out = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or name not in fields:
            raise SystemExit(
                f"not a configs.Overrides field=value: {pair!r} (fields: {sorted(fields)})"
            )
        out[name] = _value(value)
    return out


def _value(text: str):
    """true / false / none, an integer, or the text itself (``one_pass=ordered``)."""
    if text.lower() in _WORDS:
        return _WORDS[text.lower()]
    try:
        return int(text)
    except ValueError:
        return text


def as_override_kwargs(parsed: dict) -> dict:
    """``configs.override``'s keywords: the ``gluon.*`` fields folded into one
    ``GluonOptions``."""
    from dataclasses import replace

    from vidsparse.ops.block_sparse_attn import configs

    kwargs = {name: value for name, value in parsed.items() if not name.startswith("gluon.")}
    gluon = {name[len("gluon.") :]: v for name, v in parsed.items() if name.startswith("gluon.")}
    if gluon:
        kwargs["gluon"] = replace(configs.GLUON, **gluon)
    return kwargs


def _out_path(argv: list[str]) -> Path | None:
    if "--out" in argv and argv.index("--out") + 1 < len(argv):
        return Path(argv[argv.index("--out") + 1])
    return None


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        raise SystemExit(__doc__)
    split = argv.index("--")
    overrides, command = parse_overrides(argv[:split]), argv[split + 1 :]
    from vidsparse.bench.runner import main as bench_main
    from vidsparse.ops.block_sparse_attn import configs

    print(f"configs.override({overrides})", flush=True)
    if command[:1] == ["pytest"]:
        import pytest

        with configs.override(**as_override_kwargs(overrides)):
            return int(pytest.main(command[1:]))
    with configs.override(**as_override_kwargs(overrides)):
        code = bench_main(command)
    record_in_meta(command, "overrides", overrides)
    return code


def record_in_meta(command: list[str], key: str, value) -> None:
    """Add ``key: value`` to the ``meta`` of the JSON the bench command wrote (its
    ``--out``), so the file says what it measured."""
    out = _out_path(command)
    if out is not None and out.is_file():
        payload = json.loads(out.read_text())
        payload["meta"][key] = value
        out.write_text(json.dumps(payload, indent=2) + "\n")


if __name__ == "__main__":
    sys.exit(main())
