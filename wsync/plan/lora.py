"""LoRA adapter size for a model, rank and MoE layout: the bytes a LoRA sync moves.

Layouts (what differs is only the routed experts; every other target gets one
A (r x d_in) and one B (d_out x r) per layer):

- `per-expert`: every routed expert has its own A and B.
- `shared-outer`: per MoE layer, the factor on the model-width ("outer") side is
  shared by all experts and the factor on the expert-width side is per expert:
  gate/up share A (r x hidden) and keep B (expert_i x r) per expert; down keeps A
  (r x expert_i) per expert and shares B (hidden x r). This is the layout Together's
  xorl calls "hybrid shared LoRA" (moe_hybrid_shared_lora), and the one that
  reproduces the published shared-outer sizes.
- `dense`: routed experts frozen; LoRA on attention, dense MLP and shared experts.

The published figures (Qwen3-30B-A3B, GLM-4.7, Kimi K2.6 at r=32) follow from:
targets = every linear layer of the decoder (attention incl. MLA projections,
dense MLP, shared and routed experts; MTP layers too when the checkpoint ships
them), not the router, embeddings, LM head or vision tower; adapters stored in
bf16; GB = 1e9 bytes. fp32 adapters would be twice the published sizes.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .models import ModelConfig, PlanError
from .params import Site, dtype_bytes, sites

LAYOUTS = ("shared-outer", "per-expert", "dense")

# --targets accepts these group names, "all-linear", or module names (q_proj, kv_b_proj, down_proj, ...).
TARGET_GROUPS = {
    "all-linear": ("attention", "dense_mlp", "shared_experts", "routed_experts", "mtp_proj"),
    "attention": ("attention",),
    "mlp": ("dense_mlp", "shared_experts", "routed_experts"),
    "experts": ("routed_experts",),
    "dense_mlp": ("dense_mlp",),
    "shared_experts": ("shared_experts",),
}


@dataclass(frozen=True, kw_only=True)
class LoraConfig:
    """What an adapter covers."""

    rank: int = 32  # LoRA rank r
    layout: str = "shared-outer"  # one of LAYOUTS; only matters for routed experts
    targets: tuple[str, ...] = ("all-linear",)  # groups or module names, see TARGET_GROUPS
    dtype: str = "bf16"  # dtype the adapter is stored and shipped in
    include_mtp: bool = True  # adapt MTP layers when the checkpoint has them


@dataclass(frozen=True, kw_only=True)
class LoraSize:
    params: int  # adapter parameters
    bytes: int  # adapter bytes in the chosen dtype
    by_module: dict[str, int] = field(default_factory=dict)  # parameters per module name


def _selected(site: Site, targets: tuple[str, ...]) -> bool:
    module = site.name.rsplit(".", 1)[-1]
    for t in targets:
        if t in TARGET_GROUPS and site.group in TARGET_GROUPS[t]:
            return True
        if t == module or t == site.name:
            return True
    return False


def site_lora_params(site: Site, rank: int, layout: str) -> int:
    """Adapter parameters of one site over all its layers."""
    if site.group != "routed_experts":
        return site.layers * rank * (site.d_in + site.d_out)
    if layout == "dense":
        return 0
    if layout == "per-expert":
        return site.layers * site.experts * rank * (site.d_in + site.d_out)
    # shared-outer: the model-width side is shared (gate/up read the hidden state, down writes it)
    down = site.name.endswith("down_proj")
    outer, inner = (site.d_out, site.d_in) if down else (site.d_in, site.d_out)
    return site.layers * rank * (outer + site.experts * inner)


def _check(m: ModelConfig, cfg: LoraConfig) -> None:
    if cfg.layout not in LAYOUTS:
        raise PlanError(f"unknown LoRA layout {cfg.layout!r}; use one of {', '.join(LAYOUTS)}")
    if cfg.rank <= 0:
        raise PlanError(f"LoRA rank must be positive, got {cfg.rank}")
    dtype_bytes(cfg.dtype)
    names = {s.name.rsplit(".", 1)[-1] for s in sites(m)} | {s.name for s in sites(m)}
    unknown = [t for t in cfg.targets if t not in TARGET_GROUPS and t not in names]
    if unknown:
        raise PlanError(f"LoRA targets {unknown} match nothing in {m.name}; use {', '.join(TARGET_GROUPS)} "
                        f"or module names: {', '.join(sorted(names))}")


def lora_size(m: ModelConfig, cfg: LoraConfig | None = None) -> LoraSize:
    """Adapter parameters and bytes for a model under a LoRA config."""
    cfg = cfg or LoraConfig()
    _check(m, cfg)
    by_module: dict[str, int] = {}
    for s in sites(m, include_mtp=cfg.include_mtp):
        if _selected(s, cfg.targets):
            n = site_lora_params(s, cfg.rank, cfg.layout)
            key = ("mtp." if s.mtp else "") + s.name
            by_module[key] = by_module.get(key, 0) + n
    params = sum(by_module.values())
    return LoraSize(params=params, bytes=int(params * dtype_bytes(cfg.dtype)), by_module=by_module)


def lora_bytes(m: ModelConfig, *, rank: int = 32, layout: str = "shared-outer", dtype: str = "bf16",
               targets: tuple[str, ...] = ("all-linear",)) -> int:
    return lora_size(m, LoraConfig(rank=rank, layout=layout, dtype=dtype, targets=targets)).bytes
