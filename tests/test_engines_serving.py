"""vLLM- and SGLang-style engines on CPU: the adapters driven through stand-ins with the frameworks' verbs.

The stand-ins implement the documented behaviour of the verbs we call (vLLM's
``model.load_weights`` stacking q/k/v and gate/up into fused parameters,
SGLang's ``update_weights_from_tensor`` / LoRA loader answering (success,
message)); the signatures themselves are checked against the released source
in test_engines_signatures.py, and the real frameworks in the gpu-marked test.
"""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from helpers import TOKEN  # noqa: E402
from engine_helpers import fuse, publisher, rl_step, subscriber, tiny_qwen  # noqa: E402
from wsync import engines  # noqa: E402
from wsync.engines.sglang import SGLang  # noqa: E402
from wsync.engines.staged import EngineError  # noqa: E402
from wsync.integrations.common import token_id  # noqa: E402
from wsync.engines.vllm import LoadWeights, WsyncWorkerExtension, kernel_format, write_adapter  # noqa: E402
from wsync.errors import MismatchError  # noqa: E402

STACKED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
           "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


def vllm_like(seed: int):
    """A fused Qwen3 whose load_weights takes checkpoint names, as vLLM's models do."""
    model = tiny_qwen(seed)
    fuse(model)
    params = dict(model.named_parameters())
    sizes = {"qkv_proj": (32, 16, 16), "gate_up_proj": (64, 64)}
    model.fail_next = False

    def load_weights(weights):
        for name, t in weights:
            if model.fail_next:
                model.fail_next = False
                raise RuntimeError("worker died mid-load")
            seg = name.split(".")
            hit = next((s for s in seg if s in STACKED), None)
            if hit is None:
                params[name].data.copy_(t)
                continue
            fused, shard = STACKED[hit]
            dst = params[name.replace(hit, fused)].data
            off = sum(sizes[fused][:shard])
            dst.narrow(0, off, sizes[fused][shard]).copy_(t)

    model.load_weights = load_weights
    return model


def live_digest(model) -> str:
    return engines.HF(model, fused=engines.qkv_gate_up(q=32, kv=16)).digest()


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(5)


def test_load_weights_engine_follows_exactly(gen):
    trainer, served = tiny_qwen(0), vllm_like(1)
    engine = LoadWeights(served)
    with publisher(keyframe_every=3) as pub, subscriber(pub, engine) as sub:
        for v in range(5):
            rl_step(trainer, gen)
            pub.publish(trainer.state_dict(), version=v)
            sub.wait_for(v, timeout=30)
            want = engines.HF(trainer).digest()
            assert engine.digest() == want and live_digest(served) == want  # host copy and live weights
        assert sub.stats.failures == 0


def test_failed_push_rolls_back_then_recovers(gen):
    trainer, served = tiny_qwen(0), vllm_like(1)
    engine = LoadWeights(served)
    with publisher(keyframe_every=100) as pub, subscriber(pub, engine) as sub:
        pub.publish(trainer.state_dict(), version=0)
        sub.wait_for(0, timeout=30)
        at0 = live_digest(served)
        rl_step(trainer, gen)
        served.fail_next = True
        pub.publish(trainer.state_dict(), version=1)
        sub.wait_for(1, timeout=30)  # the delta fails mid-load and is undone; a keyframe of version 1 follows
        assert sub.stats.failures == 1 and isinstance(sub.error, EngineError) and "mid-load" in str(sub.error)
        assert live_digest(served) == engines.HF(trainer).digest() != at0


def test_load_weights_device_is_given_not_read_from_the_model():
    """vLLM's layerwise reload leaves the model's parameters on meta: the device comes from the worker."""
    class OnMeta(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.empty(4, device="meta"))
            self.got = []

        def load_weights(self, weights):
            self.got += [(n, t.device) for n, t in weights]

    model = OnMeta()
    LoadWeights(model, device=torch.device("cpu"), layerwise=False).load({"w": torch.ones(4)})
    assert model.got == [("w", torch.device("cpu"))]
    with pytest.raises(ValueError, match="layerwise must be"):
        LoadWeights(model, layerwise="sometimes")


def test_kernel_format_is_what_vllm_cpu_leaves():
    """vLLM's CPU GEMM dispatch gives a linear layer cpu_linear (a packed copy) and empties its weight:
    load_weights cannot write there, so "auto" reloads layerwise."""
    served = vllm_like(1)
    assert not kernel_format(served)
    served.model.layers[0].mlp.down_proj.cpu_linear = lambda x, weight, bias: x
    assert kernel_format(served)
    # a quantized layer's oneDNN handler holds its weight, and vLLM sets the registered parameter to None
    quantized = vllm_like(1)
    quantized.model.layers[0].mlp.down_proj.weight = None
    assert kernel_format(quantized)


