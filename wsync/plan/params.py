"""Parameters, bytes and per-token costs counted from a `ModelConfig`.

A model is enumerated as linear "sites" (one projection, repeated over layers
and experts) plus the few tensors that are not matmuls (embeddings, norms,
router). The same sites feed the LoRA calculator, so an adapter size and a full
checkpoint size always agree on what the model contains.
"""
from __future__ import annotations

from dataclasses import dataclass

from .models import ModelConfig, PlanError

DTYPE_BYTES = {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0, "fp8": 1.0, "int8": 1.0, "int4": 0.5}

GROUPS = ("attention", "dense_mlp", "shared_experts", "routed_experts", "mtp_proj")


@dataclass(frozen=True, kw_only=True)
class Site:
    """One linear projection: y = x W^T with W of shape (d_out, d_in)."""

    name: str  # module name as in HF checkpoints, e.g. "q_proj", "experts.gate_proj"
    group: str  # one of GROUPS
    d_in: int
    d_out: int
    layers: int  # how many layers hold it
    experts: int = 1  # copies per layer (routed experts)
    bias: bool = False
    mtp: bool = False  # lives in the multi-token-prediction layers

    @property
    def params(self) -> int:
        return self.layers * self.experts * (self.d_in * self.d_out + (self.d_out if self.bias else 0))


def dtype_bytes(dtype: str) -> float:
    try:
        return DTYPE_BYTES[dtype]
    except KeyError:
        raise PlanError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPE_BYTES)}") from None


def _attention_sites(m: ModelConfig, layers: int, mtp: bool) -> list[Site]:
    h = m.hidden_size
    if m.mla:
        a = m.mla
        qk = a.qk_nope_head_dim + a.qk_rope_head_dim
        q = ([Site(name="q_a_proj", group="attention", d_in=h, d_out=a.q_lora_rank, layers=layers, mtp=mtp),
              Site(name="q_b_proj", group="attention", d_in=a.q_lora_rank, d_out=m.num_heads * qk, layers=layers, mtp=mtp)]
             if a.q_lora_rank else
             [Site(name="q_proj", group="attention", d_in=h, d_out=m.num_heads * qk, layers=layers, mtp=mtp)])
        return q + [
            Site(name="kv_a_proj_with_mqa", group="attention", d_in=h, d_out=a.kv_lora_rank + a.qk_rope_head_dim,
                 layers=layers, mtp=mtp),
            Site(name="kv_b_proj", group="attention", d_in=a.kv_lora_rank,
                 d_out=m.num_heads * (a.qk_nope_head_dim + a.v_head_dim), layers=layers, mtp=mtp),
            Site(name="o_proj", group="attention", d_in=m.num_heads * a.v_head_dim, d_out=h, layers=layers, mtp=mtp),
        ]
    q, kv, b = m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim, m.attention_bias
    return [
        Site(name="q_proj", group="attention", d_in=h, d_out=q, layers=layers, bias=b, mtp=mtp),
        Site(name="k_proj", group="attention", d_in=h, d_out=kv, layers=layers, bias=b, mtp=mtp),
        Site(name="v_proj", group="attention", d_in=h, d_out=kv, layers=layers, bias=b, mtp=mtp),
        Site(name="o_proj", group="attention", d_in=q, d_out=h, layers=layers, mtp=mtp),
    ]


def _swiglu(prefix: str, group: str, h: int, i: int, layers: int, experts: int = 1, mtp: bool = False) -> list[Site]:
    return [Site(name=f"{prefix}{n}", group=group, d_in=din, d_out=dout, layers=layers, experts=experts, mtp=mtp)
            for n, din, dout in (("gate_proj", h, i), ("up_proj", h, i), ("down_proj", i, h))]


