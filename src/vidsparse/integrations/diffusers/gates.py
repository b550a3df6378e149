"""Trained VSA gates in and out of checkpoints.

A patched transformer with ``gate=True`` holds one :class:`vidsparse.nn.VSAGate` per layer as
``<block>.to_gate_compress``, so ``save_pretrained`` writes ``<block>.to_gate_compress.weight``
and ``.bias`` with the model's weights, and the method's options under ``vidsparse`` in its
``config.json``. FastVideo's VSA checkpoints of Wan use the same keys
(``blocks.<i>.to_gate_compress``). Stock ``from_pretrained`` drops the gate keys (the stock
model has no such modules); :func:`load_sparse_attention` reads them back.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from vidsparse.integrations.diffusers.methods import GATE_MODULE_NAME
from vidsparse.integrations.diffusers.state import state_of

CONFIG_KEY = "vidsparse"  # the transformer config's entry for the method and its options
_PARAMS = ("weight", "bias")


@dataclass
class GateSource:
    """One transformer's gates (and saved options, when the source had a config)."""

    state_dict: dict[str, torch.Tensor]
    config: dict | None
    origin: str


def read_gate_source(source, names: list[str], pipeline: bool) -> dict[str, GateSource]:
    """Per transformer name, the gate tensors and saved options found in ``source``."""
    if pipeline:
        if isinstance(source, dict) and set(source) <= set(names) and source:
            missing = [n for n in names if n not in source]
            if missing:
                raise ValueError(f"no gate source given for {missing}")
            return {n: _one_source(source[n]) for n in names}
        if len(names) > 1 or _is_pipeline_folder(source, names[0]):
            root = Path(source)
            return {n: _one_source(root / n) for n in names}
    return {names[0]: _one_source(source)}


def _is_pipeline_folder(source, name: str) -> bool:
    """A folder holding the transformer's subfolder (``pipe.save_pretrained``'s layout)."""
    return not isinstance(source, dict) and (Path(os.fspath(source)) / name).is_dir()


def _one_source(source) -> GateSource:
    if isinstance(source, dict):
        return GateSource(_gate_entries(source, "the state dict"), None, "the state dict")
    path = Path(os.fspath(source))
    if path.is_dir():
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise ValueError(f"{str(path)!r} holds no .safetensors files")
        state: dict[str, torch.Tensor] = {}
        for file in files:
            state.update(_read_gate_tensors(file))
        config_file = path / "config.json"
        config = None
        if config_file.is_file():
            config = json.loads(config_file.read_text()).get(CONFIG_KEY)
        return GateSource(_gate_entries(state, str(path)), config, str(path))
    if path.suffix == ".safetensors" and path.is_file():
        return GateSource(_gate_entries(_read_gate_tensors(path), str(path)), None, str(path))
    raise ValueError(f"gate source {str(path)!r} is not a folder or a .safetensors file")


def _read_gate_tensors(file: Path) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    with safe_open(str(file), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys() if _is_gate_key(k)}  # noqa: SIM118


def _is_gate_key(key: str) -> bool:
    parts = key.rsplit(".", 2)
    return len(parts) == 3 and parts[1] == GATE_MODULE_NAME and parts[2] in _PARAMS


def _gate_entries(state: dict, origin: str) -> dict[str, torch.Tensor]:
    gates = {k: v for k, v in state.items() if _is_gate_key(k)}
    if not gates:
        raise ValueError(f"{origin} holds no VSA gates (keys '<block>.{GATE_MODULE_NAME}.weight')")
    return gates


def apply_saved_config(source: GateSource, method: str, options: dict) -> dict:
    """The options to apply: those saved with the gates, overridden by ``options``."""
    saved = dict(source.config or {})
    saved_method = saved.pop("method", method)
    if saved_method != method:
        raise ValueError(f"{source.origin} was saved with method={saved_method!r}, not {method!r}")
    saved.pop("gate", None)
    merged = {**saved, **options}
    if "tile" in merged and isinstance(merged["tile"], list):
        merged["tile"] = tuple(merged["tile"])
    if "sparsity" not in merged and "topk" not in merged:
        raise ValueError(f"{source.origin} has no saved VSA options: pass sparsity=... or topk=...")
    return merged


def load_gate_state(transformer, gates: dict[str, torch.Tensor]) -> None:
    """Copy ``gates`` into the patched transformer's gate modules; ``ValueError`` naming the
    keys that are missing, unknown, or of another shape."""
    state = state_of(transformer)
    expected = {}
    for path, _ in state.layers:
        block = path.rpartition(".")[0]
        module = transformer.get_submodule(f"{block}.{GATE_MODULE_NAME}")
        for param in _PARAMS:
            tensor = getattr(module, param)
            if tensor is not None:
                expected[f"{block}.{GATE_MODULE_NAME}.{param}"] = tensor
    missing = sorted(set(expected) - set(gates))
    unknown = sorted(set(gates) - set(expected))
    if missing or unknown:
        raise ValueError(
            f"the gates do not fit this {type(transformer).__name__} ({len(state.layers)} "
            f"layers): missing {missing[:4]}{' ...' if len(missing) > 4 else ''}, unknown "
            f"{unknown[:4]}{' ...' if len(unknown) > 4 else ''}"
        )
    for key, tensor in expected.items():
        if tuple(gates[key].shape) != tuple(tensor.shape):
            raise ValueError(
                f"gate {key} has shape {tuple(gates[key].shape)}, this model's "
                f"{tuple(tensor.shape)} (a checkpoint of another model)"
            )
    with torch.no_grad():
        for key, tensor in expected.items():
            tensor.copy_(gates[key])