def test_worker_extension_rpc_methods(gen, monkeypatch):
    class Worker(WsyncWorkerExtension):  # vLLM mixes the extension into its worker class the same way
        def __init__(self, model):
            self.model = model

        def get_model(self):
            return self.model

    trainer, w = tiny_qwen(0), Worker(vllm_like(2))
    with publisher() as pub:
        monkeypatch.setenv("WSYNC_TOKEN", TOKEN.hex())  # the RPC carries only the token's fingerprint
        w.wsync_subscribe(pub.address, token_id(TOKEN))
        try:
            for v in range(3):
                rl_step(trainer, gen)
                pub.publish(trainer.state_dict(), version=v)
                assert w.wsync_update(v, timeout=30) == v
            assert w.wsync_status() == {"version": 2, "digest": engines.HF(trainer).digest(), "failures": 0}
            assert live_digest(w.model) == engines.HF(trainer).digest()
        finally:
            w.wsync_close()


class FakeSGLang:
    """Answers like sglang.Engine's offline API: (success, message) tuples."""

    def __init__(self, model=None):
        self.model, self.loras, self.calls, self.refuse = model, {}, [], False

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        self.calls.append(("tensor", len(named_tensors), flush_cache))
        if self.refuse:
            return False, "shape mismatch"
        self.model.load_weights(named_tensors)
        return True, "Succeeded to update model weights."

    def load_lora_adapter_from_tensors(self, lora_name, tensors, config_dict, load_format=None):
        self.calls.append(("load", lora_name))
        self.loras[lora_name] = {n: t.clone() for n, t in tensors.items()}
        return True, ""

    def unload_lora_adapter(self, lora_name):
        self.calls.append(("unload", lora_name))
        del self.loras[lora_name]
        return True, ""


def test_sglang_tensor_mode_follows_and_refusal_is_an_error(gen):
    trainer, fake = tiny_qwen(0), FakeSGLang(vllm_like(3))
    engine = SGLang(fake, mode="tensor")
    with publisher() as pub, subscriber(pub, engine) as sub:
        for v in range(3):
            rl_step(trainer, gen)
            pub.publish(trainer.state_dict(), version=v)
            sub.wait_for(v, timeout=30)
        assert live_digest(fake.model) == engines.HF(trainer).digest()
    before = live_digest(fake.model)
    fake.refuse = True
    with pytest.raises(MismatchError, match="refused update_weights_from_tensor: shape mismatch"):
        engine.load({"model.norm.weight": torch.zeros(32, dtype=torch.bfloat16)})
    assert live_digest(fake.model) == before


def test_sglang_lora_loads_new_before_unloading_old():
    peft = pytest.importorskip("peft")
    from wsync.engines.peft import adapter_state, config_dict

    model = peft.get_peft_model(tiny_qwen(0, dtype=torch.float32), peft.LoraConfig(r=2, target_modules=["q_proj"]))
    fake = FakeSGLang()
    engine = SGLang(fake, mode="lora", lora_name="policy", lora_config=config_dict(model))
    with publisher() as pub, subscriber(pub, engine) as sub:
        for v in range(3):
            with torch.no_grad():
                for t in adapter_state(model).values():
                    t.add_(0.01 * (v + 1))
            pub.publish(adapter_state(model), version=v)
            sub.wait_for(v, timeout=30)
    assert list(fake.loras) == ["policy-3"] and engine.lora_name == "policy-3"
    assert fake.calls[:4] == [("load", "policy-1"), ("load", "policy-2"), ("unload", "policy-1"), ("load", "policy-3")]
    served = fake.loras["policy-3"]
    assert all(torch.equal(served[n].view(torch.uint8), t.contiguous().view(torch.uint8))
               for n, t in adapter_state(model).items())
    with pytest.raises(MismatchError, match="lora_config"):
        SGLang(fake, mode="lora")


def test_vllm_adapter_folder_loads_in_peft(tmp_path):
    """What VLLMLoRA writes for vLLM's loader is a plain PEFT adapter folder: safetensors + JSON, no pickle."""
    peft = pytest.importorskip("peft")
    from wsync.engines.peft import adapter_state, config_dict

    torch.manual_seed(0)
    model = peft.get_peft_model(tiny_qwen(0, dtype=torch.float32), peft.LoraConfig(r=2, target_modules=["v_proj"]))
    with torch.no_grad():
        for t in adapter_state(model).values():
            t.normal_()
    write_adapter(str(tmp_path), adapter_state(model), config_dict(model))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    again = peft.PeftModel.from_pretrained(tiny_qwen(0, dtype=torch.float32), str(tmp_path))
    got = adapter_state(again)
    assert all(torch.equal(got[n], t) for n, t in adapter_state(model).items())