def _mlp_sites(m: ModelConfig, dense_layers: int, moe_layers: int, mtp: bool) -> list[Site]:
    h, out = m.hidden_size, []
    if dense_layers:
        out += _swiglu("mlp.", "dense_mlp", h, m.intermediate_size, dense_layers, mtp=mtp)
    if moe_layers and m.moe:
        e = m.moe
        if e.num_shared_experts:
            out += _swiglu("shared_experts.", "shared_experts", h, e.shared_intermediate_size, moe_layers, mtp=mtp)
        out += _swiglu("experts.", "routed_experts", h, e.expert_intermediate_size, moe_layers, e.num_experts, mtp)
    return out


def sites(m: ModelConfig, *, include_mtp: bool = True) -> list[Site]:
    """Every linear projection of the decoder (vision tower, embeddings and router excluded)."""
    dense = m.moe.first_dense_layers if m.moe else m.num_layers
    out = _attention_sites(m, m.num_layers, False) + _mlp_sites(m, dense, m.num_layers - dense, False)
    if include_mtp and m.mtp_layers:
        k = m.mtp_layers  # an MTP layer is a full decoder layer (MoE when the model is) plus eh_proj
        out += _attention_sites(m, k, True) + _mlp_sites(m, 0 if m.moe else k, k if m.moe else 0, True)
        out.append(Site(name="eh_proj", group="mtp_proj", d_in=2 * m.hidden_size, d_out=m.hidden_size, layers=k, mtp=True))
    return out


def _layer_norm_params(m: ModelConfig) -> int:
    n = 2 * m.hidden_size + (2 * m.head_dim if m.qk_norm else 0)
    if m.mla:
        n += (m.mla.q_lora_rank or 0) + m.mla.kv_lora_rank
    return n


def vision_params(m: ModelConfig) -> int:
    v = m.vision
    if v is None:
        return 0
    h, i = v.hidden_size, v.intermediate_size
    block = (3 * h * h + 3 * h) + (h * h + h) + (h * i + i) + (i * h + h) + 4 * h  # qkv, o, fc0, fc1, 2 LayerNorms
    embed = 3 * v.patch_size ** 2 * h + h + v.pos_emb_cells * h
    merged = h * v.merge
    projector = 2 * h + (merged * merged + merged) + (merged * v.text_hidden_size + v.text_hidden_size)
    return embed + v.num_layers * block + 2 * h + projector


def breakdown(m: ModelConfig) -> dict[str, int]:
    """Parameters by part; the values sum to `total_params`."""
    parts = {g: 0 for g in GROUPS}
    mtp = 0
    for s in sites(m):
        if s.mtp:
            mtp += s.params
        else:
            parts[s.group] += s.params
    v, h = m.vocab_size, m.hidden_size
    moe_layers = m.num_layers - m.moe.first_dense_layers if m.moe else 0
    router = (m.moe.num_experts * h + (m.moe.num_experts if m.moe.router_bias else 0)) if m.moe else 0
    parts["embeddings"] = v * h
    parts["lm_head"] = 0 if m.tie_embeddings else v * h
    parts["router"] = moe_layers * router
    parts["norms"] = m.num_layers * _layer_norm_params(m) + h
    if m.mtp_layers:
        k = m.mtp_layers
        mtp += k * (_layer_norm_params(m) + 3 * h + (router if m.moe else 0))  # + enorm, hnorm, head norm
        mtp += k * 2 * v * h if m.mtp_own_embeddings else 0
    parts["mtp"] = mtp
    parts["vision"] = vision_params(m)
    del parts["mtp_proj"]
    return parts


def total_params(m: ModelConfig) -> int:
    return sum(breakdown(m).values())


def active_params(m: ModelConfig) -> int:
    """Parameters one token touches in the main model (embeddings and LM head counted, MTP and vision not)."""
    p = breakdown(m)
    n = p["embeddings"] + p["lm_head"] + p["attention"] + p["dense_mlp"] + p["shared_experts"] + p["router"] + p["norms"]
    if m.moe:
        n += p["routed_experts"] * m.moe.experts_per_token // m.moe.num_experts
    return n


