"""OpenRLHF (0.11.2, the real package installed with --no-deps) with its weight sync over wsync.

test_patch_takes_effect_inside_ray_actors: a real OpenRLHF job on a local Ray cluster
(openrlhf_ray_driver.py, its own process): OpenRLHF's parser, create_vllm_engines and
RayActorGroup(PolicyModelActor) spawn the actors; DeepSpeed (real, CPU accelerator, gloo)
trains; the only wsync line is the job's runtime_env. The patched methods must run inside
the trainer actors (the driver stays unpatched), and after each step every parameter's bytes
in the engine equal the trainer's, over tcp loopback with a token from a file.
Stand-ins, for what cannot install on a CPU machine (openrlhf_standins/README.md):
- vllm: the CUDA wheel needs CUDA torch; the stand-in engine mixes in OpenRLHF's real
  WorkerWrap, loads vllm.general_plugins (wsync's openrlhf plugin among them) and serves the
  checkpoint with transformers;
- flash_attn: CUDA-only; imported by OpenRLHF at module level, never called here;
- CUDA calls in the trainer actor (torch.cuda.synchronize / empty_cache / current_device are
  no-ops, DeepspeedStrategy.setup_distributed's set_device and cuda mesh are skipped).
ZeRO-3 is not run: OpenRLHF 0.11.2's ZeRO-3 loading patch fits its pinned transformers 5.15,
not the 5.23 the rest of the suite uses.

The other two tests drive the real WorkerWrap in this process, the trainer functions on a
stand-in trainer object.

Skipped where openrlhf, ray or deepspeed is missing, except with WSYNC_REQUIRE_OPENRLHF=1 (CI),
where that fails.
"""
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from engine_helpers import Served, rl_step, same_bytes, tiny_qwen
from helpers import TOKEN_HEX

HERE = Path(__file__).parent
INSTALL = ("pip install --no-deps openrlhf==0.11.2 ray==2.60.0 (and deepspeed==0.19.6, see .ci/run)")


def _require(*modules):
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if not missing:
        return
    if os.environ.get("WSYNC_REQUIRE_OPENRLHF") == "1":
        pytest.fail(f"WSYNC_REQUIRE_OPENRLHF=1 but {', '.join(missing)} cannot be imported: {INSTALL}")
    pytest.skip(f"{', '.join(missing)} not installed: {INSTALL}", allow_module_level=True)


def _load_worker_wrap():
    """openrlhf.trainer.ray's __init__ imports vLLM; the worker extension's own file imports nothing, so load it alone."""
    _require("openrlhf")
    name = "openrlhf.trainer.ray.vllm_worker_wrap"
    if name not in sys.modules:
        path = Path(importlib.util.find_spec("openrlhf").origin).parent / "trainer" / "ray" / "vllm_worker_wrap.py"
        mod_spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(mod_spec)
        mod_spec.loader.exec_module(module)
        sys.modules[name] = module
    return sys.modules[name]


wrap = _load_worker_wrap()


# -- in real Ray actors ---------------------------------------------------------------------------

def test_patch_takes_effect_inside_ray_actors(tmp_path):
    _require("ray", "deepspeed")
    tiny_qwen(0, tie=False).save_pretrained(tmp_path / "model")
    (tmp_path / "token").write_text(TOKEN_HEX)  # WSYNC_TOKEN_FILE, named in the job's runtime_env
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WSYNC_", "RAY_ADDRESS"))}
    env["PYTHONPATH"] = os.pathsep.join([str(HERE / "openrlhf_standins")] + env.get("PYTHONPATH", "").split(os.pathsep))
    ranks, steps = 2, 3  # two DeepSpeed ranks: both walk broadcast_to_vllm, rank 0 publishes
    out = tmp_path / "result.json"
    run = subprocess.run([sys.executable, str(HERE / "openrlhf_ray_driver.py"), str(tmp_path / "model"),
                          str(tmp_path / "token"), str(out), "2", str(ranks), str(steps)],
                         env=env, capture_output=True, text=True, timeout=1500)  # a hang guard, not a check
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    result = json.loads(out.read_text())

    ours = "wsync.integrations.openrlhf"
    assert result["driver_unpatched"] == "openrlhf.trainer.ray.ppo_actor"  # the driver never patched
    assert sorted(t["rank"] for t in result["trainers"]) == list(range(ranks))
    for t in result["trainers"]:
        assert t["sync_group"] == t["broadcast"] == ours  # patched inside every PolicyModelActor
    addresses = [t["address"] for t in result["trainers"] if t["address"]]
    assert len(addresses) == 1 and addresses[0].startswith("tcp://127.0.0.1:")  # rank 0's publisher only
    before = None
    for version, step in enumerate(result["steps"]):
        engine = step["engine"]
        assert engine["update_weight"] == ours and engine["version"] == version
        assert step["trainers"][0] != before  # the step moved the weights, so equality below is the sync's
        for t in step["trainers"]:
            assert t.keys() == engine["bytes"].keys()
            assert all(bytes.fromhex(t[k]) == bytes.fromhex(engine["bytes"][k]) for k in t)
        before = step["trainers"][0]


# -- in this process ------------------------------------------------------------------------------

