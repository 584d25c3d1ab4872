"""Layouts of the usual sharding conventions, computed from parameter shapes alone.

Every rank must arrive at the same routing plan without talking to the others
(and a test or `wsync plan route` must arrive at it with no process group at
all), so the layouts are pure functions of the parameters' names and shapes, a
placement description and rank counts. `held_from_dtensors` reads one
process's own DTensors; `trainer_layout_from_dtensors` builds the whole layout
from their placements and checks it against what torch gave this process.

Trainer side: torch.distributed.tensor placements over a device mesh with
torch's uneven chunking (`Shard.local_shard_size_and_offset` in
torch/distributed/tensor/placement_types.py: chunks of ceil(n / k), the
trailing ones short or empty; nested shards of one dimension split the
previous mesh dimension's chunk, left to right, as
`torch.distributed.tensor._utils._compute_local_shape_and_global_offset` does).
A rank's number is its row-major coordinate in the mesh, which is its global
rank for `init_device_mesh` over all ranks.

Engine side: `hf_tp_layout` (names unchanged: torch.distributed.tensor.parallel
on a transformers model) here; `vllm_layout` (vLLM's fused names) in vllm_names.py, re-exported here.
"""
from __future__ import annotations

import math
from fnmatch import fnmatchcase

from .layout import Box, EngineLayout, Held, Need, Param, TrainerLayout, box_numel, box_shape, full_box
from .quantized import SHAPE, quantized_engine_layout, quantized_layout
from .vllm_names import VllmConfig, vllm_layout

# one module to import every layout builder from, vLLM's and the quantized ones included
__all__ = ["COLWISE", "QWEN3_TP_PLAN", "REPLICATE", "ROWWISE", "SHARD", "STYLES", "VOCAB", "VllmConfig", "chunk",
           "coordinate", "fsdp_placements", "held_from_dtensors", "hf_tp_layout", "placement_box",
           "quantized_engine_layout", "quantized_layout", "replicas", "tp_placements", "trainer_layout_for",
           "trainer_layout_from_dtensors", "vllm_layout"]

SHARD, REPLICATE = "shard", "replicate"
COLWISE, ROWWISE, VOCAB = "colwise", "rowwise", "vocab"
STYLES = (COLWISE, ROWWISE, REPLICATE, VOCAB)

# What transformers' tensor-parallel plan for Qwen3 / Llama asks of ColwiseParallel / RowwiseParallel: module
# path patterns (fnmatch, as parallelize_module matches them) to styles. Unmatched modules stay replicated.
QWEN3_TP_PLAN = {
    "model.embed_tokens": VOCAB,
    "model.layers.*.self_attn.q_proj": COLWISE,
    "model.layers.*.self_attn.k_proj": COLWISE,
    "model.layers.*.self_attn.v_proj": COLWISE,
    "model.layers.*.self_attn.o_proj": ROWWISE,
    "model.layers.*.mlp.gate_proj": COLWISE,
    "model.layers.*.mlp.up_proj": COLWISE,
    "model.layers.*.mlp.down_proj": ROWWISE,
    "lm_head": VOCAB,
}


