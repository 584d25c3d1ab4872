"""The quantizers' reference (wsync.quant.ref) against the engines' own code, byte for byte.

compressed-tensors' functions (the ones its compressors and llm-compressor call: ``compute_dynamic_scales_and_zp``
/ ``calculate_qparams``, ``quantize``, ``pack_to_int32``) on the same weights must give the same codes, scales and
packed words, on every shape class of a Qwen3-MoE / Kimi-like layer, in every weight dtype, and on edge values.
vLLM's block FP8 cast is compared in CI's vLLM stage (tests/test_vllm_quant_real.py); here its FP8 conversion is
held to torch's cast, which is the one vLLM's function ends in. A divergence names the tensor and the element.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from wsync.quant import Fp8Block, Int4Group, Int8Channel, QuantizeError, Quantizer, Rule, from_config, ref

DTYPES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}

# Every matrix shape class of a Qwen3-MoE / Kimi-like decoder layer (small sizes, the same shapes' structure):
# attention projections with more query than key/value heads, a dense MLP, per-expert gate/up [I, H] and
# down [H, I], fused experts [E, 2I, H], the router gate [E, H], a shared expert, a one-row matrix.
H, I, E = 256, 96, 4
SHAPES = {
    "q_proj": (384, H), "k_proj": (64, H), "v_proj": (64, H), "o_proj": (H, 384),
    "dense_gate_up": (2 * 352, H), "dense_down": (H, 352),
    "expert_gate": (I, H), "expert_down": (H, I), "fused_experts": (E, 2 * I, H),
    "router": (E, H), "shared_expert_up": (2 * I, H), "one_row": (1, 160),
}


def bits_of(t: torch.Tensor) -> np.ndarray:
    view = torch.int16 if t.element_size() == 2 else torch.int32
    return t.contiguous().view(view).numpy().view(np.uint16 if t.element_size() == 2 else np.uint32)


def same(ours: np.ndarray, theirs: np.ndarray, what: str) -> None:
    """Byte equality; on a difference, the first differing element by index, with both values."""
    assert ours.shape == theirs.shape, f"{what}: shape {ours.shape} != {theirs.shape}"
    a, b = ours.reshape(-1).view(np.uint8), np.ascontiguousarray(theirs).reshape(-1).view(np.uint8)
    if not np.array_equal(a, b):
        size = ours.dtype.itemsize
        at = int(np.flatnonzero(a != b)[0]) // size
        index = np.unravel_index(at, ours.shape)
        raise AssertionError(f"{what}: element {tuple(int(i) for i in index)} differs: ours "
                             f"{ours.reshape(-1)[at]!r}, theirs {np.ascontiguousarray(theirs).reshape(-1)[at]!r}")


def weight(shape, dtype, seed: int, edges: bool = True) -> torch.Tensor:
    """An RL-sized weight (N(0, 0.02)) with edge values planted: an all-zero group, row and block; exact ties
    of x / scale; subnormals; the dtype's largest finite values; negative zeros."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g) * 0.02
    flat = w.view(-1, shape[-1])
    if edges and flat.shape[0] > 2 and shape[-1] >= 64:
        flat[0, :32] = 0.0  # a zero group
        flat[1, :] = 0.0  # a zero row (channel)
        # absmax 7.5 makes an INT4 scale of exactly 1 and an INT8 scale of 7.5/127.5: halves are ties
        flat[2, 32:64] = torch.tensor([7.5, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.5] * 4)
        flat[2, 64:] = torch.tensor([-0.0, 1e-40, -1e-40, 3e-39])[torch.arange(shape[-1] - 64) % 4]
        if flat.shape[0] > 3:
            flat[3, :32] = torch.finfo(dtype).max * torch.tensor([1.0, -1.0] * 16)
    return w.to(dtype)


def ct_int4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import quantize
    from compressed_tensors.quantization.utils.helpers import compute_dynamic_scales_and_zp

    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=32)
    scale, zp = compute_dynamic_scales_and_zp(w, args, module=None)
    codes = quantize(w, scale, zp, args, dtype=torch.int8)
    return pack_to_int32(codes.reshape(-1, w.shape[-1]), 4).reshape(*w.shape[:-1], -1), scale


