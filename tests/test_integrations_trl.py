"""TRL: the real VLLMGeneration (trl 1.16, server mode) syncs a tiny Qwen3 through WsyncVLLMClient.

TRL installs on CPU with --no-deps (its generation modules need only transformers and accelerate);
the test skips without it. The vLLM server is a stand-in serving only the routes `vllm serve` has
with VLLM_SERVER_DEV_MODE=1 (404 for any other), whose update_weights does what wsync's vLLM
weight-transfer backend does: Subscriber.wait_for(version). tests/test_trl_real.py runs
GRPOTrainer.train() against a real `vllm serve` instead.
"""
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from engine_helpers import rl_step, same_bytes, tiny_qwen
from helpers import TOKEN_HEX

pytest.importorskip("trl.generation.vllm_generation", reason="pip install torch==2.13.0 --no-deps trl")
accelerate = pytest.importorskip("accelerate")

# vLLM 0.32's routes that TRL's client reaches (the RL and server-info ones only with VLLM_SERVER_DEV_MODE=1)
GET_ROUTES = {"/health", "/v1/models", "/server_info", "/get_world_size", "/weight_info"}
POST_ROUTES = {"/init_weight_transfer_engine", "/start_weight_update", "/update_weights", "/finish_weight_update",
               "/reset_prefix_cache", "/v1/completions"}


class Server:
    """vLLM's HTTP routes as TRL uses them, over a wsync Subscriber into an HF model."""

    def __init__(self, model, backend="wsync", fail_update=None):
        self.model, self.sub, self.calls, self.bodies = model, None, [], []
        self.backend, self.weight_version, self.fail_update = backend, None, fail_update
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _reply(self, body, status=200):
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                server.calls.append(self.path)
                path = self.path.partition("?")[0]
                if path not in GET_ROUTES:
                    return self._reply({"detail": "Not Found"}, 404)
                self._reply(server.get(path))

            def do_POST(self):
                n = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(n) or b"{}"
                server.bodies.append(raw.decode())
                body = json.loads(raw)
                server.calls.append(self.path)
                if self.path not in POST_ROUTES:
                    return self._reply({"detail": "Not Found"}, 404)
                if self.path == "/update_weights" and server.fail_update:
                    return self._reply({"error": {"message": server.fail_update}}, 500)
                self._reply(server.handle(self.path, body))

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}"
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    def get(self, path):
        if path == "/v1/models":
            return {"data": [{"id": "tiny"}]}
        if path == "/server_info":
            wt = {"backend": self.backend} if self.backend else None
            return {"vllm_config": {"weight_transfer_config": wt}}
        if path == "/weight_info":
            return {"weight_version": self.weight_version}
        return {"world_size": 1}

    def handle(self, path, body):
        from wsync import Subscriber, engines
        from wsync.integrations.common import engine_token

        if path == "/init_weight_transfer_engine":
            info = body["init_info"]  # as wsync.engines.vllm_backend reads it: the token from the server's env
            self.sub = Subscriber(info["address"], engine=engines.HF(self.model),
                                  token=engine_token(info.get("token_id")), apply="poll")
        elif path == "/update_weights":
            self.sub.wait_for(body["update_info"]["version"], timeout=30)
        elif path == "/finish_weight_update":
            self.weight_version = body.get("weight_version")
        return {}

    def close(self):
        self.http.shutdown()
        if self.sub is not None:
            self.sub.close()


@pytest.fixture
def trl_cpu(monkeypatch):
    import trl.generation.vllm_client as vc
    import trl.generation.vllm_generation as vg

    import wsync.integrations.trl as wt

    # the trainer side of this path needs no vLLM; TRL checks for it before building a client
    monkeypatch.setattr(vc, "is_vllm_available", lambda *a, **k: True)
    monkeypatch.setattr(vg, "is_vllm_available", lambda *a, **k: True)
    yield wt
    wt.unpatch()


