"""engines.HF serving a compressed-tensors model: it takes codes and scales as they are, version after version.

The trainer is BF16; ``Publisher(quantize=...)`` sends what the quantized checkpoint holds (wsync.quant). The
engine is transformers' own load of such a checkpoint with the weights left compressed (``dequantize=False``,
the default), whose quantized Linears hold ``weight_packed`` / ``weight_scale`` / ``weight_shape`` (INT4
pack-quantized) or an int8 ``weight`` and its ``weight_scale`` (INT8 channel) as their parameters.

Two things about transformers 5 with compressed-tensors 0.20 shape these tests:

- there is no compressed forward on the CPU: the first forward pass decompresses the whole model in place
  (a forward pre-hook), after which it holds BF16 weights again. So the engine's logits are taken from a
  decompressed copy of it, which is exactly what that first forward pass would compute;
- a MoE whose experts transformers fuses into 3-D tensors (its Qwen3-MoE) is decompressed while loading, so
  codes and scales are kept only where each expert is a Linear of its own: the model here is a Qwen3 whose
  MLPs are MoE blocks with a Linear per expert, Kimi K2's layout.
"""
from __future__ import annotations

import copy
import json

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")

from engine_helpers import publisher, rl_step, same_bytes, subscriber  # noqa: E402
from wsync import encode, engines  # noqa: E402
from wsync import quant as wq  # noqa: E402
from wsync.engines import moe  # noqa: E402
from wsync.errors import ChecksumError, MismatchError, VersionError  # noqa: E402
from wsync.payload import Payload  # noqa: E402
from wsync.snapshot import as_state, digest  # noqa: E402
from wsync.subscriber import apply_version  # noqa: E402

from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP  # noqa: E402

EXPERTS, TOP_K = 4, 2


class MoeBlock(torch.nn.Module):
    """A router, a Linear per routed expert, and a shared expert (the names Kimi K2's checkpoints use)."""

    def __init__(self, config):
        super().__init__()
        self.gate = torch.nn.Linear(config.hidden_size, EXPERTS, bias=False)
        self.experts = torch.nn.ModuleList(Qwen3MLP(config) for _ in range(EXPERTS))
        self.shared_experts = Qwen3MLP(config)

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        weights, chosen = torch.softmax(self.gate(flat).float(), dim=-1).topk(TOP_K, dim=-1)
        out = self.shared_experts(flat)
        for e, expert in enumerate(self.experts):
            rows, slot = torch.where(chosen == e)
            if len(rows):
                out = out.index_add(0, rows, (expert(flat[rows]) * weights[rows, slot, None]).to(out.dtype))
        return out.reshape(x.shape)


class TinyMoe(transformers.Qwen3ForCausalLM):
    def __init__(self, config):
        super().__init__(config)
        for layer in self.model.layers:
            layer.mlp = MoeBlock(config)
        self.post_init()


def trainer_model(seed: int) -> TinyMoe:
    torch.manual_seed(seed)
    cfg = transformers.Qwen3Config(vocab_size=256, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                                   tie_word_embeddings=False, max_position_embeddings=64)
    return TinyMoe(cfg).to(torch.bfloat16).eval()


def _weights(bits: int, **kw) -> dict:
    return {"num_bits": bits, "type": "int", "symmetric": True, "dynamic": False, "observer": "minmax",
            "actorder": None, "block_structure": None, **kw}