def ct_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import quantize
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    args = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="channel")
    # a weight observer's per-channel range (llm-compressor's minmax): min and max over the input dimension
    scale, zp = calculate_qparams(w.amin(dim=-1, keepdim=True), w.amax(dim=-1, keepdim=True), args)
    return quantize(w, scale, zp, args, dtype=torch.int8), scale


@pytest.fixture(scope="module")
def compressed_tensors():
    return pytest.importorskip("compressed_tensors")


@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPES.values()))
@pytest.mark.parametrize("shape_class", list(SHAPES))
def test_int4_group_is_compressed_tensors_pack_quantized(compressed_tensors, shape_class, dtype):
    w = weight(SHAPES[shape_class], dtype, seed=len(shape_class))
    packed, scale = ct_int4(w)
    ours_packed, ours_scale = ref.int4_group(bits_of(w), DTYPES[dtype])
    same(ours_scale, bits_of(scale), f"{shape_class} weight_scale")
    same(ours_packed, packed.numpy(), f"{shape_class} weight_packed")


@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPES.values()))
@pytest.mark.parametrize("shape_class", list(SHAPES))
def test_int8_channel_is_compressed_tensors_int_quantized(compressed_tensors, shape_class, dtype):
    w = weight(SHAPES[shape_class], dtype, seed=len(shape_class) + 1)
    codes, scale = ct_int8(w)
    ours_codes, ours_scale = ref.int8_channel(bits_of(w), DTYPES[dtype])
    same(ours_scale, bits_of(scale), f"{shape_class} weight_scale")
    same(ours_codes, codes.numpy(), f"{shape_class} weight")


def test_ties_are_decided_after_the_rounding_to_the_weight_dtype(compressed_tensors):
    """compressed-tensors rounds x / scale to bf16 before rint: some quotients are ties only after that
    rounding, and go to the even integer. The comparison above covers such elements (this proves it does)."""
    w = weight((64, 256), torch.bfloat16, seed=5, edges=False)
    x = ref.to_f32(bits_of(w), "BF16").reshape(64, 8, 32)
    scale = ref.rounded(np.maximum(np.abs(x).max(-1, keepdims=True), 0) / np.float32(7.5), "BF16")
    exact, in_bf16 = x / scale, ref.rounded(x / scale, "BF16")
    late_ties = (np.abs(in_bf16 - np.floor(in_bf16)) == 0.5) & (exact != in_bf16)
    assert late_ties.sum() > 10
    packed, _ = ct_int4(w)
    same(ref.int4_group(bits_of(w), "BF16")[0], packed.numpy(), "weight_packed")


def test_fp8_cast_is_torchs_on_every_exponent_and_tie():
    """Every float32 exponent from below the format's subnormals to beyond its range, mantissas with the
    tie bit set and not, both signs, and the special values."""
    rng = np.random.default_rng(0)
    mant = rng.integers(0, 1 << 23, 4096, dtype=np.uint32)
    mant[::4] = (mant[::4] & ~np.uint32(0xFFFFF)) | 0x80000  # exactly halfway between two e4m3 values
    exps = np.arange(100, 140, dtype=np.uint32)
    u = (exps[:, None] << 23 | mant[None, :]).reshape(-1)
    u = np.concatenate([u, u | np.uint32(1 << 31)])
    x = np.concatenate([u.view(np.float32), np.float32([0, -0.0, 448, 464, 480, 1e30, np.inf, -np.inf, np.nan])])
    theirs = torch.from_numpy(x).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    same(ref.fp8_e4m3(x), theirs, "float8_e4m3fn")


