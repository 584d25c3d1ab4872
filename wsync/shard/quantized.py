"""Sharded layouts of a quantized state: which box of each quantized tensor a rank holds or needs.

A trainer rank that holds box B of a BF16 weight can quantize it on its own only when B contains whole
quantization units: INT4's groups (along the input dimension), INT8's rows (one scale per output channel),
FP8's blocks. Then its local codes and scales are exactly a box of the codes and scales of the whole weight,
and the sharded sync moves boxes of them as it moves boxes of anything else, with no rank ever holding the
full weight. Where B cuts a unit, the scale depends on elements another rank holds, so the layout is refused
with the parameter, the rank, the box and the boundary that cuts it.

Box B of a weight [..., n, k] (rows [a, b), columns [c, d)) maps per scheme to:

==============  ==================  ===========================================  ====================================
scheme          tensor              box                                          held only when
==============  ==================  ===========================================  ====================================
Int4Group(g)    weight_packed       rows [a, b), columns [c/8, d/8)              c % g == 0, d % g == 0 or d == k
                weight_scale        rows [a, b), columns [c/g, d/g)
                weight_shape        the whole (its value is the global shape)
Int8Channel     weight              B                                            c == 0 and d == k (whole rows)
                weight_scale        rows [a, b), column 0
Fp8Block(r, s)  weight              B                                            a % r == 0, b % r == 0 or b == n,
                weight_scale_inv    rows [a/r, ceil(b/r)), columns likewise      same for columns with s
==============  ==================  ===========================================  ====================================

An engine rank *needs* the same boxes, except that an INT8 rank holding some columns of a row (rowwise
tensor parallelism) needs that row's whole scale, which is what the engine's own quantizer makes of it.
"""
from __future__ import annotations

from .. import dtypes
from ..errors import MismatchError
from ..quant.quantizer import Quantizer
from ..quant.ref import FLOATS
from ..quant.schemes import Fp8Block, Int4Group, Int8Channel, Output, Scheme
from .layout import Box, EngineLayout, Held, Need, Param, TrainerLayout, box_numel, box_shape, full_box

SHAPE = "weight_shape"  # INT4's tensor whose value is the weight's global shape, not a box of anything


class Cut(ValueError):
    """A box that cuts a quantization unit (the message says which boundary and what would work)."""


def _st(torch_name: str) -> str:
    return dtypes.from_torch(torch_name).name


def _torch_name(st: str) -> str:
    return dtypes.DTYPES[st].torch_name


def scheme_of(q: Quantizer, name: str, p: Param) -> Scheme | None:
    """The scheme q quantizes trainer parameter `name` with, or None (it travels as it is)."""
    dtype = _st(p.dtype)
    return q.scheme_for(name, tuple(p.shape), dtype) if dtype in FLOATS else None


def outputs(q: Quantizer, name: str, p: Param) -> list[tuple[str, Param, Output | None]]:
    """(quantized name, its global shape and torch dtype, the scheme's output or None) for trainer parameter name."""
    scheme = scheme_of(q, name, p)
    if scheme is None:
        return [(name, p, None)]
    return [(o.name(name), Param(tuple(o.shape), _torch_name(o.dtype)), o)
            for o in scheme.outputs(tuple(p.shape), _st(p.dtype))]


def _aligned(lo: int, hi: int, unit: int, size: int) -> bool:
    return lo % unit == 0 and (hi % unit == 0 or hi == size)


