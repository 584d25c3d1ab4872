"""Sharded trainer ranks into sharded engine ranks, for catalog models: layouts from the model's shape alone.

`wsync plan route` prints the routing plan of a real model without a GPU, a
process group or the weights: the trainer's parameters (Hugging Face names and
shapes) are enumerated from the model config, as `params.py` counts them, and
both layouts come from wsync.shard.conventions. `wsync plan transfer
--trainer-ranks M --engine-ranks N --from-plan` uses the same plan for the
busiest link's bytes. Vision towers and MTP layers are left out (engines load
them apart from the decoder); quantized sites are counted unquantized.
"""
from __future__ import annotations

from .models import ModelConfig, PlanError

_DTYPE = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def _attention(m: ModelConfig, pre: str, dt: str) -> dict[str, tuple]:
    h, s = m.hidden_size, {}
    if m.mla:
        a, qk = m.mla, m.mla.qk_nope_head_dim + m.mla.qk_rope_head_dim
        if a.q_lora_rank:
            s.update({f"{pre}.q_a_proj.weight": (a.q_lora_rank, h), f"{pre}.q_a_layernorm.weight": (a.q_lora_rank,),
                      f"{pre}.q_b_proj.weight": (m.num_heads * qk, a.q_lora_rank)})
        else:
            s[f"{pre}.q_proj.weight"] = (m.num_heads * qk, h)
        s.update({f"{pre}.kv_a_proj_with_mqa.weight": (a.kv_lora_rank + a.qk_rope_head_dim, h),
                  f"{pre}.kv_a_layernorm.weight": (a.kv_lora_rank,),
                  f"{pre}.kv_b_proj.weight": (m.num_heads * (a.qk_nope_head_dim + a.v_head_dim), a.kv_lora_rank),
                  f"{pre}.o_proj.weight": (h, m.num_heads * a.v_head_dim)})
        return s
    q, kv = m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim
    for w, rows in (("q", q), ("k", kv), ("v", kv)):
        s[f"{pre}.{w}_proj.weight"] = (rows, h)
        if m.attention_bias:
            s[f"{pre}.{w}_proj.bias"] = (rows,)
    s[f"{pre}.o_proj.weight"] = (h, q)
    if m.qk_norm:
        s.update({f"{pre}.q_norm.weight": (m.head_dim,), f"{pre}.k_norm.weight": (m.head_dim,)})
    return s


def _swiglu(pre: str, h: int, i: int) -> dict[str, tuple]:
    return {f"{pre}.gate_proj.weight": (i, h), f"{pre}.up_proj.weight": (i, h), f"{pre}.down_proj.weight": (h, i)}


def model_params(m: ModelConfig):
    """The decoder's parameters as a trainer names them (experts one by one): name -> Param."""
    from ..shard.layout import Param

    dt, h = _DTYPE.get(m.dtype, "bfloat16"), m.hidden_size
    s: dict[str, tuple] = {"model.embed_tokens.weight": (m.vocab_size, h)}
    fp32: set[str] = set()
    dense = m.moe.first_dense_layers if m.moe else m.num_layers
    for li in range(m.num_layers):
        pre = f"model.layers.{li}"
        s.update(_attention(m, f"{pre}.self_attn", dt))
        if li < dense:
            s.update(_swiglu(f"{pre}.mlp", h, m.intermediate_size))
        else:
            e = m.moe
            s[f"{pre}.mlp.gate.weight"] = (e.num_experts, h)
            if e.router_bias:
                s[f"{pre}.mlp.gate.e_score_correction_bias"] = (e.num_experts,)
                fp32.add(f"{pre}.mlp.gate.e_score_correction_bias")
            if e.num_shared_experts:
                s.update(_swiglu(f"{pre}.mlp.shared_experts", h, e.shared_intermediate_size))
            for x in range(e.num_experts):
                s.update(_swiglu(f"{pre}.mlp.experts.{x}", h, e.expert_intermediate_size))
        s.update({f"{pre}.input_layernorm.weight": (h,), f"{pre}.post_attention_layernorm.weight": (h,)})
    s["model.norm.weight"] = (h,)
    if not m.tie_embeddings:
        s["lm_head.weight"] = (m.vocab_size, h)
    return {n: Param(shape, "float32" if n in fp32 else dt) for n, shape in s.items()}


