"""Sharded sync of a quantized state: every engine rank holds, byte for byte, its boxes of q(full state), and no
trainer rank ever holds more than its own BF16 boxes.

q(full state) is computed here only as the test's reference, by wsync.quant's numpy reference (ref.py) on the
unsharded state; the trainer ranks quantize their own boxes through the host backend's kernels. Layouts that
cut a quantization unit (an INT4 group, an INT8 row, an FP8 block) are refused, naming the parameter.
"""
from __future__ import annotations

import numpy as np
import pytest

from shard_helpers import (QDIMS, Reference, bits_of, commit, qwen_params, quant_plan, quant_reference,
                           quantizer_for, sl)

torch = pytest.importorskip("torch")

from wsync.errors import MismatchError  # noqa: E402
from wsync.quant import Fp8Block, Int4Group, Int8Channel, Quantizer  # noqa: E402
from wsync.shard.conventions import (QWEN3_TP_PLAN, REPLICATE, SHARD, VllmConfig, fsdp_placements,  # noqa: E402
                                     hf_tp_layout, quantized_engine_layout, quantized_layout, tp_placements,
                                     trainer_layout_for, vllm_layout)
from wsync.shard.layout import Param, box_numel  # noqa: E402
from wsync.shard.quantized import LocalQuantizer  # noqa: E402

CASES = [("int4", 2), ("int4", 3), ("int8", 2), ("int8", 3), ("fp8", 2)]
O_PROJ = "model.layers.0.self_attn.o_proj."


@pytest.mark.parametrize("kind,m", CASES)
def test_each_rank_quantizes_its_box_into_the_box_of_the_full_quantized_state(kind, m):
    """What ShardPublisher(quantize=q) hands the sync on each trainer rank, from that rank's BF16 boxes alone,
    is exactly its held boxes of q(full state); weight_shape is the global shape. Checked at two versions."""
    bf16, plan = quant_plan(m, 2, kind)
    params, ref = qwen_params(**QDIMS), Reference(qwen_params(**QDIMS))
    for v in (0, 3):
        full = quant_reference(quantizer_for(kind), params, ref.at(v))
        state = ref.torch_state(v)
        for t in range(m):
            names = {h.name for h in plan.trainer.held if h.rank == t and box_numel(h.box)}
            local = LocalQuantizer(quantizer_for(kind), plan, t, names)(
                {h.name: state[h.name][sl(h.box)].contiguous() for h in bf16.held if h.rank == t})
            assert local.keys() == names
            for h in plan.trainer.held:
                if h.rank == t and h.name in names:
                    want = full[h.name][sl(h.box)]
                    assert np.array_equal(bits_of(local[h.name]), want), (kind, m, t, h)
    shapes = [n for n in plan.trainer.params if n.endswith(".weight_shape")]
    assert (len(shapes) > 0) == (kind == "int4")
    for n in shapes:  # held by every rank holding any of the weight: the route sends each engine rank one copy
        holders = {h.rank for h in plan.trainer.held if h.name == n and box_numel(h.box)}
        assert holders == set(range(m))
        for r in range(plan.engine.ranks):
            assert len([p for p in plan.for_engine(r) if p.src_name == n]) == 1


def test_the_quantized_plan_moves_only_quantized_bytes():
    """The quantized state's pieces are what travels, and every engine local tensor is covered exactly."""
    _, plan = quant_plan(3, 2, "int4")
    assert not any(p.src_name.endswith("proj.weight") for p in plan.pieces)
    for r in range(plan.engine.ranks):
        for (rank, name), p in plan.engine.locals.items():
            if rank == r:
                got = sum(box_numel(x.dst) for x in plan.for_engine(r) if x.dst_name == name)
                assert got == box_numel(tuple((0, d) for d in p.shape)), name