@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPES.values()))
@pytest.mark.parametrize("shape", [(256, 384), (200, 130), (1, 5), (129, 1), (2, 130, 260)], ids=str)
def test_fp8_block_follows_vllms_arithmetic_in_torch(dtype, shape):
    """vLLM's per_block_cast_to_fp8 in torch ops, per 2-D matrix: float32 amax per 128x128 block (zero padding),
    clamped to 1e-4, divided by 448; codes = fp8(x * (1 / sf)). The vLLM stage runs vLLM's own function."""
    w = weight(shape, dtype, seed=sum(shape))
    w.view(-1, shape[-1])[: min(128, w.shape[-2]), : min(128, shape[-1])] = 0  # an all-zero block (edge)
    codes, scale = ref.fp8_block(bits_of(w), DTYPES[dtype])
    for i, m in enumerate(w.reshape(-1, *shape[-2:])):
        rows, cols = m.shape
        padded = torch.zeros(-(-rows // 128) * 128, -(-cols // 128) * 128, dtype=dtype)
        padded[:rows, :cols] = m
        view = padded.view(-1, 128, padded.shape[1] // 128, 128)
        sf = view.abs().float().amax(dim=(1, 3), keepdim=True).clamp(1e-4) / 448.0
        theirs = (view * (1.0 / sf)).to(torch.float8_e4m3fn).view_as(padded)[:rows, :cols].contiguous()
        same(codes.reshape(-1, rows, cols)[i], theirs.view(torch.uint8).numpy(), f"{shape} matrix {i} codes")
        same(scale.reshape(-1, *scale.shape[-2:])[i], sf.view(view.shape[0], view.shape[2]).numpy(),
             f"{shape} matrix {i} scale_inv")


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("quantize", [ref.int4_group, ref.int8_channel, ref.fp8_block], ids=lambda f: f.__name__)
def test_non_finite_weights_are_refused_naming_the_element(quantize, bad):
    w = weight((8, 64), torch.bfloat16, seed=1, edges=False)
    w[3, 17] = bad
    with pytest.raises(QuantizeError, match=r"experts\.0\.up_proj\.weight: element 209 \(flat index\) is"):
        quantize(bits_of(w), "BF16", what="experts.0.up_proj.weight")


def test_shapes_and_dtypes_a_format_cannot_hold_are_refused():
    with pytest.raises(QuantizeError, match="multiple of 32"):
        ref.int4_group(np.zeros((4, 48), np.uint16), "BF16")
    with pytest.raises(QuantizeError, match="not I32"):
        ref.int8_channel(np.zeros((4, 48), np.uint32), "I32")
    with pytest.raises(QuantizeError, match="takes a matrix"):
        ref.fp8_block(np.zeros(48, np.uint16), "BF16")


def test_int4_packing_round_trips_and_puts_element_zero_in_the_low_nibble():
    codes = np.arange(-8, 8, dtype=np.int8).repeat(4).reshape(2, 32)
    packed = ref.pack_int4(codes)
    assert packed.shape == (2, 4) and packed.dtype == np.int32
    assert packed.view(np.uint32)[0, 0] & 0xF == 0  # -8 + 8
    assert np.array_equal(ref.unpack_int4(packed), codes)


# ---- reading a checkpoint's quantization_config --------------------------------------------------------------

KIMI_CONFIG = {  # compressed-tensors as Kimi K2's INT4 checkpoints declare it (routed experts only)
    "quant_method": "compressed-tensors", "format": "pack-quantized",
    "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
        "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32, "dynamic": False}}},
    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|down)_proj.*"],
}
W8A8_CONFIG = {
    "quant_method": "compressed-tensors", "format": "int-quantized",
    "config_groups": {"group_0": {"targets": ["Linear"],
                                  "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"},
                                  "input_activations": {"num_bits": 8, "type": "int", "symmetric": True,
                                                        "strategy": "token", "dynamic": True}}},
    "ignore": ["lm_head"],
}
FP8_CONFIG = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": [128, 128],
              "modules_to_not_convert": ["lm_head", "re:.*mlp\\.gate$"]}


