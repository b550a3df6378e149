"""The package's shape: import layering (import-linter's contracts in pyproject.toml), file and
function sizes, no private names shared across modules, and no VSA names in the engine.

Every test lists all its offenders, one per line, so that one run shows the whole to-do list.
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
PACKAGE = SRC / "vidsparse"
ENGINE = PACKAGE / "ops" / "block_sparse_attn"

MAX_FILE_LINES = 800
MAX_FUNCTION_LINES = 120


def _sources() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def _parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def _report(what: str, offenders: list[str]) -> str:
    return f"{len(offenders)} {what}:\n  " + "\n  ".join(offenders)


# ------------------------------------------------------------------------------ import-linter


def test_import_contracts():
    """``lint-imports``: layers, the engine names no client, masks / search / utils import no
    Triton, no import cycles (contracts and their reasons: ``[tool.importlinter]``)."""
    exe = Path(sys.executable).with_name("lint-imports")
    if not exe.exists():
        pytest.fail(f"{exe} not found: install the test extra (pip install -e '.[test]')")
    proc = subprocess.run(
        [str(exe), str(ROOT / "pyproject.toml"), "--no-cache", "--no-logo"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, "lint-imports reports:\n" + out


def test_pure_layers_import_no_triton():
    """At run time too: importing the pure-PyTorch layers loads no Triton (the contract above
    allows the lazy kernel imports inside functions, which this import never runs)."""
    code = (
        "import json, sys\n"
        "import vidsparse.utils, vidsparse.utils.backend, vidsparse.utils.device\n"
        "import vidsparse.layout, vidsparse.masks, vidsparse.search\n"
        "print(json.dumps('triton' in sys.modules))"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert json.loads(proc.stdout.splitlines()[-1]) is False, "importing them imported Triton"


# ------------------------------------------------------------------------------ sizes


def test_no_file_over_the_line_limit():
    offenders = []
    for path in _sources():
        n = len(path.read_text(encoding="utf-8").splitlines())
        if n > MAX_FILE_LINES:
            offenders.append(f"{_rel(path)}: {n} lines")
    assert not offenders, _report(f"files over {MAX_FILE_LINES} lines", offenders)


def test_no_function_over_the_line_limit():
    offenders = []
    for path in _sources():
        for node in ast.walk(_parse(path)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    offenders.append(f"{_rel(path)}:{node.lineno} {node.name}(): {n} lines")
    assert not offenders, _report(f"functions over {MAX_FUNCTION_LINES} lines", offenders)


# ------------------------------------------------------------------------------ private names


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _module_of(path: Path) -> list[str]:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    return parts[:-1] if parts[-1] == "__init__" else parts


def _imported_module(path: Path, node: ast.ImportFrom) -> str | None:
    """The absolute name of the vidsparse module ``node`` imports from (None if not ours)."""
    if node.level:
        package = _module_of(path) if path.name == "__init__.py" else _module_of(path)[:-1]
        base = package[: len(package) - node.level + 1]
        return ".".join(base + ([node.module] if node.module else []))
    module = node.module or ""
    return module if module == "vidsparse" or module.startswith("vidsparse.") else None


def _is_module(dotted: str) -> bool:
    """Whether ``dotted`` names a module or package of the source tree (not a name in one)."""
    base = SRC.joinpath(*dotted.split("."))
    return base.with_suffix(".py").exists() or (base / "__init__.py").exists()


def _private_uses(path: Path) -> list[str]:
    """``from vidsparse.x import _y`` and ``x._y`` with ``x`` a vidsparse module imported here."""
    found, modules = [], {}
    tree = _parse(path)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (source := _imported_module(path, node)):
            for alias in node.names:
                if _is_private(alias.name):
                    found.append(f"{_rel(path)}:{node.lineno} imports {alias.name} from {source}")
                elif _is_module(f"{source}.{alias.name}"):
                    modules[alias.asname or alias.name] = f"{source}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "vidsparse" and alias.asname:
                    modules[alias.asname] = alias.name
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in modules
            and _is_private(node.attr)
        ):
            source = modules[node.value.id]
            found.append(f"{_rel(path)}:{node.lineno} uses {node.attr} of {source}")
    return found


def test_no_private_name_shared_across_modules():
    """A name another module needs is public (documented) where it is defined."""
    offenders = [use for path in _sources() for use in _private_uses(path)]
    assert not offenders, _report("private names used across modules", offenders)


# ------------------------------------------------------------------------------ the engine


# Words of VSA's vocabulary, matched against the parts of every identifier and comment word
# (snake_case and CamelCase split), so that "aggregate" is no "gate" but "has_gate" is.
VSA_WORDS = {"vsa", "coarse", "gate", "gates", "gated", "gating"}


def _word_parts(word: str) -> list[str]:
    parts = []
    for piece in word.split("_"):
        parts += re.findall(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|\d+", piece)
    return [p.lower() for p in parts]


def _vsa_words(line: str) -> list[str]:
    hits = []
    for word in re.findall(r"[A-Za-z0-9_]+", line):
        parts = _word_parts(word)
        if any(p in VSA_WORDS for p in parts) or "video_sparse" in "_".join(parts):
            hits.append(word)
    if re.search(r"video[ -]sparse", line, re.IGNORECASE):  # in prose
        hits.append("video sparse")
    return hits


def test_engine_names_no_vsa():
    """The engine serves every op: no VSA name (vsa, video_sparse, coarse, gate) in it."""
    offenders = []
    for path in sorted(ENGINE.rglob("*.py")):
        for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
            if hits := _vsa_words(line):
                offenders.append(f"{_rel(path)}:{i} {', '.join(dict.fromkeys(hits))}")
    assert not offenders, _report("VSA names in the engine", offenders)


def test_vsa_word_matching():
    """The matcher of ``test_engine_names_no_vsa`` itself."""
    assert _vsa_words("CoarseCombine(gate_scale)") == ["CoarseCombine", "gate_scale"]
    assert _vsa_words("VSA (Video Sparse Attention): video_sparse_attn") == [
        "VSA",
        "video_sparse_attn",
        "video sparse",
    ]
    assert _vsa_words("aggregate the propagated lists of navigate()") == []