def output_box(scheme: Scheme, o: Output, box: Box, shape: tuple[int, ...], *, need: bool = False) -> Box:
    """The box of output `o` that box `box` of a weight of `shape` makes (see the module's table). need: an engine
    rank's need, for which an INT8 row cut into columns takes the row's whole scale. Raises Cut."""
    if o.suffix == SHAPE:
        return full_box(o.shape)
    *lead, (a, b), (c, d) = box
    n, k = shape[-2], shape[-1]
    lead = tuple(lead)
    if box_numel(box) == 0:  # nothing held: nothing of any output either
        return box if o.suffix == "weight" else tuple((0, 0) for _ in o.shape)
    if isinstance(scheme, Int4Group):
        g = scheme.group
        if not _aligned(c, d, g, k):
            raise Cut(f"columns [{c}, {d}) of {k} cut an INT4 group of {g} at column {c if c % g else d} "
                      f"(the group's scale needs all {g} of its columns): shard columns at multiples of {g}, "
                      f"or shard rows only (FSDP's Shard(0), colwise tensor parallelism)")
        u = 8 if o.suffix == "weight_packed" else g
        return (*lead, (a, b), (c // u, d // u))
    if isinstance(scheme, Int8Channel):
        if o.suffix == "weight":
            return box
        if not need and (c, d) != (0, k):
            raise Cut(f"columns [{c}, {d}) of {k} cut rows, and an INT8 channel scale needs its whole row: "
                      f"shard rows only (FSDP's Shard(0), colwise tensor parallelism)")
        return (*lead, (a, b), (0, 1))
    if isinstance(scheme, Fp8Block):
        bm, bn = scheme.block
        for what, lo, hi, unit, size in (("rows", a, b, bm, n), ("columns", c, d, bn, k)):
            if not _aligned(lo, hi, unit, size):
                hint = "" if what == "columns" else f", e.g. FSDP over ranks that make ceil({size} / ranks) one"
                raise Cut(f"{what} [{lo}, {hi}) of {size} cut a {bm}x{bn} FP8 block at {what[:-1]} "
                          f"{lo if lo % unit else hi} (the block's scale needs {what} held by another rank): "
                          f"shard {what} at multiples of {unit}{hint}")
        if o.suffix == "weight":
            return box
        return (*lead, (a // bm, -(-b // bm)), (c // bn, -(-d // bn)))
    raise TypeError(f"unknown quantization scheme {scheme!r}")


def quantized_layout(trainer: TrainerLayout, q: Quantizer) -> TrainerLayout:
    """The trainer layout of q(state): each rank holds, of every quantized tensor, the box its BF16 box makes
    (the module's table). Raises ValueError naming the parameter, the rank, the box and the boundary where a
    held box cuts a quantization unit."""
    trainer.check()
    outs = {name: outputs(q, name, p) for name, p in trainer.params.items()}
    params = {qn: qp for name in trainer.params for qn, qp, _ in outs[name]}
    held = []
    for h in trainer.held:
        p = trainer.params[h.name]
        scheme = scheme_of(q, h.name, p)
        for qn, qp, o in outs[h.name]:
            if o is None:
                held.append(Held(h.rank, qn, h.box))
                continue
            if o.suffix == SHAPE and box_numel(h.box) == 0:
                held.append(Held(h.rank, qn, ((0, 0),)))  # a rank holding none of the weight does not send its shape
                continue
            try:
                held.append(Held(h.rank, qn, output_box(scheme, o, h.box, p.shape)))
            except Cut as e:
                raise ValueError(f"{h.name} {list(p.shape)}: trainer rank {h.rank} holds box {list(h.box)}, which "
                                 f"it cannot quantize alone: {e}") from None
    return TrainerLayout(ranks=trainer.ranks, params=params, held=tuple(held))


def quantized_engine_layout(engine: EngineLayout, params: dict[str, Param], q: Quantizer) -> EngineLayout:
    """The engine layout of q(state), from the engine layout of the BF16 state (over trainer parameters
    `params`): each local tensor of a quantized weight becomes its scheme's local tensors, each need the boxes it
    makes of them (an INT8 row's whole scale; INT4's weight_shape whole, on every rank holding the module). The
    engine tensors must carry the trainer's names: fused or renamed quantized tensors (vLLM's qkv_proj,
    gate_up_proj, experts) are refused."""
    schemes = {name: scheme_of(q, name, p) for name, p in params.items()}
    local: dict[tuple[int, str], Param] = {}
    for (r, name), lp in engine.locals.items():
        scheme = schemes.get(name)
        if scheme is None:
            local[(r, name)] = lp
            continue
        for o in scheme.outputs(tuple(lp.shape), _st(lp.dtype)):
            local[(r, o.name(name))] = Param(tuple(o.shape), _torch_name(o.dtype))
    needs: dict[tuple, Need] = {}
    for x in engine.needs:
        scheme = schemes.get(x.src_name)
        if scheme is None:
            needs[(x.rank, x.name, x.dst, x.src_name, x.src)] = x
            continue
        if x.name != x.src_name:
            raise ValueError(f"engine rank {x.rank} {x.name} <- {x.src_name}: a quantized weight written into a "
                             "fused or renamed engine tensor (vLLM's qkv_proj, gate_up_proj, experts) is not "
                             "modelled; use an engine layout with the checkpoint's names (hf_tp_layout)")
        lshape, gshape = engine.locals[(x.rank, x.name)].shape, params[x.src_name].shape
        dt = _st(params[x.src_name].dtype)
        for o_l, o_g in zip(scheme.outputs(tuple(lshape), dt), scheme.outputs(tuple(gshape), dt), strict=True):
            qn = o_g.name(x.name)
            try:
                src = output_box(scheme, o_g, x.src, gshape, need=True)
                dst = output_box(scheme, o_l, x.dst, lshape, need=True)
            except Cut as e:
                raise ValueError(f"{x.src_name} {list(gshape)}: engine rank {x.rank} needs box {list(x.src)}, "
                                 f"which its scheme cannot split there: {e}") from None
            if box_shape(src) != box_shape(dst):
                raise ValueError(f"engine rank {x.rank} {qn}: global box {list(src)} and local box {list(dst)} "
                                 "differ in shape: the local tensor cuts a quantization unit the global one does not")
            needs[(x.rank, qn, dst, qn, src)] = Need(x.rank, qn, dst, qn, src)
    for (r, name), lp in engine.locals.items():  # weight_shape on every rank holding the module, even rows of none
        scheme = schemes.get(name)
        if scheme is not None:
            for o in scheme.outputs(tuple(lp.shape), _st(lp.dtype)):
                if o.suffix == SHAPE:
                    qn, box = o.name(name), full_box(o.shape)
                    needs[(r, qn, box, qn, box)] = Need(r, qn, box, qn, box)
    return EngineLayout(ranks=engine.ranks, locals=local, needs=tuple(needs.values()))


def is_quantized_name(name: str) -> bool:
    """Whether `name` is one of the schemes' output tensors other than a plain "weight"."""
    return name.rpartition(".")[2] in ("weight_packed", "weight_scale", SHAPE, "weight_scale_inv")


class LocalQuantizer:
    """Trainer rank `rank`'s local BF16 tensors in, its local boxes of q(full state) out (plan.trainer is a
    quantized_layout): each local tensor goes through q, which runs where the tensor lives (the device's kernels
    for a CUDA tensor), and weight_shape is the global shape, kept in a tensor of its own so its memory stays put
    from version to version as q's outputs do."""

    def __init__(self, q: Quantizer, plan, rank: int, names):
        self.q, self.rank = q, rank
        self.names = set(names)  # the quantized names this rank sends pieces of
        self.params = plan.trainer.params
        bf16 = sorted(n for n, p in self.params.items() if scheme_of(q, n, p) is not None)
        if bf16:
            raise ValueError(f"quantize= takes a plan routed over quantized_layout(trainer_layout, q); this plan's "
                             f"trainer layout has weights q would quantize ({', '.join(bf16[:3])}, ...)")
        self._shape: dict[tuple[str, str], object] = {}  # (name, device) -> the global shape tensor

    def __call__(self, given: dict) -> dict:
        from .tensors import local_of

        out = {}
        for name, t in given.items():
            t = local_of(t)
            dtype = dtypes.from_torch(t.dtype).name
            scheme = self.q.scheme_for(name, tuple(t.shape), dtype) if dtype in FLOATS else None
            if scheme is None:
                if name in self.names:
                    out[name] = t
                continue
            wanted = [o for o in scheme.outputs(tuple(t.shape), dtype) if o.name(name) in self.names]
            if not wanted:
                continue
            for qn, qt in self.q({name: t}).items():
                if qn not in self.names:
                    continue
                out[qn] = self._global_shape(qn, scheme, qt) if qn.endswith("." + SHAPE) else qt
        missing = sorted(self.names - set(out))
        if missing:
            src = missing[0].rpartition(".")[0] + ".weight" if is_quantized_name(missing[0]) else missing[0]
            raise MismatchError(f"trainer rank {self.rank}: publish() was not given {src!r}, the local tensor "
                                f"{missing[0]!r} is quantized from (or q does not quantize it as the plan's "
                                "quantized_layout did)")
        return out

    def _global_shape(self, qn: str, scheme: Scheme, like):
        """weight_shape's value for the whole weight: INT4 packs 8 codes per int32 along the last dimension."""
        import torch

        packed = self.params[qn[: -len(SHAPE)] + "weight_packed"].shape
        key = (qn, str(like.device))
        if key not in self._shape:
            self._shape[key] = torch.tensor([*packed[:-1], packed[-1] * 8], dtype=torch.int64, device=like.device)
        return self._shape[key]