def test_engine_layout_of_a_quantized_module_under_tensor_parallelism():
    params = qwen_params(**QDIMS)
    e8 = hf_tp_layout(params, 2, quantize=quantizer_for("int8"))
    for r in range(2):  # rowwise o_proj: half the codes' columns, every row's whole scale
        assert e8.locals[(r, O_PROJ + "weight")] == Param((256, 128), "int8")
        assert e8.locals[(r, O_PROJ + "weight_scale")] == Param((256, 1), "bfloat16")
        scale = [x for x in e8.needs if x.rank == r and x.name == O_PROJ + "weight_scale"]
        assert [x.src for x in scale] == [((0, 256), (0, 1))]
        q8 = [x for x in e8.needs if x.rank == r and x.name == "model.layers.0.self_attn.q_proj.weight_scale"]
        assert [x.src for x in q8] == [((128 * r, 128 * r + 128), (0, 1))]  # colwise: rows of the scale too
    e4 = hf_tp_layout(params, 2, quantize=quantizer_for("int4"))
    for r in range(2):  # rowwise INT4: packed words and group scales split at the same columns of the weight
        got = {x.name.rpartition(".")[2]: x.src for x in e4.needs if x.rank == r and x.name.startswith(O_PROJ)}
        assert got == {"weight_packed": ((0, 256), (16 * r, 16 * r + 16)),
                       "weight_scale": ((0, 256), (4 * r, 4 * r + 4)), "weight_shape": ((0, 2),)}
    e_fp8 = hf_tp_layout(params, 2, quantize=quantizer_for("fp8"))
    got = [x.src for x in e_fp8.needs if x.rank == 1 and x.name == "model.layers.0.mlp.down_proj.weight_scale_inv"]
    assert got == [((0, 2), (1, 2))]


def test_placements_of_quantized_tensors():
    params = {**{O_PROJ + s: Param(sh, dt) for s, sh, dt in (("weight", (256, 256), "int8"),
                                                           ("weight_scale", (256, 1), "bfloat16"))},
              **{"model.layers.0.mlp.up_proj." + s: Param(sh, dt) for s, sh, dt in (
                  ("weight_packed", (256, 32), "int32"), ("weight_scale", (256, 8), "bfloat16"),
                  ("weight_shape", (2,), "int64"))},
              **{"model.layers.0.mlp.down_proj." + s: Param(sh, dt) for s, sh, dt in (
                  ("weight_packed", (256, 32), "int32"), ("weight_scale", (256, 8), "bfloat16"),
                  ("weight_shape", (2,), "int64"))}}
    got = tp_placements(params, QWEN3_TP_PLAN)
    assert got == {O_PROJ + "weight": (SHARD, 1), O_PROJ + "weight_scale": (REPLICATE,),
                   "model.layers.0.mlp.up_proj.weight_packed": (SHARD, 0),
                   "model.layers.0.mlp.up_proj.weight_scale": (SHARD, 0),
                   "model.layers.0.mlp.up_proj.weight_shape": (REPLICATE,),
                   "model.layers.0.mlp.down_proj.weight_packed": (SHARD, 1),
                   "model.layers.0.mlp.down_proj.weight_scale": (SHARD, 1),
                   "model.layers.0.mlp.down_proj.weight_shape": (REPLICATE,)}


def test_layouts_that_cut_a_quantization_unit_are_refused_by_name():
    params = qwen_params(**QDIMS)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.gate_proj\.weight \[256, 256\]: trainer rank 0 "
                                         r"holds box \[\(0, 86\), \(0, 256\)\].*cut a 128x128 FP8 block at row 86"
                                         r".*multiples of 128"):
        quant_plan(3, 2, "fp8")
    tp_trainer = trainer_layout_for(params, tp_placements(params, QWEN3_TP_PLAN), 2)  # o_proj Shard(1)
    with pytest.raises(ValueError, match=r"o_proj\.weight \[256, 256\]: trainer rank 0 .*columns \[0, 128\) of "
                                         r"256 cut rows, and an INT8 channel scale needs its whole row"):
        quantized_layout(tp_trainer, quantizer_for("int8"))
    quantized_layout(tp_trainer, quantizer_for("int4"))  # 128 columns: whole groups of 32
    tp3 = trainer_layout_for(params, tp_placements(params, QWEN3_TP_PLAN), 3)
    with pytest.raises(ValueError, match=r"o_proj\.weight \[256, 256\]: trainer rank 0 .*columns \[0, 86\) of 256 "
                                         r"cut an INT4 group of 32 at column 86"):
        quantized_layout(tp3, quantizer_for("int4"))
    with pytest.raises(ValueError, match=r"o_proj\.weight \[256, 256\]: engine rank 0 needs box .*cut an INT4 "
                                         r"group of 32 at column 86"):
        hf_tp_layout(params, 3, quantize=quantizer_for("int4"))
    hf_tp_layout(params, 3, quantize=quantizer_for("int8"))  # INT8 takes any split: rows' scales go whole


def test_vllm_fused_layout_refuses_quantized_tensors():
    params = qwen_params(**QDIMS)
    cfg = VllmConfig(num_heads=4, num_kv_heads=2, head_dim=64)
    q = quantizer_for("int4")
    with pytest.raises(ValueError, match=r"fused or renamed engine tensor .*hf_tp_layout"):
        quantized_engine_layout(vllm_layout(params, 2, cfg), params, q)
    qparams = {n: Param(s, "int32" if n.endswith("packed") else "bfloat16")
               for n, (s, _) in q.layout({n: (p.shape, "BF16") for n, p in params.items()}).items()}
    with pytest.raises(ValueError, match=r"weight_packed \(int32\): quantized tensors in vLLM's fused layout"):
        vllm_layout(qparams, 2, cfg)


