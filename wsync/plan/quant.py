"""A quantized checkpoint's bytes per version: its layout (codes, scales, the BF16 rest) and its delta, sized from
the fractions of each part that change per version as `wsync bench quant` measured them on real RL steps.

A delta of quantized weights is not a fraction of the checkpoint's bytes as a BF16 delta is: an INT4 code
changes far less often than the BF16 value it rounds, its scale more often than the code, and the BF16 tensors
left unquantized change as any BF16 tensor does. So each part is priced on its own: its elements x the fraction
measured to change x the delta bytes measured per changed element.
"""
from __future__ import annotations

from dataclasses import dataclass

from . import measured
from .models import ModelConfig
from .params import checkpoint_parts, dtype_bytes

# The learning rate of the measured quantized deltas the planner prices from: RL post-training's, as the codec
# speeds' runs are.
QUANT_LR = "1e-06"
_QUANT_FRACTION = {"codes": "codes", "scales": "scales", "rest": "bf16_rest"}


@dataclass(frozen=True, kw_only=True)
class QuantPart:
    """One part of a quantized checkpoint's delta: its bytes in the checkpoint and what a version changes."""

    full_bytes: float  # the part's bytes in the checkpoint
    element_bytes: float  # bytes of one element (an INT4 code: 0.5)
    fraction_changed: float  # of its elements, per version (measured)
    bytes_per_changed: float  # delta bytes per changed element (measured)

    @property
    def delta_bytes(self) -> float:
        return self.full_bytes / self.element_bytes * self.fraction_changed * self.bytes_per_changed


@dataclass(frozen=True, kw_only=True)
class QuantDelta:
    """A quantized checkpoint's delta per version: each part's elements x measured fraction changed x measured
    bytes per changed element; the weights' shapes never change and cost nothing."""

    layout: str  # e.g. "int4-g32"
    parts: dict[str, QuantPart]  # codes, scales, rest (the BF16 tensors left unquantized)
    source: str  # the measured run: file, scheme, lr, versions, state, machine

    @property
    def bytes(self) -> float:
        return sum(p.delta_bytes for p in self.parts.values())


def layout_name(m: ModelConfig) -> str:
    return f"int{m.quant.bits}-g{m.quant.group_size}" if m.quant else m.dtype


def _same_format(config: dict, q) -> bool:
    """config (a measured run's quantization_config) stores weights as q does: pack-quantized, same bits and group."""
    if config.get("quant_method") != "compressed-tensors" or config.get("format") != "pack-quantized":
        return False
    weights = [g.get("weights") or {} for g in (config.get("config_groups") or {}).values()]
    return any(w.get("num_bits") == q.bits and w.get("group_size") == q.group_size for w in weights)


def quantized_delta(m: ModelConfig, inputs: dict | None = None) -> QuantDelta | None:
    """The delta of m's quantized checkpoint from the measured `wsync bench quant` run of its format (None: m is not
    quantized, or no run of its format at QUANT_LR is in the measured inputs)."""
    q = m.quant
    entry = (inputs if inputs is not None else measured.inputs()).get("quant") if q else None
    if not entry:
        return None
    name = next((n for n, s in entry["schemes"].items() if _same_format(s["config"], q)), None)
    per = entry["schemes"][name]["per_version"].get(QUANT_LR) if name else None
    if per is None:
        return None
    full = checkpoint_parts(m)
    width = {"codes": q.bits / 8, "scales": q.scale_bytes, "rest": dtype_bytes(m.dtype)}
    parts = {k: QuantPart(full_bytes=full[k], element_bytes=width[k],
                          fraction_changed=per["fraction_changed"][_QUANT_FRACTION[k]],
                          bytes_per_changed=per["bytes_per_changed"][k]) for k in width}
    mc = entry["machine"]
    source = (f"{entry['file']}: scheme {name}, lr {QUANT_LR}, {per['versions']} version(s); {entry['source']}, "
              f"each MLP cut into {entry['experts']} experts; {mc['cpu']}, {mc['cores']} cores")
    return QuantDelta(layout=layout_name(m), parts=parts, source=source)
