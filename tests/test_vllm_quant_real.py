"""Quantized weights against vLLM itself (the CPU build) and the quantizers its venv pins.

Two parts, both run in CI's vLLM stage:

- Bytes: wsync.quant's output (the numpy reference and each host backend) equals, byte for byte, vLLM's own
  block FP8 cast (``vllm.utils.deep_gemm.per_block_cast_to_fp8``) and compressed-tensors' INT4 group /
  INT8 channel quantizers as vLLM's venv pins them, on every shape class of a Qwen3-MoE / Kimi-like layer
  and on edge values (all-zero rows and blocks, ties, subnormals, the largest finite values). A divergence
  fails naming the tensor and the element.
- Serving: a quantizing Publisher feeds a vLLM engine serving a compressed-tensors checkpoint of a tiny random Qwen3,
  W8A8 INT8 (channel weights, dynamic per-token activations) or W4A16 INT4 groups of 32 ("pack-quantized", Kimi K2's
  expert format, here on every Linear: vLLM's CPU build serves INT4 MoE experts only on CPUs with AMX or through
  zentorch), over keyframes and deltas. After every version the digest each worker reports equals that of the
  trainer's state quantized, and the engine holds what vLLM makes of that version's checkpoint read from disk (a
  second engine reloading each version's folder with vLLM's own loader): the same tensors, byte for byte, and the same
  greedy tokens on every prompt. The last version is also started fresh from its folder, so the reload path is itself
  held to a cold start; and every version's tokens are those of transformers holding the weights the checkpoint stands
  for, on the prompts it decides by a margin (as tests/test_vllm_real.py does), so two engines wrong in the same way
  fail too.

Skipped where vLLM does not import; with WSYNC_REQUIRE_VLLM=1 (the CI stage) that is a failure instead.
"""
from __future__ import annotations

import os

import numpy as np
import pytest

from helpers import TOKEN, import_or_skip

(vllm,) = import_or_skip("vllm")

import torch  # noqa: E402

from wsync import backends  # noqa: E402
from wsync.errors import BackendUnavailable  # noqa: E402
from wsync.integrations.common import token_id  # noqa: E402
from wsync.quant import Fp8Block, Int4Group, Int8Channel, Quantizer, Rule, from_config  # noqa: E402
from wsync.snapshot import as_state, digest  # noqa: E402
from wsync.sync import Publisher  # noqa: E402
from vllm_helpers import POOL, checkpoint, reference, rl_version, vllm_tokens  # noqa: E402
from vllm_quant_helpers import (FUSED, INT4_W4A16, INT8_W8A8, PROBE, dequantized, quantized_layers,  # noqa: E402
                                write_checkpoint)

HERE = os.path.dirname(os.path.abspath(__file__))
VERSIONS = 6
KEYFRAME_EVERY = 3  # the publisher's history starts again at version 3
RESUBSCRIBE = 3  # the engine subscribes afresh once version 3 is out: it gets that keyframe; 1, 2, 4, 5 are deltas


# ---- bytes: wsync.quant against vLLM's and compressed-tensors' own code ----------------------------------------

# The shape classes of one Qwen3-MoE / Kimi-K2-like decoder layer, scaled down; each keeps what makes its class
# different for the formats: rows or columns short of a 128 block, several blocks, a part block at an edge,
# experts stacked on a leading axis, and a router with few rows.
SHAPES = {
    "self_attn.q_proj": (512, 256),  # GQA query: several full blocks
    "self_attn.k_proj": (64, 256),  # fewer rows than a block
    "self_attn.o_proj": (256, 512),
    "self_attn.q_a_proj": (192, 256),  # MLA low-rank query: a block and a half of rows
    "self_attn.kv_a_proj_with_mqa": (288, 224),  # MLA latent + rope rows (Kimi: 576): part blocks both ways
    "self_attn.kv_b_proj": (256, 160),
    "mlp.experts.gate_up": (4, 192, 256),  # routed experts, stacked
    "mlp.experts.down_proj": (4, 256, 96),  # routed expert down: fewer columns than a block
    "mlp.shared_experts.gate_proj": (96, 256),
    "mlp.gate": (16, 256),  # the router
    "lm_head": (1000, 256),  # vocabulary rows, a part block at the end
}
DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}