def _opts(spec: str, what: str) -> tuple[str, dict[str, str]]:
    kind, _, rest = spec.strip().lower().partition(":")
    opts = {}
    for part in filter(None, rest.split(",")):
        k, eq, v = part.partition("=")
        opts[k.strip()] = v.strip() if eq else k.strip()
    if not kind:
        raise PlanError(f"{what} {spec!r}: give a kind, e.g. {'fsdp:4' if what == 'trainer' else 'vllm:tp=2'}")
    return kind, opts


def _int(opts: dict, key: str, spec: str, default=None) -> int:
    try:
        v = int(opts.get(key, default))
    except (TypeError, ValueError):
        raise PlanError(f"{spec!r}: {key} must be a positive integer, got {opts.get(key)!r}") from None
    if v < 0 or (v == 0 and key != "ep"):
        raise PlanError(f"{spec!r}: {key} must be positive, got {v}")
    return v


def trainer_layout(spec: str, params):
    """'fsdp:N' (FSDP2, Shard(0) over N ranks), 'hsdp:RxS' (R replicas of S shards), 'tp:N' (Colwise/Rowwise)."""
    from ..shard.conventions import QWEN3_TP_PLAN, fsdp_placements, tp_placements, trainer_layout_for

    kind, opts = _opts(spec, "trainer")
    n = next(iter(opts), "")
    if kind == "fsdp":
        return trainer_layout_for(params, fsdp_placements(params), _int({"n": n}, "n", spec))
    if kind == "hsdp":
        r, _, sh = n.partition("x")
        r, sh = _int({"r": r}, "r", spec), _int({"s": sh}, "s", spec)
        return trainer_layout_for(params, fsdp_placements(params, replicas=r), r * sh, mesh=(r, sh))
    if kind == "tp":
        return trainer_layout_for(params, tp_placements(params, QWEN3_TP_PLAN), _int({"n": n}, "n", spec))
    raise PlanError(f"trainer {spec!r}: use fsdp:N, hsdp:RxS or tp:N")


def engine_layout(spec: str, params, m: ModelConfig):
    """'vllm:tp=N[,ep=0][,replicas=R]' (vLLM's names; ep=1, experts by index, is the default) or
    'hf:tp=N[,pad=P][,replicas=R]' (torch tensor parallelism, names unchanged)."""
    from ..shard.conventions import VllmConfig, hf_tp_layout, replicas, vllm_layout

    kind, opts = _opts(spec, "engine")
    tp, copies = _int(opts, "tp", spec, 1), _int(opts, "replicas", spec, 1)
    if kind == "vllm":
        cfg = VllmConfig(num_heads=m.num_heads, num_kv_heads=m.num_kv_heads, head_dim=m.head_dim,
                         expert_parallel=bool(_int(opts, "ep", spec, 1)))
        one = vllm_layout(params, tp, cfg)
    elif kind == "hf":
        one = hf_tp_layout(params, tp, vocab_pad_to=_int(opts, "pad", spec, 1))
    else:
        raise PlanError(f"engine {spec!r}: use vllm:tp=N[,ep=0][,replicas=R] or hf:tp=N[,pad=P][,replicas=R]")
    return replicas(one, copies) if copies > 1 else one


def plan_for(model: str | ModelConfig, trainer: str, engine: str):
    """The routing plan of a model (catalog name, config.json or ModelConfig) between two layouts given as specs."""
    from ..shard.route import route
    from .models import get_model

    m = get_model(model) if isinstance(model, str) else model
    params = model_params(m)
    try:
        engine_side = engine_layout(engine, params, m)  # first: it refuses what vLLM refuses before the big part
        return route(trainer_layout(trainer, params), engine_side)
    except PlanError:
        raise
    except ValueError as e:
        raise PlanError(f"{m.name}, {trainer} -> {engine}: {e}") from e


def cmd_route(a) -> None:
    import json

    plan = plan_for(a.model, a.trainer, a.engine)
    if a.json:
        t, e = plan.bytes_by_trainer(), plan.bytes_by_engine()
        print(json.dumps({"hash": plan.hash, "trainer_ranks": plan.trainer.ranks, "engine_ranks": plan.engine.ranks,
                          "pieces": len(plan.pieces), "total_bytes": sum(t), "bytes_by_trainer": t,
                          "bytes_by_engine": e, "busiest_bytes": max(t + e),
                          "ideal_bytes": sum(t) / min(plan.trainer.ranks, plan.engine.ranks)}, indent=2))
        return
    print(f"{a.model}: trainer {a.trainer} -> engine {a.engine}")
    print(plan.describe())