def moe_state(dtype=torch.bfloat16) -> dict:
    s = {"model.embed_tokens.weight": torch.zeros(64, 128, dtype=dtype),
         "lm_head.weight": torch.zeros(64, 128, dtype=dtype),
         "model.norm.weight": torch.ones(128, dtype=dtype)}
    for layer in range(2):
        p = f"model.layers.{layer}"
        s[f"{p}.self_attn.q_proj.weight"] = torch.randn(128, 128).to(dtype)
        s[f"{p}.input_layernorm.weight"] = torch.ones(128, dtype=dtype)
        if layer == 0:
            s[f"{p}.mlp.gate_proj.weight"] = torch.randn(256, 128).to(dtype)
            continue
        s[f"{p}.mlp.gate.weight"] = torch.randn(4, 128).to(dtype)
        s[f"{p}.mlp.shared_experts.up_proj.weight"] = torch.randn(64, 128).to(dtype)
        for e in range(4):
            s[f"{p}.mlp.experts.{e}.up_proj.weight"] = torch.randn(64, 128).to(dtype)
            s[f"{p}.mlp.experts.{e}.down_proj.weight"] = torch.randn(128, 64).to(dtype)
    return s


def test_kimi_config_quantizes_routed_experts_only():
    q = from_config({"model_type": "kimi_k2", "quantization_config": KIMI_CONFIG})
    out = q(moe_state())
    routed = {n for n in out if ".experts." in n}
    assert routed and all(n.rsplit(".", 1)[1] in ("weight_packed", "weight_scale", "weight_shape") for n in routed)
    assert out["model.layers.1.mlp.experts.2.down_proj.weight_packed"].shape == (128, 8)
    assert out["model.layers.1.mlp.experts.2.down_proj.weight_scale"].shape == (128, 2)
    assert out["model.layers.1.mlp.experts.2.down_proj.weight_shape"].tolist() == [128, 64]
    # attention, the dense MLP, shared experts, the router, embeddings, norms and the head travel as they are
    untouched = {n for n in out if ".experts." not in n}
    assert untouched == {n for n in moe_state() if ".experts." not in n}
    assert out["model.layers.1.mlp.gate.weight"].dtype == torch.bfloat16


def test_w8a8_and_fp8_configs_name_the_tensors_the_engines_load():
    s = moe_state()
    out = from_config(W8A8_CONFIG)(s)
    assert out["model.layers.0.self_attn.q_proj.weight"].dtype == torch.int8
    assert out["model.layers.0.self_attn.q_proj.weight_scale"].shape == (128, 1)
    assert out["lm_head.weight"] is s["lm_head.weight"] and "model.embed_tokens.weight_scale" not in out
    fp8 = from_config(FP8_CONFIG)(s)
    assert fp8["model.layers.1.mlp.experts.0.down_proj.weight"].dtype == torch.float8_e4m3fn
    assert fp8["model.layers.1.mlp.experts.0.down_proj.weight_scale_inv"].shape == (1, 1)
    assert fp8["model.layers.1.mlp.gate.weight"].dtype == torch.bfloat16  # not converted, as the config says


def test_config_sources_a_checkpoint_folder_and_a_transformers_config(tmp_path):
    import json

    import transformers

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3", "quantization_config": W8A8_CONFIG}))
    assert from_config(tmp_path).rules == from_config(W8A8_CONFIG).rules
    cfg = transformers.Qwen3Config(vocab_size=64, hidden_size=128, num_hidden_layers=1, num_attention_heads=2,
                                   num_key_value_heads=1, intermediate_size=256)
    cfg.quantization_config = W8A8_CONFIG
    assert from_config(cfg).rules == [Rule(("Linear",), Int8Channel())]


@pytest.mark.parametrize("cfg, message", [
    ({"quant_method": "awq", "bits": 4}, "quant_method 'awq' is not one wsync makes"),
    ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "per-tensor FP8"),
    ({**KIMI_CONFIG, "config_groups": {"g": {"targets": ["Linear"], "weights": {
        "num_bits": 4, "type": "int", "symmetric": False, "strategy": "group", "group_size": 32}}}}, "not a format"),
    ({**KIMI_CONFIG, "format": "nvfp4-pack-quantized"}, "not a format"),
    ({**W8A8_CONFIG, "config_groups": {"g": {"targets": ["Linear"], "weights": {
        "num_bits": 8, "type": "int", "symmetric": True, "strategy": "tensor"}}}}, "per channel"),
    ({**KIMI_CONFIG, "config_groups": {"g": {"targets": "Linear", "weights": {}}}}, "targets must be"),
    ({"model_type": "qwen3"}, "no quantization_config"),
])
def test_configs_wsync_cannot_make_exactly_are_refused_by_name(cfg, message):
    with pytest.raises(QuantizeError, match=message):
        from_config(cfg)