def chunk(size: int, parts: int, i: int) -> tuple[int, int]:
    """[start, stop) of chunk i of `size` split in `parts` as torch.chunk and Shard(d) split it."""
    full = -(-size // parts)
    start = min(size, full * i)
    return start, min(size, start + full)


def coordinate(rank: int, mesh: tuple[int, ...]) -> tuple[int, ...]:
    """The row-major coordinate of `rank` in a mesh of shape `mesh`."""
    out = []
    for k in reversed(mesh):
        rank, c = divmod(rank, k)
        out.append(c)
    return tuple(reversed(out))


def _spec(spec, mesh_dims: int, name: str) -> tuple[tuple, ...]:
    """One placement per mesh dimension: ("shard", dim) or ("replicate",); a bare one for a 1-D mesh."""
    if isinstance(spec, tuple) and spec and isinstance(spec[0], str):
        spec = (spec,)
    spec = tuple(tuple(p) for p in spec)
    ok = all(p == (REPLICATE,) or (len(p) == 2 and p[0] == SHARD and isinstance(p[1], int)) for p in spec)
    if not ok or len(spec) != mesh_dims:
        raise ValueError(f"{name}: placement {spec!r} must be {mesh_dims} of ('shard', dim) or ('replicate',), "
                         "one per mesh dimension")
    return spec


def placement_box(shape, mesh: tuple[int, ...], coord: tuple[int, ...], spec) -> Box:
    """The box of a tensor of `shape` that the rank at `coord` of `mesh` holds under placements `spec`."""
    lo, size = [0] * len(shape), [int(d) for d in shape]
    for k, c, p in zip(mesh, coord, spec, strict=True):
        if p[0] == SHARD:
            if not -len(shape) <= p[1] < len(shape):
                raise ValueError(f"Shard({p[1]}) of a tensor of shape {tuple(shape)}")
            d = p[1] % len(shape)
            a, b = chunk(size[d], k, c)
            lo[d] += a
            size[d] = b - a
    return tuple((a, a + n) for a, n in zip(lo, size))


def trainer_layout_for(params: dict[str, Param], placements: dict, ranks: int, mesh=None) -> TrainerLayout:
    """Every rank's boxes from a placement description, without a process group.

    placements: name -> ("shard", dim) or ("replicate",) over a 1-D mesh of `ranks`; over a mesh of shape
    `mesh` (e.g. (2, 4): 2 replicas of 4 FSDP shards), a tuple of those, one per mesh dimension.
    """
    mesh = tuple(mesh or (ranks,))
    if math.prod(mesh) != ranks or ranks < 1:
        raise ValueError(f"a mesh of shape {mesh} does not hold {ranks} ranks")
    missing, extra = sorted(set(params) - set(placements)), sorted(set(placements) - set(params))
    if missing or extra:
        raise ValueError(f"placements must name exactly the parameters: missing {missing[:5]}, unknown {extra[:5]}")
    specs = {n: _spec(placements[n], len(mesh), n) for n in params}
    held = [Held(r, n, placement_box(p.shape, mesh, coordinate(r, mesh), specs[n]))
            for r in range(ranks) for n, p in params.items()]
    return TrainerLayout(ranks=ranks, params=dict(params), held=tuple(held))


def fsdp_placements(params: dict[str, Param], replicas: int = 1) -> dict:
    """FSDP2's fully_shard: Shard(0) of every parameter (0-d ones replicated); HSDP adds a replica dimension."""
    out = {}
    for n, p in params.items():
        s = (SHARD, 0) if p.shape else (REPLICATE,)
        out[n] = ((REPLICATE,), s) if replicas > 1 else s
    return out


def _dtype_name(t) -> str:
    return str(t.dtype).removeprefix("torch.")


def _dtensor_spec(name: str, t) -> tuple[tuple, ...]:
    from torch.distributed.tensor import Replicate, Shard

    out = []
    for p in t.placements:
        if type(p) is Shard:  # not _StridedShard (FSDP over TP): its local rows interleave, not a box
            out.append((SHARD, p.dim))
        elif isinstance(p, Replicate):
            out.append((REPLICATE,))
        else:
            raise ValueError(f"{name}: placement {p} is not Shard(d) or Replicate: its local tensor is not one box "
                             "of the parameter (redistribute it, or give the layout explicitly)")
    return tuple(out)


def held_from_dtensors(named_params: dict, rank: int) -> tuple[dict[str, Param], list[Held]]:
    """This process's parameters and the boxes its local tensors hold (plain tensors: the full box)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    params, held = {}, []
    for name, t in named_params.items():
        shape = tuple(int(d) for d in t.shape)
        params[name] = Param(shape, _dtype_name(t))
        box = full_box(shape)
        if isinstance(t, DTensor):
            _dtensor_spec(name, t)
            if not t.device_mesh._is_current_rank_part_of_mesh():
                raise ValueError(f"{name}: this process is not in the parameter's device mesh")
            local, offset = compute_local_shape_and_global_offset(shape, t.device_mesh, t.placements)
            box = tuple((o, o + n) for o, n in zip(offset, local))
            if tuple(t.to_local().shape) != tuple(local):
                raise ValueError(f"{name}: local tensor {tuple(t.to_local().shape)} is not torch's own {local}")
        held.append(Held(rank, name, box))
    return params, held


def trainer_layout_from_dtensors(named_params: dict) -> TrainerLayout:
    """The whole trainer layout from the DTensors' placements (one mesh for all), checked against this rank."""
    from torch.distributed.tensor import DTensor

    meshes = {id(t.device_mesh): t.device_mesh for t in named_params.values() if isinstance(t, DTensor)}
    shapes = {tuple(m.shape) for m in meshes.values()}
    if len(shapes) > 1:
        raise ValueError(f"parameters live on device meshes of shapes {sorted(shapes)}; one mesh is modelled")
    mesh = shapes.pop() if shapes else (1,)
    coord = tuple(next(iter(meshes.values())).get_coordinate()) if meshes else (0,)
    rank = sum(c * math.prod(mesh[i + 1:]) for i, c in enumerate(coord))
    params, held = held_from_dtensors(named_params, rank)
    spec = {n: _dtensor_spec(n, t) if isinstance(t, DTensor) else ((REPLICATE,),) * len(mesh)
            for n, t in named_params.items()}
    layout = trainer_layout_for(params, spec, math.prod(mesh), mesh)
    mine = {h.name: h.box for h in layout.held if h.rank == rank}
    for h in held:
        if mine[h.name] != h.box:
            raise ValueError(f"{h.name}: torch gave rank {rank} box {h.box}, the placements say {mine[h.name]}")
    return layout


def _style(module: str, plan: dict[str, str]) -> str:
    for pattern, style in plan.items():
        if fnmatchcase(module, pattern):
            if style not in STYLES:
                raise ValueError(f"plan style {style!r} for {pattern!r}; use one of {STYLES}")
            return style
    return REPLICATE


def tp_placements(params: dict[str, Param], plan: dict[str, str]) -> dict:
    """Placements of a module-level tensor-parallel plan: colwise and vocab Shard(0) of weight and bias,
    rowwise Shard(1) of the weight and a replicated bias (what ColwiseParallel / RowwiseParallel do to nn.Linear).

    Over a quantized module's tensors (wsync.quant's names): weight_shape replicated (its value is the global
    shape); colwise splits the rows of every other one; rowwise splits the columns of the codes, of INT4's group
    scales and FP8's block scales, and replicates INT8's [n, 1] channel scale whole. Torch chunks each tensor on
    its own, so an INT4 or FP8 split lines the scales up with the codes only where the chunks fall on group or
    block boundaries: hf_tp_layout(quantize=q) splits them from the weight's boxes instead, and refuses a cut."""
    out = {}
    for name, p in params.items():
        style = _style(name.rpartition(".")[0], plan)
        last = name.rpartition(".")[2]
        if last == SHAPE or (style == ROWWISE and last == "weight_scale" and p.shape and p.shape[-1] == 1
                             and name[: -len(last)] + "weight" in params):
            out[name] = (REPLICATE,)
        elif style in (COLWISE, VOCAB) and p.shape:
            out[name] = (SHARD, 0)
        elif style == ROWWISE and len(p.shape) >= 2:
            out[name] = (SHARD, 1)
        else:
            out[name] = (REPLICATE,)
    return out


def hf_tp_layout(params: dict[str, Param], tp: int, plan: dict[str, str] = QWEN3_TP_PLAN, *,
                 vocab_pad_to: int = 1, quantize=None) -> EngineLayout:
    """Engine ranks of a transformers model under torch tensor parallelism, names unchanged.

    Uneven sizes split as torch splits them (8 heads over 3 ranks: rows of 3, 3, 2 heads' worth, not head-aligned).
    vocab_pad_to > 1: "vocab" tensors are padded to a multiple of it before the split; padding rows are the
    engine's own (no trainer sends them). quantize: a wsync.quant Quantizer; params are still the trainer's
    (BF16) ones, and the layout is over q(state)'s tensors, each rank's boxes those its BF16 boxes make
    (quantized_engine_layout: a rowwise INT8 rank gets its rows' whole scales, weight_shape goes whole to every
    rank; a split that cuts an INT4 group or an FP8 block is refused).
    """
    if tp < 1 or vocab_pad_to < 1:
        raise ValueError(f"tp and vocab_pad_to must be >= 1, got {tp}, {vocab_pad_to}")
    specs = tp_placements(params, plan)
    local, needs = {}, []
    for r in range(tp):
        for name, p in params.items():
            vocab = _style(name.rpartition(".")[0], plan) == VOCAB and p.shape
            if vocab and vocab_pad_to > 1:
                v = p.shape[0]
                a, b = chunk(-(-v // vocab_pad_to) * vocab_pad_to, tp, r)
                shape = (b - a, *p.shape[1:])
                src = ((min(a, v), min(b, v)), *full_box(p.shape[1:]))
                dst = ((0, src[0][1] - src[0][0]), *src[1:])
            else:
                src = placement_box(p.shape, (tp,), (r,), (specs[name],))
                shape, dst = box_shape(src), full_box(box_shape(src))
            local[(r, name)] = Param(tuple(shape), p.dtype)
            if box_numel(src):
                needs.append(Need(r, name, dst, name, src))
    layout = EngineLayout(ranks=tp, locals=local, needs=tuple(needs))
    return layout if quantize is None else quantized_engine_layout(layout, params, quantize)


def replicas(layout: EngineLayout, copies: int) -> EngineLayout:
    """`copies` engines of the same layout side by side: engine rank c * N + r is rank r of copy c."""
    n = layout.ranks
    local = {(c * n + r, name): p for c in range(copies) for (r, name), p in layout.locals.items()}
    needs = tuple(Need(c * n + x.rank, x.name, x.dst, x.src_name, x.src) for c in range(copies) for x in layout.needs)
    return EngineLayout(ranks=n * copies, locals=local, needs=needs)
