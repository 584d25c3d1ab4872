"""A model's quantization config -> a Quantizer that makes that checkpoint's format.

Two families are read, as the engines read them:

- compressed-tensors (``"quant_method": "compressed-tensors"``): every config group's ``targets`` and
  ``weights`` args, and the ``ignore`` list. Symmetric INT4 groups in "pack-quantized" format (Kimi K2's
  routed experts) and symmetric INT8 channels ("int-quantized" / "naive-quantized", W8A8) are supported.
- block FP8 (``"quant_method": "fp8"`` with ``weight_block_size``: DeepSeek-V3, Qwen3-FP8): every Linear
  but the ``ignored_layers`` / ``modules_to_not_convert``.

Anything else is refused by name, never approximated: a format the engine would read differently from what we
send is the failure this package exists to prevent.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from .quantizer import Quantizer, Rule
from .ref import QuantizeError
from .schemes import Fp8Block, Int4Group, Int8Channel

INT_FORMATS = {"pack-quantized": 4, "int-quantized": 8, "naive-quantized": 8}


def read_config(source) -> dict:
    """The quantization_config in `source`: a checkpoint folder or its config.json, a transformers config, a
    model config dict, or the quantization_config itself."""
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        path = path / "config.json" if path.is_dir() else path
        source = json.loads(path.read_text())
    if not isinstance(source, dict):
        source = getattr(source, "quantization_config", None)
        if source is not None and not isinstance(source, dict):
            source = source.to_dict()
        if source is None:
            raise QuantizeError("this config has no quantization_config")
    if "quantization_config" in source:
        source = source["quantization_config"]
    if not isinstance(source, dict) or "quant_method" not in source:
        raise QuantizeError("no quantization_config with a quant_method found in this config")
    if hasattr(source, "to_dict"):
        source = source.to_dict()
    return source


def from_config(source, *, model=None, backend: str | None = None) -> Quantizer:
    """A Quantizer making the checkpoint format `source`'s quantization_config describes (see read_config)."""
    cfg = read_config(source)
    method = cfg["quant_method"]
    if method == "compressed-tensors":
        rules = [Rule(tuple(_targets(group, name)), _int_scheme(group, cfg.get("format"), name))
                 for name, group in sorted((cfg.get("config_groups") or {}).items())]
        return Quantizer(rules, cfg.get("ignore") or (), model=model, backend=backend)
    if method == "fp8":
        block = cfg.get("weight_block_size")
        if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
            raise QuantizeError(f"fp8 without a [rows, cols] weight_block_size ({block!r}) is per-tensor FP8, "
                                "which wsync does not make")
        ignore = list(cfg.get("ignored_layers") or ()) + list(cfg.get("modules_to_not_convert") or ())
        return Quantizer([Rule(("Linear",), Fp8Block(tuple(block)))], ignore, model=model, backend=backend)
    raise QuantizeError(f"quant_method {method!r} is not one wsync makes (compressed-tensors INT4 pack-quantized "
                        "or INT8, and block fp8)")


def _targets(group: dict, name: str) -> list[str]:
    targets = group.get("targets")
    if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets) or not targets:
        raise QuantizeError(f"config group {name!r}: targets must be a non-empty list of names, got {targets!r}")
    return targets


def _int_scheme(group: dict, default_format, name: str):
    w = group.get("weights") or {}
    fmt = group.get("format") or default_format
    want = {"type": "int", "symmetric": True}
    if any(w.get(k) != v for k, v in want.items()) or fmt not in INT_FORMATS or w.get("num_bits") != INT_FORMATS[fmt]:
        raise QuantizeError(f"config group {name!r}: {fmt} with weights {json.dumps(w, sort_keys=True)} is not a "
                            "format wsync makes: symmetric INT4 groups as pack-quantized, or symmetric INT8 "
                            "channels as int-quantized")
    if w["num_bits"] == 4:
        if w.get("strategy") != "group" or not isinstance(w.get("group_size"), int) or w["group_size"] % 8:
            raise QuantizeError(f"config group {name!r}: INT4 needs strategy 'group' with a group_size that is a "
                                f"multiple of 8, got {w.get('strategy')!r} / {w.get('group_size')!r}")
        return Int4Group(w["group_size"])
    if w.get("strategy") != "channel":
        raise QuantizeError(f"config group {name!r}: INT8 weights are made per channel, got strategy "
                            f"{w.get('strategy')!r}")
    return Int8Channel()