def test_grpo_server_sync_through_wsync(trl_cpu, monkeypatch, caplog):
    import logging

    from trl.generation.vllm_generation import VLLMGeneration

    caplog.set_level(logging.DEBUG)
    monkeypatch.setenv("WSYNC_TOKEN", TOKEN_HEX)  # the vLLM server's own copy of the token

    trainer, served = tiny_qwen(0, tie=False), tiny_qwen(1, tie=False)
    server = Server(served)
    cls = trl_cpu.patch(address="tcp://127.0.0.1:0", token=TOKEN_HEX, keyframe_every=4)
    vgen = None
    try:
        vgen = VLLMGeneration(trainer, accelerate.Accelerator(cpu=True), None, mode="server",
                              server_base_url=server.url, server_timeout=5)
        assert isinstance(vgen.vllm_client, cls)
        gen = torch.Generator().manual_seed(5)
        for step in range(4):
            rl_step(trainer, gen)
            vgen.sync_weights()  # exactly what GRPOTrainer calls
            assert same_bytes(trainer.state_dict(), served.state_dict())
        assert server.sub.version == 3
        assert server.get("/weight_info") == {"weight_version": "3"}  # what vLLM reports as live
        assert server.calls.count("/update_weights") == 4 and "/reset_prefix_cache" in server.calls
        sizes = vgen.vllm_client.wsync_pub.stats.bytes
        full = sum(t.nbytes for t in trainer.state_dict().values())
        assert sizes[1] < full / 4  # deltas, not full weights
        # the token never rode the HTTP control plane (servers log it), nor any log line
        assert server.bodies and not any(TOKEN_HEX in b for b in server.bodies)
        assert not any(TOKEN_HEX in c for c in server.calls)
        assert "token_id" in server.bodies[0]
        assert not any(TOKEN_HEX in r.getMessage() for r in caplog.records)
    finally:
        if vgen is not None:
            vgen.vllm_client.close_communicator()
        server.close()


@pytest.mark.parametrize("backend", [None, "nccl"])
def test_a_server_without_the_wsync_backend_is_refused_at_init(trl_cpu, backend):
    from trl.generation.vllm_generation import VLLMGeneration

    server = Server(tiny_qwen(1, tie=False), backend=backend)
    trl_cpu.patch(address="tcp://127.0.0.1:0", token=TOKEN_HEX)
    try:
        with pytest.raises(RuntimeError, match="VLLM_SERVER_DEV_MODE=1.*weight-transfer-config"):
            VLLMGeneration(tiny_qwen(0, tie=False), accelerate.Accelerator(cpu=True), None, mode="server",
                           server_base_url=server.url, server_timeout=5)
        assert "/init_weight_transfer_engine" not in server.calls
    finally:
        server.close()


def test_a_failed_update_reaches_the_trainer_with_the_servers_reason(trl_cpu, monkeypatch):
    # vLLM ends its update session when an update fails, so TRL's retry of a 500 would fail again with
    # another message and bury this one: the update is posted once
    from trl.generation.vllm_generation import VLLMGeneration

    monkeypatch.setenv("WSYNC_TOKEN", TOKEN_HEX)
    server = Server(tiny_qwen(1, tie=False), fail_update="EngineError: LoadWeights could not load 25 tensors")
    trl_cpu.patch(address="tcp://127.0.0.1:0", token=TOKEN_HEX)
    vgen = None
    try:
        vgen = VLLMGeneration(tiny_qwen(0, tie=False), accelerate.Accelerator(cpu=True), None, mode="server",
                              server_base_url=server.url, server_timeout=5)
        with pytest.raises(RuntimeError, match="500.*could not load 25 tensors"):
            vgen.sync_weights()
        assert server.calls.count("/update_weights") == 1
    finally:
        if vgen is not None:
            vgen.vllm_client.close_communicator()
        server.close()


def test_unpatch_restores_trl_client(trl_cpu):
    import trl.generation.vllm_generation as vg
    from trl.generation.vllm_client import VLLMClient

    trl_cpu.patch(token=TOKEN_HEX)
    assert vg.VLLMClient is not VLLMClient and issubclass(vg.VLLMClient, VLLMClient)
    trl_cpu.unpatch()
    assert vg.VLLMClient is VLLMClient