# ---- the Quantizer over a state dict --------------------------------------------------------------------------

def test_rules_apply_in_order_and_ignore_wins():
    q = Quantizer([(["re:.*experts.*"], Int4Group()), (["Linear"], Fp8Block())], ignore=["re:.*experts\\.3\\..*"])
    out = q(moe_state())
    assert "model.layers.1.mlp.experts.0.up_proj.weight_packed" in out
    assert out["model.layers.1.mlp.experts.3.up_proj.weight"].dtype == torch.bfloat16
    assert out["model.layers.0.self_attn.q_proj.weight"].dtype == torch.float8_e4m3fn
    assert out["model.embed_tokens.weight"].dtype == torch.bfloat16  # no model given: embeddings are no Linear


def test_a_model_decides_what_linear_means():
    class Router(torch.nn.Module):  # a router that is no nn.Linear (as DeepSeek's and Kimi's are)
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(4, 128))

    model = torch.nn.Module()
    model.proj, model.gate, model.head = torch.nn.Linear(128, 64, bias=False), Router(), Router()
    state = {k: v.detach().bfloat16() for k, v in model.state_dict().items()}
    out = Quantizer([(["Linear"], Int8Channel())], model=model)(state)
    assert out["proj.weight"].dtype == torch.int8
    assert out["gate.weight"].dtype == out["head.weight"].dtype == torch.bfloat16
    assert Quantizer([(["Linear"], Int8Channel())])(state)["head.weight"].dtype == torch.int8  # by name: a Linear
    assert Quantizer([(["Linear"], Int8Channel())])(state)["gate.weight"].dtype == torch.bfloat16  # a router by name


def test_outputs_are_the_same_memory_every_version():
    """The Publisher finds a trainer's state again by its tensors' addresses (no copy per version): the
    quantized tensors must be too."""
    q, s = Quantizer([(["Linear"], Int4Group())]), moe_state()
    first = q(s)
    scale = "model.layers.0.self_attn.q_proj.weight_scale"
    before = first[scale].clone()
    for t in s.values():
        t.add_(1)
    second = q(s)
    assert all(first[n] is second[n] for n in first)
    # rewritten in place with the new version's values: what a fresh quantizer makes of them
    assert not torch.equal(second[scale], before)
    assert torch.equal(second[scale], Quantizer([(["Linear"], Int4Group())])(s)[scale])


def test_layout_predicts_the_quantized_state():
    q, s = from_config(KIMI_CONFIG), moe_state()
    shapes = {n: (tuple(t.shape), DTYPES[t.dtype]) for n, t in s.items()}
    assert q.layout(shapes) == {n: (tuple(t.shape), {torch.int32: "I32", torch.int64: "I64"}.get(t.dtype, "BF16"))
                                for n, t in q(s).items()}


def test_numpy_and_tensorbits_states_quantize_to_the_same_bytes():
    from wsync.snapshot import as_state

    s = moe_state()
    q = from_config(KIMI_CONFIG)
    want = as_state(q(s))
    got = as_state(from_config(KIMI_CONFIG)(as_state(s)))
    assert want.keys() == got.keys()
    for n in want:
        same(got[n].bits, want[n].bits, n)


def test_a_weight_its_scheme_cannot_hold_is_named():
    s = {"model.layers.0.mlp.experts.0.up_proj.weight": torch.zeros(64, 100, dtype=torch.bfloat16)}
    with pytest.raises(QuantizeError, match=r"experts\.0\.up_proj\.weight: INT4 groups of 32"):
        Quantizer([(["Linear"], Int4Group())])(s)
    with pytest.raises(QuantizeError, match="take BF16, F16, F32 weights, not I32"):
        Quantizer([(["Linear"], Int8Channel())])({"a.weight": torch.zeros(4, 64, dtype=torch.int32)})