def weight(shape, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Trained-looking values with each format's edge cases at known places (in the first matrix of a stack):
    an all-zero row (all-zero groups and channels); rows of ties for INT4 (every group's absmax 7.5: scale
    1, codes at x.5) and INT8 (absmax 127.5); a row of FP8 ties and FP8 subnormals (amax 448: scale 1); a
    row of the weight dtype's subnormals; a row whose absmax is negative; the dtype's largest finite values
    (in a block of their own where the matrix has one); where there are 256 rows, a 128x128 block far below
    FP8's amax floor and, with 256 columns, an all-zero block."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=g) * 0.02).to(dtype)
    m = x.view(-1, shape[-2], shape[-1])[0]
    rows, cols = m.shape
    k = torch.arange(cols, dtype=torch.float32)
    m[0] = 0
    row = torch.where(k % 2 == 0, 0.5, -2.5) + (k % 5)  # 0.5 .. 4.5 and -2.5 .. 1.5: x.5 under scale 1
    row[::32] = 7.5
    m[1 % rows] = row.to(dtype)
    m[2 % rows] = torch.where(k % 3 == 0, 126.5, -0.5).to(dtype)
    m[2 % rows, 1] = -127.5
    fp8 = torch.tensor([448.0, 1.0625, -1.1875, 2.0 ** -7 * 1.5, 2.0 ** -10, -(2.0 ** -9) * 3, 13.0, 0.0])
    m[3 % rows] = fp8.repeat(cols // 8 + 1)[:cols].to(dtype)
    m[4 % rows, ::3] = torch.finfo(dtype).tiny / 4 if dtype != torch.float16 else 2.0 ** -24
    m[5 % rows] = m[5 % rows].abs()
    m[5 % rows, cols // 2] = -3.0
    big = torch.finfo(dtype).max * torch.where(k % 2 == 0, 1.0, -0.5)
    at = slice(128, None) if cols >= 256 else slice(None)
    m[6 % rows, at] = big[at].to(dtype)
    if rows >= 256 and cols >= 128:
        m[128:256, :128] = 1e-6
    if rows >= 256 and cols >= 256:
        m[128:256, 128:256] = 0
    return x


def bits_of(t: torch.Tensor) -> np.ndarray:
    """A tensor's bytes as unsigned integers of its width (bit patterns: -0.0 and NaNs compare as bits)."""
    width = {1: torch.uint8, 2: torch.uint16, 4: torch.uint32, 8: torch.int64}[t.element_size()]
    return t.detach().contiguous().view(width).numpy()


def same_bytes(got: np.ndarray, want: np.ndarray, what: str) -> None:
    """got == want bit for bit; otherwise fail naming the first element that differs and how many do."""
    assert got.shape == want.shape, f"{what}: shape {got.shape}, theirs {want.shape}"
    assert got.dtype.itemsize == want.dtype.itemsize, f"{what}: {got.dtype} against {want.dtype}"
    g = np.ascontiguousarray(got).view(f"u{got.dtype.itemsize}")
    w = np.ascontiguousarray(want).view(f"u{want.dtype.itemsize}")
    bad = g != w
    if bad.any():
        at = np.unravel_index(int(np.flatnonzero(bad)[0]), bad.shape)
        pytest.fail(f"{what}: element {tuple(int(i) for i in at)} is {g[at]:#x} in wsync, {w[at]:#x} in theirs "
                    f"({int(bad.sum())} of {bad.size} elements differ)")


def host_backends() -> list[str]:
    out = []
    for name in backends.AUTO_ORDER:
        try:
            backends.kernels(name)
        except BackendUnavailable:
            continue
        out.append(name)
    return out


def wsync_outputs(scheme, x: torch.Tensor, backend: str) -> dict[str, torch.Tensor]:
    """What a Quantizer on `backend` makes of `x` as one Linear's weight, by output suffix."""
    q = Quantizer([Rule(("Linear",), scheme)], backend=backend)
    return {n.rpartition(".")[2]: t for n, t in q({"layer.weight": x}).items()}


def ct_int8_channel(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """compressed-tensors: the min-max of each output channel, its qparams, its quantize (one Linear)."""
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import quantize
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    args = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="channel")
    scale, zp = calculate_qparams(x.amin(dim=-1, keepdim=True), x.amax(dim=-1, keepdim=True), args)
    return quantize(x, scale, zp, args, dtype=torch.int8), scale


def ct_int4_group(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """compressed-tensors: group qparams (compute_dynamic_scales_and_zp), quantize, pack_to_int32."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import quantize
    from compressed_tensors.quantization.utils.helpers import compute_dynamic_scales_and_zp

    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=group)
    scale, zp = compute_dynamic_scales_and_zp(x, args, module=None)
    codes = quantize(x, scale, zp, args, dtype=torch.int8)
    return pack_to_int32(codes, 4), scale


def per_matrix(x: torch.Tensor, fn) -> list[torch.Tensor]:
    """fn on every matrix of x (experts stacked on leading axes are one Linear each), outputs stacked back."""
    mats = x.reshape(-1, *x.shape[-2:])
    outs = [fn(m) for m in mats]
    return [torch.stack([o[i] for o in outs]).reshape(*x.shape[:-2], *outs[0][i].shape) for i in range(len(outs[0]))]


def test_compressed_tensors_is_the_version_vllm_pins():
    import compressed_tensors

    assert compressed_tensors.__version__.startswith("0.17"), compressed_tensors.__version__


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", SHAPES)
def test_int8_channel_equals_compressed_tensors(name, dtype):
    x = weight(SHAPES[name], DTYPES[dtype], seed=list(SHAPES).index(name))
    codes, scale = per_matrix(x, ct_int8_channel)
    for backend in host_backends():
        got = wsync_outputs(Int8Channel(), x, backend)
        same_bytes(bits_of(got["weight"]), bits_of(codes), f"{name} {dtype} INT8 codes ({backend})")
        same_bytes(bits_of(got["weight_scale"]), bits_of(scale.to(x.dtype)), f"{name} {dtype} INT8 scale ({backend})")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", SHAPES)
def test_int4_group_equals_compressed_tensors(name, dtype):
    x = weight(SHAPES[name], DTYPES[dtype], seed=list(SHAPES).index(name))
    packed, scale = per_matrix(x, lambda m: ct_int4_group(m, 32))
    for backend in host_backends():
        got = wsync_outputs(Int4Group(32), x, backend)
        same_bytes(bits_of(got["weight_packed"]), bits_of(packed), f"{name} {dtype} INT4 packed ({backend})")
        same_bytes(bits_of(got["weight_scale"]), bits_of(scale.to(x.dtype)), f"{name} {dtype} INT4 scale ({backend})")
        assert got["weight_shape"].tolist() == list(x.shape)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", SHAPES)
def test_fp8_block_equals_vllm(name, dtype):
    from vllm.utils.deep_gemm import per_block_cast_to_fp8

    x = weight(SHAPES[name], DTYPES[dtype], seed=list(SHAPES).index(name))
    codes, scale = per_matrix(x, lambda m: per_block_cast_to_fp8(m, [128, 128]))
    for backend in host_backends():
        got = wsync_outputs(Fp8Block((128, 128)), x, backend)
        same_bytes(bits_of(got["weight"]), bits_of(codes), f"{name} {dtype} FP8 codes ({backend})")
        same_bytes(bits_of(got["weight_scale_inv"]), bits_of(scale), f"{name} {dtype} FP8 scale_inv ({backend})")


def test_a_divergence_names_the_element():
    want = np.arange(12, dtype=np.int8).reshape(3, 4)
    got = want.copy()
    got[2, 1] = 99
    with pytest.raises(pytest.fail.Exception, match=r"element \(2, 1\) is 0x63 in wsync, 0x9 in theirs"):
        same_bytes(got, want, "t")


# ---- serving: a quantizing Publisher -> vLLM (CPU) on a W8A8 INT8 checkpoint -----------------------------------

@pytest.fixture(scope="module")
def probe_env(vllm_env):
    """vLLM's workers import the test's worker extension by name: this folder goes on their PYTHONPATH."""
    vllm_env.setenv("PYTHONPATH", os.pathsep.join(p for p in (HERE, os.environ.get("PYTHONPATH")) if p))
    return vllm_env


def start_llm(path: str):
    return vllm.LLM(model=path, skip_tokenizer_init=True, dtype="bfloat16", enforce_eager=True, max_model_len=128,
                    max_num_seqs=8, seed=0, worker_extension_cls=PROBE)


def stop(llm) -> None:
    llm.llm_engine.engine_core.shutdown()


def tokens(llm) -> list[list[int]]:
    assert llm.reset_prefix_cache()  # cached prompt blocks were computed with the previous weights
    return vllm_tokens(llm, POOL)


SERVED = {"int8-w8a8": INT8_W8A8, "int4-w4a16": INT4_W4A16}


@pytest.mark.parametrize("fmt", SERVED)
def test_engine_follows_quantizing_publisher(fmt, tmp_path, probe_env):
    qcfg = SERVED[fmt]
    trainer = checkpoint(str(tmp_path / "bf16"))
    config = {k: v for k, v in trainer.config.to_dict().items() if k != "quantization_config"}
    expect = from_config(qcfg)  # the test's own quantizer: the publisher's holds its own buffers
    start = tmp_path / "start"
    write_checkpoint(str(start), config, qcfg, expect(trainer.state_dict()))
    live, disk = start_llm(str(start)), start_llm(str(start))
    try:
        gen, changed, kinds, before = torch.Generator().manual_seed(1), 0, [], tokens(live)
        decided = reference(dequantized(trainer, expect(trainer.state_dict())))[1]
        assert [before[POOL.index(list(p))] for p in decided] == list(decided.values()), "the starting checkpoint"
        with Publisher("tcp://127.0.0.1:0", token=TOKEN, quantize=qcfg, keyframe_every=KEYFRAME_EVERY) as pub:
            live.collective_rpc("wsync_subscribe", args=(pub.address, token_id(TOKEN)))
            for v in range(VERSIONS):
                rl_version(trainer, gen)
                pub.publish(trainer.state_dict(), version=v)
                if v == RESUBSCRIBE:  # an engine that lost its subscription: the newest keyframe brings it back
                    live.collective_rpc("wsync_close")
                    live.collective_rpc("wsync_subscribe", args=(pub.address, token_id(TOKEN)))
                assert live.collective_rpc("wsync_update", args=(v, 120.0)) == [v]
                [committed] = live.collective_rpc("probe_committed")
                kinds.append(committed["keyframe"])
                quantized = expect(trainer.state_dict())
                want = digest(as_state(quantized))
                for st in live.collective_rpc("wsync_status"):
                    assert st == {"version": v, "digest": want, "failures": 0}, f"version {v}"
                folder = tmp_path / f"v{v}"
                write_checkpoint(str(folder), config, qcfg, quantized)
                disk.collective_rpc("probe_reload", args=(str(folder),))
                assert live.collective_rpc("probe_held") == disk.collective_rpc("probe_held"), f"version {v}"
                if qcfg is INT8_W8A8:  # INT8 layers keep their scales as loaded; the INT4 kernel blocks them anew
                    _scales_are_sent(live, quantized)
                got = tokens(live)
                assert got == tokens(disk), f"version {v}: the live engine's tokens differ from the checkpoint's"
                decided = reference(dequantized(trainer, quantized))[1]
                assert [got[POOL.index(list(p))] for p in decided] == list(decided.values()), \
                    f"version {v}: vLLM's tokens differ from transformers' on the weights the checkpoint holds"
                changed += sum(a != b for a, b in zip(got, before))
                before = got
            live.collective_rpc("wsync_close")
        assert kinds == [v in (0, RESUBSCRIBE) for v in range(VERSIONS)], f"keyframes where: {kinds}"
        assert changed > 0, "no version changed a greedy path: the comparison proves nothing"
        last_tokens, last_held = tokens(live), live.collective_rpc("probe_held")
    finally:
        stop(disk)
        stop(live)
    cold = start_llm(str(tmp_path / f"v{VERSIONS - 1}"))
    try:
        assert cold.collective_rpc("probe_held") == last_held
        assert tokens(cold) == last_tokens
    finally:
        stop(cold)


def _scales_are_sent(llm, quantized: dict) -> None:
    """No requantizing: every quantized layer's weight scale in the workers is the one sent (as float32)."""
    for module, parts in quantized_layers(quantized, FUSED).items():
        want = torch.cat([quantized[f"{p}.weight_scale"] for p in parts]).float()
        for dtype, shape, raw in llm.collective_rpc("probe_tensor", args=(f"{module}.weight_scale",)):
            assert (dtype, shape) == (str(want.dtype), list(want.shape)), module
            assert bytes.fromhex(raw) == want.numpy().tobytes(), f"{module}: the scales held are not those sent"
