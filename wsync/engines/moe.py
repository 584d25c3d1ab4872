"""Mixture-of-experts weights under two namings: experts fused in 3-D tensors, or one module per expert.

transformers 5 stores a Qwen3-MoE layer's experts as two 3-D parameters,
``mlp.experts.gate_up_proj`` [E, 2I, H] (each expert's gate rows, then its up
rows) and ``mlp.experts.down_proj`` [E, H, I]. Trainers built on the older
layout (and Megatron exports) name every expert's Linear on its own:
``mlp.experts.{e}.gate_proj.weight`` [I, H], ``up_proj.weight`` [I, H],
``down_proj.weight`` [H, I]. Either side may hold either naming.

The mapping is data, computed once when the engine's tensors are bound:

- ``experts="per_expert"`` (the trainer names experts one by one, the engine
  fuses them): each fused engine tensor is presented as its per-expert slices,
  which are contiguous views of it, so every expert is written in place.
- ``experts="fused"`` (the trainer publishes 3-D tensors, the engine has a
  module per expert): each fused trainer name is presented as a virtual tensor
  whose pieces are the engine's per-expert parameters in the fused order
  (tables.Table); the codec writes straight into them.
"""
from __future__ import annotations

import re
from collections import defaultdict

from ..errors import MismatchError
from ..snapshot import TensorBits, to_bits
from ..tables import Table

MODES = ("per_expert", "fused")
_FUSED = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<proj>gate_up_proj|down_proj)$")
_PER_EXPERT = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")


def split_fused(named: dict) -> dict:
    """Engine tensors with fused 3-D experts -> the same memory under per-expert names (views, in order)."""
    out = {}
    for name, t in named.items():
        m = _FUSED.match(name)
        if m is None or t.dim() != 3:
            out[name] = t
            continue
        prefix, proj = m["prefix"], m["proj"]
        for e in range(t.shape[0]):
            if proj == "down_proj":
                out[f"{prefix}.{e}.down_proj.weight"] = t[e]
                continue
            rows = t.shape[1]
            if rows % 2:
                raise MismatchError(f"{name}: {rows} rows do not split into gate and up halves")
            out[f"{prefix}.{e}.gate_proj.weight"] = t[e, : rows // 2]
            out[f"{prefix}.{e}.up_proj.weight"] = t[e, rows // 2 :]
    return out


def fuse_per_expert(named: dict) -> dict:
    """Engine tensors with a module per expert -> fused 3-D names, each a TensorBits over a Table of the pieces."""
    groups: dict[tuple[str, str], dict[int, dict[str, object]]] = defaultdict(lambda: defaultdict(dict))
    out = {}
    for name, t in named.items():
        m = _PER_EXPERT.match(name)
        if m is None:
            out[name] = t
            continue
        fused = "down_proj" if m["proj"] == "down_proj" else "gate_up_proj"
        key = (m["prefix"], fused)
        groups[key][int(m["e"])][m["proj"]] = t
    for (prefix, fused), experts in groups.items():
        order = ("down_proj",) if fused == "down_proj" else ("gate_proj", "up_proj")
        count = len(experts)
        if sorted(experts) != list(range(count)):
            raise MismatchError(f"{prefix}: experts {sorted(experts)[:5]}... are not numbered 0..{count - 1}")
        pieces = []
        for e in range(count):
            missing = [p for p in order if p not in experts[e]]
            if missing:
                raise MismatchError(f"{prefix}.{e}: no {missing} to fuse into {fused}")
            pieces += [to_bits(experts[e][p]) for p in order]
        shapes = {tb.shape for tb in pieces}
        dts = {tb.dtype for tb in pieces}
        if len(shapes) != 1 or len(dts) != 1:
            raise MismatchError(f"{prefix}: experts differ in shape or dtype ({sorted(map(str, shapes))[:3]})")
        (rows, cols), dt = next(iter(shapes)), next(iter(dts))
        shape = (count, rows * len(order), cols)
        out[f"{prefix}.{fused}"] = TensorBits(dt, shape, Table([tb.bits for tb in pieces], dt.bits_dtype))
    return out


def apply_mode(named: dict, mode: str | None) -> dict:
    if mode is None:
        return named
    if mode == "per_expert":
        return split_fused(named)
    if mode == "fused":
        return fuse_per_expert(named)
    raise ValueError(f"experts must be one of {MODES} or None, got {mode!r}")


def is_virtual(t) -> bool:
    return isinstance(t, TensorBits) and isinstance(t.bits, Table)

