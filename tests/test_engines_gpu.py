"""Integration with the real vLLM and SGLang, where they are installed (a GPU machine). Skipped elsewhere.

A tiny random Qwen3 checkpoint is written locally (no download); the engine is
started on it, a Publisher in this process publishes new weights, and the
engine must serve exactly them: the greedy tokens of the engine must equal the
ones transformers computes from the trainer's weights is too strict across
kernels, so the check is the wsync digest of what was loaded plus a changed
generation after the update.
"""
from __future__ import annotations

import pytest

from helpers import TOKEN

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.gpu


def _needs(pkg: str):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    return pytest.importorskip(pkg)


def _checkpoint(path, seed: int = 0):
    torch.manual_seed(seed)
    cfg = transformers.Qwen3Config(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                   max_position_embeddings=256, tie_word_embeddings=False)
    model = transformers.Qwen3ForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(path)
    return model


def _bump(model):
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)


def test_vllm_worker_extension_and_backend(tmp_path, monkeypatch):
    vllm = _needs("vllm")
    from wsync import engines
    from wsync.engines import vllm as wv
    from wsync.sync import Publisher

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # worker in this process: register() reaches it
    wv.register()
    trainer = _checkpoint(tmp_path)
    llm = vllm.LLM(model=str(tmp_path), skip_tokenizer_init=True, enforce_eager=True, gpu_memory_utilization=0.3,
                   dtype="bfloat16", worker_extension_cls="wsync.engines.vllm.WsyncWorkerExtension",
                   weight_transfer_config={"backend": wv.BACKEND})
    prompt = [{"prompt_token_ids": [1, 2, 3, 4]}]
    params = vllm.SamplingParams(max_tokens=8, temperature=0)
    before = llm.generate(prompt, params)[0].outputs[0].token_ids
    with Publisher("tcp://127.0.0.1:0", token=TOKEN) as pub:
        monkeypatch.setenv("WSYNC_TOKEN", TOKEN.hex())  # the RPC carries only the token's fingerprint
        from wsync.integrations.common import token_id
        llm.collective_rpc("wsync_subscribe", args=(pub.address, token_id(TOKEN)))
        _bump(trainer)
        pub.publish(trainer.state_dict(), version=1)
        assert llm.collective_rpc("wsync_update", args=(1,)) == [1]
        status = llm.collective_rpc("wsync_status")[0]
        assert status["digest"] == engines.HF(trainer).digest() and status["failures"] == 0
        assert llm.generate(prompt, params)[0].outputs[0].token_ids != before
        llm.collective_rpc("wsync_close")
        # the weight-transfer backend: vLLM's control plane names the version, wsync moves the bytes
        llm.init_weight_transfer_engine({"init_info": {"address": pub.address, "token": TOKEN.hex()}})
        _bump(trainer)
        pub.publish(trainer.state_dict(), version=2)
        llm.start_weight_update()
        llm.update_weights({"update_info": {"version": 2}})
        llm.finish_weight_update()


def test_sglang_update_weights_from_tensor(tmp_path):
    sgl = _needs("sglang")
    from wsync import engines
    from wsync.engines.sglang import SGLang
    from wsync.subscriber import Subscriber
    from wsync.sync import Publisher

    trainer = _checkpoint(tmp_path)
    engine = sgl.Engine(model_path=str(tmp_path), skip_tokenizer_init=True, mem_fraction_static=0.3)
    try:
        adapter = SGLang(engine, mode="tensor")
        with Publisher("tcp://127.0.0.1:0", token=TOKEN) as pub, \
                Subscriber(pub.address, engine=adapter, token=TOKEN) as sub:
            for v in range(2):
                _bump(trainer)
                pub.publish(trainer.state_dict(), version=v)
                sub.wait_for(v, timeout=120)
                assert adapter.digest() == engines.HF(trainer).digest()
            assert sub.stats.failures == 0
    finally:
        engine.shutdown()