def test_a_publisher_refuses_quantize_with_a_plan_that_is_not_quantized():
    from shard_helpers import make_plan
    from wsync.shard.sync import ShardPublisher

    plan = make_plan(2, 2, "hf", **{k: QDIMS[k] for k in ("hidden", "inter", "heads", "kv_heads", "head_dim")})
    with pytest.raises(ValueError, match=r"quantized_layout\(trainer_layout, q\)"):
        ShardPublisher(plan, 0, coordinator="tcp://127.0.0.1:9", quantize=quantizer_for("int4"), connect_timeout=1)


def test_a_missing_weight_is_named():
    bf16, plan = quant_plan(2, 2, "int8")
    names = {p.src_name for p in plan.for_trainer(0)}
    state = Reference(qwen_params(**QDIMS)).torch_state(0)
    local = {h.name: state[h.name][sl(h.box)].contiguous() for h in bf16.held if h.rank == 0}
    del local["model.layers.1.mlp.down_proj.weight"]
    with pytest.raises(MismatchError, match=r"not given 'model\.layers\.1\.mlp\.down_proj\.weight'"):
        LocalQuantizer(quantizer_for("int8"), plan, 0, names)(local)


def test_schemes_map_boxes_as_documented():
    """Each scheme's box map against its own quantizer on a 3-D (experts) weight held in boxes of experts and rows."""
    from wsync.shard.quantized import output_box

    rng = np.random.default_rng(3)
    shape = (3, 256, 256)
    bits = (rng.standard_normal(shape).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    for scheme in (Int4Group(32), Int4Group(128), Int8Channel(), Fp8Block()):
        full = [np.ascontiguousarray(a) for a in scheme.reference(bits, "BF16")]
        for box in (((0, 2), (0, 128), (0, 256)), ((2, 3), (128, 256), (0, 256)), ((1, 2), (0, 256), (0, 256))):
            part = scheme.reference(np.ascontiguousarray(bits[sl(box)]), "BF16")
            for o, whole, mine in zip(scheme.outputs(shape, "BF16"), full, part):
                if o.suffix == "weight_shape":
                    continue
                assert np.array_equal(whole[sl(output_box(scheme, o, box, shape))], mine), (scheme, box, o)


def test_quantizer_without_matches_leaves_the_layout_alone():
    params = qwen_params(**QDIMS)
    trainer = trainer_layout_for(params, fsdp_placements(params), 3)
    q = Quantizer([(["re:nothing\\."], Int4Group(32))])
    assert quantized_layout(trainer, q) == trainer


@pytest.mark.parametrize("kind,m", [pytest.param(k, m, marks=() if (k, m) == ("int4", 3) else pytest.mark.slow)
                                    for k, m in CASES])
def test_quantized_versions_commit_bit_exact_on_every_engine_rank(kind, m):
    """m trainer ranks (FSDP rows, uneven over 3) -> 2 engine ranks (torch TP, names unchanged) over tcp
    loopback: a keyframe then deltas, every engine rank's tensors equal to its boxes of q(full state)."""
    from shard_helpers import QuantGroup

    g = QuantGroup(m, 2, kind)
    try:
        for v in range(4):
            commit(g, v)
        for t, pub in enumerate(g.pubs):  # a rank sends only boxes of the quantized state it made itself
            assert pub.stats.piece_bytes == sum(g.plan.piece_bytes(p) for p in g.plan.for_trainer(t))
            assert all(p.src_name in pub.quantize.names for p in g.plan.for_trainer(t))
    finally:
        g.close()


@pytest.mark.slow  # 5 processes import transformers and form gloo groups
def test_fsdp2_trainer_into_quantized_tensor_parallel_engine(tmp_path):
    """FSDP2 (fully_shard, gloo) training a transformers Qwen3 on 3 processes (uneven row chunks), its DTensors
    handed to ShardPublisher(quantize=INT8) as they are -> 2 engine processes holding the quantized tensors of
    torch TP's layout: 4 AdamW versions, every engine tensor equal to its boxes of q(full state)."""
    pytest.importorskip("transformers")
    from shard_helpers import fsdp_trainer, quant_tensor_engine, run_processes

    run_processes(tmp_path, 3, 2, fsdp_trainer, quant_tensor_engine, 4, trainer_args=(False, "int8"),
                  engine_args=("int8",))