def checkpoint_bytes(m: ModelConfig) -> int:
    """Bytes of the checkpoint as published: unquantized tensors in `m.dtype`, quantized sites packed."""
    return int(sum(checkpoint_parts(m).values()))


def checkpoint_parts(m: ModelConfig) -> dict[str, float]:
    """The checkpoint's bytes by what they hold: {"rest": ...} for an unquantized one; a quantized one adds its
    "codes", "scales" and "shapes" (each quantized weight's weight_shape), with "rest" the unquantized tensors."""
    b = dtype_bytes(m.dtype)
    q = m.quant
    parts = {"codes": 0.0, "scales": 0.0, "shapes": 0.0} if q else {}
    rest = (total_params(m) - sum(s.params for s in sites(m))) * b
    if m.moe and m.moe.router_bias:  # e_score_correction_bias is fp32
        layers = m.num_layers - m.moe.first_dense_layers + m.mtp_layers
        rest += layers * m.moe.num_experts * (4 - b)
    for s in sites(m):
        if q and s.group in q.targets:
            n = s.layers * s.experts
            parts["codes"] += n * s.d_in * s.d_out * q.bits / 8
            parts["scales"] += n * s.d_out * (s.d_in // q.group_size) * q.scale_bytes
            parts["shapes"] += n * q.meta_bytes
        else:
            rest += s.params * b
    parts["rest"] = rest
    return parts


def weight_bytes(m: ModelConfig, dtype: str | None = None) -> int:
    """Bytes of a full sync: the published checkpoint, or every parameter in `dtype` when given."""
    if dtype is None:
        return checkpoint_bytes(m)
    return int(total_params(m) * dtype_bytes(dtype))


def kv_bytes_per_token(m: ModelConfig, dtype: str = "bf16") -> float:
    """KV-cache bytes one token of context holds (MLA caches the latent, GQA the K and V heads)."""
    if m.mla:
        per_layer = m.mla.kv_lora_rank + m.mla.qk_rope_head_dim
    else:
        per_layer = 2 * m.num_kv_heads * m.head_dim
    return m.num_layers * per_layer * dtype_bytes(dtype)


def flops_per_token(m: ModelConfig, context: int) -> float:
    """Forward FLOPs of one token at a given context length: 2 per active matmul weight + attention."""
    matmul = active_params(m) - breakdown(m)["embeddings"] - breakdown(m)["norms"]
    if m.mla:
        per_head = (m.mla.qk_nope_head_dim + m.mla.qk_rope_head_dim) + m.mla.v_head_dim
    else:
        per_head = 2 * m.head_dim
    return 2.0 * matmul + 2.0 * m.num_layers * m.num_heads * per_head * context


def tensor_count(m: ModelConfig, *, include_mtp: bool = True) -> int:
    """Tensors in a state_dict that names every routed expert on its own (the trainer's usual naming).

    One weight (and one bias, where the site has it) per linear site, layer and expert; per layer two
    norms (four with q/k norms; MLA adds its two latent norms) and, in MoE layers, the router (and its
    correction bias); the embedding, the LM head unless tied, and the final norm. Vision towers are left out.
    """
    n = sum(s.layers * s.experts * (2 if s.bias else 1) for s in sites(m, include_mtp=include_mtp))
    per_layer = 2 + (2 if m.qk_norm else 0) + (2 if m.mla else 0)
    moe_layers = m.num_layers - m.moe.first_dense_layers if m.moe else 0
    router = (2 if m.moe.router_bias else 1) if m.moe else 0
    n += m.num_layers * per_layer + moe_layers * router + 1 + (0 if m.tie_embeddings else 1) + 1
    if include_mtp and m.mtp_layers:
        n += m.mtp_layers * (per_layer + 3 + (router if m.moe else 0))
    return n