# Kimi K2's format: INT4 groups of 32 on the routed experts; attention, shared experts, router and head stay BF16
INT4_EXPERTS = {
    "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
    "config_groups": {"group_0": {"targets": ["Linear"], "format": "pack-quantized",
                                  "weights": _weights(4, strategy="group", group_size=32),
                                  "input_activations": None, "output_activations": None}},
    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", r"re:.*mlp\.gate$"], "kv_cache_scheme": None}

# W8A8: INT8 channel weights on every Linear but the router and head (activations are quantized at run time)
INT8_W8A8 = {
    "quant_method": "compressed-tensors", "format": "int-quantized", "quantization_status": "compressed",
    "config_groups": {"group_0": {"targets": ["Linear"], "format": "int-quantized",
                                  "weights": _weights(8, strategy="channel"),
                                  "input_activations": _weights(8, strategy="token", dynamic=True, observer=None),
                                  "output_activations": None}},
    "ignore": ["lm_head", r"re:.*mlp\.gate$"], "kv_cache_scheme": None}

FORMATS = {"int4_experts": INT4_EXPERTS, "int8_w8a8": INT8_W8A8}


def write_checkpoint(path, model, quantized: dict, qc: dict):
    """A compressed-tensors checkpoint folder: the quantized state and the model's config with qc in it."""
    import safetensors.torch

    path.mkdir(parents=True, exist_ok=True)
    safetensors.torch.save_file({n: t.detach().contiguous() for n, t in quantized.items()},
                                str(path / "model.safetensors"), metadata={"format": "pt"})
    cfg = model.config.to_dict()
    cfg["quantization_config"] = qc
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def load_compressed(path) -> TinyMoe:
    """transformers' load with the weights kept compressed: codes and scales are the Linears' parameters."""
    return TinyMoe.from_pretrained(str(path)).eval()


def logits(model):
    """Logits of a compressed model as its first forward pass computes them, taken on a decompressed copy so
    the model itself keeps its codes and scales."""
    from compressed_tensors.compressors import ModelCompressor

    dense = copy.deepcopy(model)
    # the copy carries the model's forward pre-hooks (compressed-tensors' decompression, an engine's refusal of
    # it): drop them from the copy and decompress it as that hook would
    dense._forward_pre_hooks.clear()
    if hasattr(dense, "ct_decompress_hook"):
        delattr(dense, "ct_decompress_hook")
    ModelCompressor.from_compression_config(dense.config.quantization_config).decompress_model(dense)
    assert all(t.is_floating_point() for n, t in dense.state_dict().items() if n.endswith(".weight"))
    assert not any(n.endswith("weight_packed") for n in dense.state_dict())
    return forward(dense)


def forward(model):
    with torch.no_grad():
        return model(torch.arange(24).reshape(2, 12) * 7 % 256).logits


def bytes_of(t) -> bytes:
    return t.detach().contiguous().view(torch.uint8).numpy().tobytes()


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(7)


@pytest.fixture(params=sorted(FORMATS))
def fmt(request):
    return request.param


def test_the_compressed_load_holds_codes_and_scales(fmt, tmp_path):
    """What the engine is: transformers' load of the checkpoint keeps exactly wsync.quant's tensors."""
    qc = FORMATS[fmt]
    trainer = trainer_model(0)
    want = wq.from_config(qc, model=trainer)(trainer.state_dict())
    model = load_compressed(write_checkpoint(tmp_path / "ckpt", trainer, want, qc))
    held = model.state_dict()
    assert same_bytes(held, {n: t.detach() for n, t in want.items()})
    kinds = {(n.rsplit(".", 1)[1], str(t.dtype)) for n, t in held.items() if t.dtype != torch.bfloat16}
    if fmt == "int4_experts":
        assert kinds == {("weight_packed", "torch.int32"), ("weight_shape", "torch.int64")}
        assert all(".experts." in n and ".shared_experts." not in n for n in held if n.endswith("weight_packed"))
        assert "model.layers.0.self_attn.q_proj.weight" in held and "model.layers.0.mlp.gate.weight" in held
    else:
        assert kinds == {("weight", "torch.int8")}
        assert held["model.layers.1.self_attn.o_proj.weight"].dtype == torch.int8
        assert held["model.layers.1.mlp.gate.weight"].dtype == torch.bfloat16
    assert torch.equal(logits(model), logits(model))  # the copy is decompressed, the engine's model is not
    assert same_bytes(model.state_dict(), {n: t.detach() for n, t in want.items()})


def test_engine_follows_a_quantized_publisher_exactly(fmt, tmp_path, gen):
    """Keyframes and deltas of codes and scales: after every version the engine holds q(trainer) byte for byte,
    its digest is that state's, and its logits are those of a fresh load of that version's checkpoint."""
    qc = FORMATS[fmt]
    trainer, stale = trainer_model(0), trainer_model(1)
    expect = wq.from_config(qc, model=trainer)  # its own buffers: the publisher's are its delta base
    start = write_checkpoint(tmp_path / "start", stale, expect(stale.state_dict()), qc)
    model = load_compressed(start)
    engine = engines.HF(model)
    ptrs = {n: t.data_ptr() for n, t in model.state_dict().items()}
    # the publisher reads the engine's checkpoint config, as a deployment would
    with publisher(keyframe_every=3, bucket_bytes=16 << 10, quantize=str(start)) as pub, \
            subscriber(pub, engine) as sub:
        for v in range(5):
            rl_step(trainer, gen)
            pub.publish(trainer.state_dict(), version=v)
            sub.wait_for(v, timeout=60)
            want = {n: t.detach() for n, t in expect(trainer.state_dict()).items()}
            assert same_bytes(model.state_dict(), want), v
            assert engine.digest() == digest(as_state(want))
            fresh = load_compressed(write_checkpoint(tmp_path / f"v{v}", trainer, want, qc))
            assert bytes_of(logits(model)) == bytes_of(forward(fresh)), v  # fresh: decompressed by its own forward
            assert all(t.is_floating_point() for n, t in fresh.state_dict().items() if n.endswith(".weight"))
        assert sub.stats.failures == 0 and not sub.stats.last.keyframe  # the last version came as a delta
    assert ptrs == {n: t.data_ptr() for n, t in model.state_dict().items()}  # written in place, never reallocated


def _next_version(fmt, tmp_path, gen):
    """An engine on version A of a quantized model, and the payload taking it to version B."""
    qc = FORMATS[fmt]
    trainer = trainer_model(0)
    q = wq.from_config(qc, model=trainer)
    model = load_compressed(write_checkpoint(tmp_path / "a", trainer, q(trainer.state_dict()), qc))
    rl_step(trainer, gen, density=0.2)
    new = {n: t.detach().clone() for n, t in q(trainer.state_dict()).items()}
    return model, new


def test_corrupt_or_truncated_payload_leaves_the_previous_version(fmt, tmp_path, gen):
    model, new = _next_version(fmt, tmp_path, gen)
    engine = engines.HF(model)
    before = {n: t.clone() for n, t in model.state_dict().items()}
    p = encode(engine.tensors(), new, codec="delta")
    body = bytearray(p.body)
    body[len(body) // 2] ^= 0x40
    with pytest.raises(ChecksumError):
        apply_version(engine, [Payload(p.manifest, memoryview(body))], p.manifest.checksum)
    assert same_bytes(model.state_dict(), before)
    with pytest.raises(ChecksumError):
        apply_version(engine, [Payload(p.manifest, memoryview(bytes(p.body)[: len(p.body) // 2]))],
                      p.manifest.checksum)
    assert same_bytes(model.state_dict(), before)
    with pytest.raises(ChecksumError, match="digest"):
        apply_version(engine, [p], "0" * 16)
    assert same_bytes(model.state_dict(), before)
    apply_version(engine, [p], p.manifest.checksum)
    assert same_bytes(model.state_dict(), new) and engine.digest() == digest(as_state(new))


class _DiesMidLoad(engines.HF):
    """A guarded engine (every update goes through load) whose next load, once armed, writes one tensor and
    raises."""

    calls = 0
    armed = True

    def load(self, named):
        self.calls += 1
        if self.armed:
            self.armed = False
            super().load(dict(list(named.items())[:1]))
            raise VersionError("the engine died mid-load")
        super().load(named)


def test_a_load_that_raises_leaves_the_previous_version(fmt, tmp_path, gen):
    model, new = _next_version(fmt, tmp_path, gen)
    engine = _DiesMidLoad(model, guarded=True)
    before = {n: t.clone() for n, t in model.state_dict().items()}
    p = encode(engine.tensors(), new, codec="delta")
    with pytest.raises(VersionError, match="mid-load"):
        apply_version(engine, [p], p.manifest.checksum)
    assert engine.calls == 2  # the load that died, then the one that put the previous version back
    assert same_bytes(model.state_dict(), before)
    apply_version(engine, [p], p.manifest.checksum)
    assert same_bytes(model.state_dict(), new)


def test_a_subscriber_recovers_from_a_load_that_raises(tmp_path, gen):
    """Over the wire: the quantized version whose load dies is refused, the engine asks again and then holds
    that version's codes and scales exactly."""
    qc = INT4_EXPERTS
    trainer = trainer_model(0)
    expect = wq.from_config(qc, model=trainer)
    model = load_compressed(write_checkpoint(tmp_path / "a", trainer_model(1), expect(trainer_model(1).state_dict()),
                                             qc))
    engine = _DiesMidLoad(model, guarded=True)
    engine.armed = False
    with publisher(quantize=wq.from_config(qc, model=trainer)) as pub, subscriber(pub, engine) as sub:
        for v in range(3):
            engine.armed = v == 1
            rl_step(trainer, gen)
            pub.publish(trainer.state_dict(), version=v)
            sub.wait_for(v, timeout=60)
            assert same_bytes(model.state_dict(), {n: t.detach() for n, t in expect(trainer.state_dict()).items()})
        assert sub.stats.failures == 1 and not engine.armed


def test_bf16_to_an_engine_holding_codes_is_refused(tmp_path, gen):
    """A publisher without quantize= sends weights where the engine holds codes and scales: the version is
    refused by name before anything is written, rather than requantized or misread."""
    qc = INT4_EXPERTS
    trainer = trainer_model(0)
    model = load_compressed(write_checkpoint(tmp_path / "a", trainer, wq.from_config(qc)(trainer.state_dict()), qc))
    before = {n: t.clone() for n, t in model.state_dict().items()}
    rl_step(trainer, gen)
    p = encode(trainer.state_dict(), trainer.state_dict(), codec="raw")
    with pytest.raises(MismatchError, match="payload-only"):
        apply_version(engines.HF(model), [p], p.manifest.checksum)
    assert same_bytes(model.state_dict(), before)


def test_fused_experts_are_decompressed_on_load_so_codes_are_refused(tmp_path):
    """transformers' own Qwen3-MoE fuses its experts into 3-D tensors and decompresses a Kimi-format checkpoint's
    experts into them while loading: that engine holds BF16 experts, and a version of codes and scales for them
    is refused by name, never written into the wrong layout."""
    torch.manual_seed(0)
    cfg = transformers.Qwen3MoeConfig(vocab_size=256, hidden_size=64, intermediate_size=64, moe_intermediate_size=64,
                                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                                      num_experts=EXPERTS, num_experts_per_tok=TOP_K, max_position_embeddings=64,
                                      tie_word_embeddings=False)
    trainer = transformers.Qwen3MoeForCausalLM(cfg).to(torch.bfloat16).eval()
    per_expert = moe.split_fused(trainer.state_dict())  # the checkpoint's names: a Linear per expert
    quantized = {n: t.detach().clone() for n, t in wq.from_config(INT4_EXPERTS)(per_expert).items()}
    assert any(n.endswith("experts.0.gate_proj.weight_packed") for n in quantized)
    path = write_checkpoint(tmp_path / "ckpt", trainer, quantized, INT4_EXPERTS)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path)).eval()
    held = model.state_dict()
    assert held["model.layers.0.mlp.experts.gate_up_proj"].dtype == torch.bfloat16
    assert not any("weight_packed" in n for n in held)
    engine = engines.HF(model, experts="per_expert")
    before = {n: t.clone() for n, t in held.items()}
    p = encode(engine.tensors(), quantized, codec="raw")
    with pytest.raises(MismatchError, match="payload-only"):
        apply_version(engine, [p], p.manifest.checksum)
    assert same_bytes(model.state_dict(), before)


def test_a_forward_pass_that_would_decompress_the_engine_is_refused(fmt, tmp_path, gen):
    """transformers' first forward pass would swap the codes and scales for new BF16 parameters, and every later
    version would be written into memory the model no longer reads: with an engine on it, that pass raises and
    the model keeps what it holds, still in sync."""
    from wsync.engines import hf

    model, new = _next_version(fmt, tmp_path, gen)
    engine = engines.HF(model)
    engines.HF(model, guarded=True)  # a second engine on the model adds no second refusal
    assert sum(h is hf._refuse_decompressing for h in model._forward_pre_hooks.values()) == 1
    before = {n: t.clone() for n, t in model.state_dict().items()}
    with pytest.raises(MismatchError, match="decompress"):
        forward(model)
    assert same_bytes(model.state_dict(), before)
    p = encode(engine.tensors(), new, codec="delta")
    apply_version(engine, [p], p.manifest.checksum)
    assert same_bytes(model.state_dict(), new)
    assert torch.equal(logits(model), forward(load_compressed(write_checkpoint(tmp_path / "b", trainer_model(0),
                                                                                new, FORMATS[fmt]))))
