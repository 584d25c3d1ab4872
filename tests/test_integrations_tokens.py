"""Integrations listen on loopback by default, refuse to listen further without a token, and never put the
token where frameworks log it: HTTP bodies, RPC arguments, group names, reprs, log lines.

OpenRLHF's trainer and worker functions run here without OpenRLHF: its Ray handles are stand-ins that call
our worker functions in-process and record what crossed the "RPC".
"""
from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from wsync.errors import WsyncError
from wsync.integrations.common import SyncConfig, check_exposure, engine_token, load_token, token_id

from helpers import TOKEN_HEX


def test_default_address_is_loopback():
    cfg = SyncConfig()
    assert cfg.address.startswith("tcp://127.0.0.1:")
    with cfg.publisher() as pub:
        assert pub.address.startswith("tcp://127.0.0.1:")


@pytest.mark.parametrize("address", ["tcp://0.0.0.0:7070", "tcp://[::]:7070", "tcp://10.1.2.3:7070",
                                     "tcp://trainer-host:7070"])
def test_no_token_beyond_loopback_is_refused(address, monkeypatch):
    monkeypatch.delenv("WSYNC_TOKEN", raising=False)
    monkeypatch.delenv("WSYNC_TOKEN_FILE", raising=False)
    with pytest.raises(ValueError, match="without a token"):
        SyncConfig(address=address).publisher()  # refused before anything binds
    check_exposure(address, bytes.fromhex(TOKEN_HEX))  # with a token it may listen there


@pytest.mark.parametrize("address", ["tcp://127.0.0.1:0", "tcp://localhost:0", "tcp://[::1]:0", "local://x"])
def test_loopback_and_local_need_no_token(address):
    check_exposure(address, None)


def test_token_is_not_in_the_config_repr():
    assert TOKEN_HEX not in repr(SyncConfig(token=TOKEN_HEX))


def test_token_from_environment_or_file(monkeypatch, tmp_path):
    monkeypatch.delenv("WSYNC_TOKEN_FILE", raising=False)
    monkeypatch.setenv("WSYNC_TOKEN", TOKEN_HEX)
    assert SyncConfig().token_bytes() == bytes.fromhex(TOKEN_HEX)
    monkeypatch.delenv("WSYNC_TOKEN")
    (tmp_path / "tok").write_text(TOKEN_HEX + "\n")
    monkeypatch.setenv("WSYNC_TOKEN_FILE", str(tmp_path / "tok"))
    assert load_token() == bytes.fromhex(TOKEN_HEX)
    assert SyncConfig(token="00" * 16).token_bytes() == bytes(16)  # given explicitly, it wins


def test_engine_checks_its_token_against_the_id(monkeypatch):
    monkeypatch.delenv("WSYNC_TOKEN_FILE", raising=False)
    tid = token_id(bytes.fromhex(TOKEN_HEX))
    assert TOKEN_HEX not in tid and len(tid) == 16
    monkeypatch.delenv("WSYNC_TOKEN", raising=False)
    with pytest.raises(WsyncError, match="WSYNC_TOKEN"):
        engine_token(tid)
    monkeypatch.setenv("WSYNC_TOKEN", "11" * 16)
    with pytest.raises(WsyncError, match="is not the trainer's"):
        engine_token(tid)
    monkeypatch.setenv("WSYNC_TOKEN", TOKEN_HEX)
    assert engine_token(tid) == bytes.fromhex(TOKEN_HEX)
    assert engine_token(None) is None


def test_openrlhf_group_name_carries_no_token(monkeypatch, caplog):
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from engine_helpers import Served, rl_step, same_bytes, tiny_qwen

    import wsync.integrations.openrlhf as wo

    caplog.set_level(logging.DEBUG)
    monkeypatch.setenv("WSYNC_TOKEN", TOKEN_HEX)  # the vLLM workers' environment (Ray runtime_env)
    trainer, served = tiny_qwen(0, tie=False), tiny_qwen(1, tie=False)

    worker = SimpleNamespace(model_runner=SimpleNamespace(model=Served(served)))
    rpc = []  # every argument that crossed the stand-in Ray RPC

    def remote(fn):
        def call(*args, **kwargs):
            rpc.append((args, kwargs))
            return fn(worker, *args, **kwargs)
        return SimpleNamespace(remote=call)

    handle = SimpleNamespace(init_process_group=remote(wo.worker_init_process_group),
                             update_weight=remote(wo.worker_update_weight))
    args = SimpleNamespace(vllm=SimpleNamespace(sync_backend="wsync", tensor_parallel_size=1),
                           ds=SimpleNamespace(zero_stage=2, tensor_parallel_size=1))
    me = SimpleNamespace(strategy=SimpleNamespace(args=args), vllm_engines=[handle],
                         actor=SimpleNamespace(model=SimpleNamespace(module=trainer)))
    monkeypatch.setattr(wo, "_CONFIG", wo.SyncConfig(token=TOKEN_HEX, keyframe_every=3))  # default address: loopback
    wo.init_vllm_sync_group(me, "wsync")
    try:
        assert me._wsync_pub.address.startswith("tcp://127.0.0.1:")
        gen = torch.Generator().manual_seed(9)
        for v in range(3):
            rl_step(trainer, gen)
            wo.broadcast_to_vllm(me)
            assert worker._wsync_sub.version == v
            assert same_bytes(trainer.state_dict(), served.state_dict())
    finally:
        me._wsync_pub.close()
        worker._wsync_sub.close()
    group = rpc[0][0][4]
    assert group == "wsync:" + token_id(bytes.fromhex(TOKEN_HEX))
    assert not any(TOKEN_HEX in repr(call) for call in rpc)
    assert not any(TOKEN_HEX in r.getMessage() for r in caplog.records)
