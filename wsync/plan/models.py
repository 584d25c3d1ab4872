"""Model architectures as data, parsed from Hugging Face `config.json` values.

Every figure the systems model prints starts from a model's shape: how many
bytes a full sync moves, how big a LoRA adapter is, how many FLOPs a token costs.
So the shapes live here as the published `config.json` keys themselves (see
`catalog.py`, each entry with its source), and one parser turns any such dict,
including a user's own file, into a `ModelConfig`.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..errors import WsyncError


class PlanError(WsyncError, ValueError):
    """Input the systems model cannot use: unknown model, link, codec or a bad number."""


@dataclass(frozen=True, kw_only=True)
class MLA:
    """DeepSeek-style multi-head latent attention dimensions."""

    q_lora_rank: int | None  # None: a plain q_proj instead of q_a/q_b
    kv_lora_rank: int  # width of the compressed KV latent
    qk_nope_head_dim: int  # per-head query/key dims without rotary embedding
    qk_rope_head_dim: int  # per-head rotary dims (shared across heads for keys)
    v_head_dim: int  # per-head value dims


@dataclass(frozen=True, kw_only=True)
class MoE:
    """Mixture-of-experts block shape."""

    num_experts: int  # routed experts per MoE layer
    experts_per_token: int  # routed experts each token visits
    expert_intermediate_size: int  # SwiGLU width of one routed expert
    num_shared_experts: int = 0  # always-on experts per MoE layer
    shared_intermediate_size: int = 0  # total SwiGLU width of the shared expert(s)
    first_dense_layers: int = 0  # leading layers that keep a dense MLP
    router_bias: bool = False  # fp32 e_score_correction_bias per MoE layer (noaux_tc routing)


@dataclass(frozen=True, kw_only=True)
class GroupQuant:
    """Weight-only group quantization as stored on disk (compressed-tensors pack-quantized)."""

    bits: int  # bits per weight
    group_size: int  # weights sharing one scale along the input dimension
    scale_bytes: int  # bytes per scale (bf16: 2)
    meta_bytes: int  # per-tensor extras (weight_shape int32[2]: 8)
    targets: tuple[str, ...]  # site groups it applies to, e.g. ("routed_experts",)


@dataclass(frozen=True, kw_only=True)
class VisionTower:
    """A ViT encoder with a patch-merger projector (MoonViT in Kimi K2.5/K2.6)."""

    hidden_size: int  # vt_hidden_size
    intermediate_size: int  # vt_intermediate_size
    num_layers: int  # vt_num_hidden_layers
    patch_size: int  # square patch edge in pixels
    pos_emb_cells: int  # learned position table height * width
    merge: int  # patches merged into one token by the projector (2x2 = 4)
    text_hidden_size: int  # projector output width


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """The shape of a decoder-only transformer, enough to count parameters, bytes and FLOPs."""

    name: str  # short name used on the command line
    source: str  # where the values come from (config.json URL)
    hidden_size: int
    num_layers: int  # decoder layers, MTP layers not included
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int  # dense SwiGLU width (dense layers of a MoE model too)
    vocab_size: int
    tie_embeddings: bool
    attention_bias: bool = False  # q/k/v biases (GLM-4.x)
    qk_norm: bool = False  # per-head RMSNorm on q and k (Qwen3, GLM-4.x)
    mla: MLA | None = None
    moe: MoE | None = None
    mtp_layers: int = 0  # multi-token-prediction layers shipped in the checkpoint
    mtp_own_embeddings: bool = False  # each MTP layer carries its own embed + head copy
    dtype: str = "bf16"  # dtype of unquantized weights on disk
    quant: GroupQuant | None = None
    vision: VisionTower | None = None
    notes: str = ""

    @property
    def is_moe(self) -> bool:
        return self.moe is not None


def _get(cfg: dict, *keys, default=None):
    for k in keys:
        if cfg.get(k) is not None:
            return cfg[k]
    return default


def _moe(cfg: dict) -> MoE | None:
    experts = _get(cfg, "n_routed_experts", "num_experts", "num_local_experts", default=0)
    if not experts:
        return None
    expert_i = cfg["moe_intermediate_size"]
    shared = _get(cfg, "n_shared_experts", default=0)
    shared_i = _get(cfg, "shared_expert_intermediate_size", default=shared * expert_i)
    return MoE(
        num_experts=experts, experts_per_token=cfg["num_experts_per_tok"], expert_intermediate_size=expert_i,
        num_shared_experts=shared, shared_intermediate_size=shared_i,
        first_dense_layers=_get(cfg, "first_k_dense_replace", default=0),
        router_bias=cfg.get("topk_method") == "noaux_tc" or bool(cfg.get("moe_router_bias")),
    )


def _quant(qc: dict | None) -> GroupQuant | None:
    """compressed-tensors int-group quantization; the ignore list of Kimi keeps all but routed experts."""
    if not qc:
        return None
    if qc.get("quant_method") != "compressed-tensors" or qc.get("format") != "pack-quantized":
        raise PlanError(f"quantization {qc.get('quant_method')}/{qc.get('format')} is not modelled; "
                        "only compressed-tensors pack-quantized int weights are (remove quantization_config "
                        "to count the model at its unquantized dtype)")
    w = qc["config_groups"]["group_0"]["weights"]
    ignored = " ".join(qc.get("ignore", []))
    if not all(s in ignored for s in ("self_attn", "shared_experts", "lm_head")):
        raise PlanError("only the routed-experts-only int quantization (attention, shared experts, dense MLP "
                        f"and lm_head ignored) is modelled; got ignore={qc.get('ignore')}")
    return GroupQuant(bits=w["num_bits"], group_size=w["group_size"], scale_bytes=2, meta_bytes=8,
                      targets=("routed_experts",))


def _vision(vc: dict | None, text_hidden: int) -> VisionTower | None:
    if not vc or "vt_hidden_size" not in vc:
        return None
    k = vc["merge_kernel_size"]
    return VisionTower(
        hidden_size=vc["vt_hidden_size"], intermediate_size=vc["vt_intermediate_size"],
        num_layers=vc["vt_num_hidden_layers"], patch_size=vc["patch_size"],
        pos_emb_cells=vc["init_pos_emb_height"] * vc["init_pos_emb_width"], merge=k[0] * k[1],
        text_hidden_size=vc.get("text_hidden_size", text_hidden),
    )


def from_hf_config(cfg: dict, *, name: str, source: str, notes: str = "") -> ModelConfig:
    """Parse a Hugging Face config.json dict (text_config of a VLM wrapper included)."""
    outer = cfg
    if "text_config" in cfg and "hidden_size" not in cfg:
        cfg = {**cfg["text_config"], "quantization_config": cfg["text_config"].get(
            "quantization_config", outer.get("quantization_config"))}
    try:
        heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        mla = None
        if cfg.get("kv_lora_rank"):
            mla = MLA(q_lora_rank=cfg.get("q_lora_rank"), kv_lora_rank=cfg["kv_lora_rank"],
                      qk_nope_head_dim=cfg["qk_nope_head_dim"], qk_rope_head_dim=cfg["qk_rope_head_dim"],
                      v_head_dim=cfg["v_head_dim"])
        return ModelConfig(
            name=name, source=source, hidden_size=hidden, num_layers=cfg["num_hidden_layers"],
            num_heads=heads, num_kv_heads=_get(cfg, "num_key_value_heads", default=heads),
            head_dim=_get(cfg, "head_dim", default=hidden // heads),
            intermediate_size=cfg["intermediate_size"], vocab_size=cfg["vocab_size"],
            tie_embeddings=bool(_get(cfg, "tie_word_embeddings", default=outer.get("tie_word_embeddings", False))),
            attention_bias=bool(cfg.get("attention_bias", False)), qk_norm=bool(cfg.get("use_qk_norm", False))
            or cfg.get("model_type") in ("qwen3", "qwen3_moe"),
            mla=mla, moe=_moe(cfg), mtp_layers=_get(cfg, "num_nextn_predict_layers", default=0),
            mtp_own_embeddings=bool(cfg.get("mtp_own_embeddings", False)),
            dtype={"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}.get(
                _get(cfg, "torch_dtype", "dtype", default="bfloat16"), "bf16"),
            quant=_quant(cfg.get("quantization_config")), vision=_vision(outer.get("vision_config"), hidden),
            notes=notes,
        )
    except KeyError as e:
        raise PlanError(f"config for {name!r} lacks {e.args[0]!r}: pass a Hugging Face config.json "
                        "(with hidden_size, num_hidden_layers, num_attention_heads, intermediate_size, vocab_size)") from e


def get_model(name: str) -> ModelConfig:
    """A catalog model by short name or HF repo id, or a config.json path."""
    from .catalog import CATALOG, ALIASES

    key = name.strip().lower()
    key = ALIASES.get(key, key)
    if key in CATALOG:
        e = CATALOG[key]
        return from_hf_config(e["config"], name=key, source=e["source"], notes=e.get("notes", ""))
    p = Path(name)
    if p.is_dir():
        p = p / "config.json"
    if p.suffix == ".json" and p.is_file():
        try:
            cfg = json.loads(p.read_text())
        except json.JSONDecodeError as e:
            raise PlanError(f"{p} is not valid JSON: {e}") from e
        return from_hf_config(cfg, name=p.parent.name or p.stem, source=str(p))
    raise PlanError(f"unknown model {name!r}; known: {', '.join(sorted(CATALOG))} "
                    "(or pass a path to a Hugging Face config.json)")


def model_names() -> list[str]:
    from .catalog import CATALOG

    return sorted(CATALOG)