class Handle:
    """A Ray actor handle stand-in: .method.remote(...) runs the worker's method now."""

    def __init__(self, worker):
        self.worker = worker

    def __getattr__(self, name):
        return SimpleNamespace(remote=getattr(self.worker, name))


def test_broadcast_to_vllm_over_wsync(monkeypatch):
    import wsync.integrations.openrlhf as wo

    monkeypatch.setenv("WSYNC_TOKEN", TOKEN_HEX)  # the vLLM worker's own environment
    wo.patch_worker()
    try:
        trainer, served = tiny_qwen(0, tie=False), tiny_qwen(1, tie=False)
        worker = wrap.WorkerWrap()
        worker.model_runner = SimpleNamespace(model=Served(served))
        args = SimpleNamespace(vllm=SimpleNamespace(sync_backend="wsync", tensor_parallel_size=1),
                               ds=SimpleNamespace(zero_stage=2, tensor_parallel_size=1))
        me = SimpleNamespace(strategy=SimpleNamespace(args=args), vllm_engines=[Handle(worker)],
                             actor=SimpleNamespace(model=SimpleNamespace(module=trainer)))
        monkeypatch.setattr(wo, "_CONFIG", wo.SyncConfig(address="tcp://127.0.0.1:0", token=TOKEN_HEX, keyframe_every=3))
        wo.init_vllm_sync_group(me, "wsync")
        gen = torch.Generator().manual_seed(9)
        for v in range(4):
            rl_step(trainer, gen)
            wo.broadcast_to_vllm(me)
            assert worker._wsync_sub.version == v
            assert same_bytes(trainer.state_dict(), served.state_dict())
        me._wsync_pub.close()
        worker._wsync_sub.close()
    finally:
        wo.unpatch()


def test_other_backends_reach_openrlhf_code(monkeypatch):
    import wsync.integrations.openrlhf as wo

    monkeypatch.setattr(torch.distributed, "get_rank", lambda *a: 1)  # a vLLM worker other than rank 0

    original = wrap.WorkerWrap.update_weight
    wo.patch_worker()
    try:
        w = wrap.WorkerWrap()
        w.model_config = SimpleNamespace(dtype=torch.float32)
        with pytest.raises(AssertionError, match="mismatch dtype"):  # OpenRLHF's own check ran
            w.update_weight("model.norm.weight", torch.bfloat16, (4,))
    finally:
        wo.unpatch()
    assert wrap.WorkerWrap.update_weight is original


def test_runtime_env_carries_config_never_the_token(monkeypatch, tmp_path):
    import wsync.integrations.openrlhf as wo

    env = wo.runtime_env(address="tcp://127.0.0.1:0", keyframe_every=2, token_file="/run/wsync/token")
    assert env["worker_process_setup_hook"] == "wsync.integrations.openrlhf.ray_setup"
    assert env["env_vars"]["WSYNC_TOKEN_FILE"] == "/run/wsync/token"
    assert json.loads(env["env_vars"][wo.CONFIG_ENV]) == {"address": "tcp://127.0.0.1:0", "keyframe_every": 2}
    with pytest.raises(ValueError, match="dashboard"):
        wo.runtime_env(token=TOKEN_HEX)
    with pytest.raises(TypeError):
        wo.runtime_env(adress="tcp://127.0.0.1:0")  # a misspelt field fails in the driver
    monkeypatch.setenv(wo.CONFIG_ENV, "{not json")
    with pytest.raises(ValueError, match=wo.CONFIG_ENV):
        wo.ray_setup()


def test_ray_setup_patches_on_import(monkeypatch, tmp_path):
    """The hook imports nothing: the trainer class is patched when its module's code has run."""
    import wsync.integrations.openrlhf as wo

    pkg = tmp_path / "fake_openrlhf_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "ppo_actor.py").write_text("class ActorPPOTrainer:\n    def _init_vllm_sync_group(self, backend): "
                                      "return 'theirs'\n    def broadcast_to_vllm(self): return 'theirs'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(wo, "TRAINER", ("fake_openrlhf_pkg.ppo_actor", "ActorPPOTrainer"))
    monkeypatch.setattr(wo, "WORKER", ("fake_openrlhf_pkg.worker_never_imported", "WorkerWrap"))
    monkeypatch.setenv(wo.CONFIG_ENV, json.dumps({"keyframe_every": 7}))
    monkeypatch.setattr(wo, "_CONFIG", wo._CONFIG)  # restored afterwards
    finders = list(sys.meta_path)
    try:
        wo.ray_setup()
        assert "fake_openrlhf_pkg.ppo_actor" not in sys.modules and wo._CONFIG.keyframe_every == 7
        from fake_openrlhf_pkg.ppo_actor import ActorPPOTrainer

        assert ActorPPOTrainer.broadcast_to_vllm is wo.broadcast_to_vllm
        assert ActorPPOTrainer._init_vllm_sync_group is wo.init_vllm_sync_group
        assert sys.modules["fake_openrlhf_pkg.ppo_actor"].__loader__.get_source("fake_openrlhf_pkg.ppo_actor")
    finally:
        wo.unpatch()
        sys.meta_path[:] = finders
        for name in [m for m in sys.modules if m.startswith("fake_openrlhf_pkg")]:
            del sys.modules[name]
