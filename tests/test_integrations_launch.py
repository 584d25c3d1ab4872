"""How the slime and prime-rl patches get into the trainer processes those frameworks start themselves.

Neither framework installs here (slime needs Megatron and SGLang, prime-rl CUDA torch builds;
neither is on the package index), so each test stands in for the one module the hook touches,
with the names it has at the commit our integration names (read from upstream source):
- slime 624b824: MegatronTrainRayActor.init calls initialize.init(args), whose last act is
  load_function(args.custom_megatron_init_path)(args); then the actor picks its update-weight
  class by the module-global name UpdateWeightFromDisk (transport disk, mode full).
- prime-rl 559b447: prime_rl.trainer.rl.train has main() and calls its module-global
  setup_weight_broadcast(output_dir, config, parallel_dims, lora_config).
"""
import importlib
import json
import sys
import types

import pytest


def _module(monkeypatch, name, **attrs):
    mod = types.ModuleType(name)
    mod.__dict__.update(attrs)
    monkeypatch.setitem(sys.modules, name, mod)
    return mod


def test_slime_custom_megatron_init_patches_the_actor(monkeypatch):
    import wsync.integrations.slime as ws

    original = type("UpdateWeightFromDisk", (), {})
    actor = _module(monkeypatch, ws.ACTOR, UpdateWeightFromDisk=original)
    monkeypatch.setattr(ws, "_CONFIG", ws._CONFIG)
    monkeypatch.setattr(ws, "_SIDECARS", ws._SIDECARS)
    monkeypatch.setenv(ws.CONFIG_ENV, json.dumps({"address": "tcp://127.0.0.1:0", "keyframe_every": 5, "sidecars": 3}))
    args = types.SimpleNamespace(custom_megatron_init_path="wsync.integrations.slime.megatron_init")
    module, _, attr = args.custom_megatron_init_path.rpartition(".")  # slime.utils.misc.load_function
    getattr(importlib.import_module(module), attr)(args)
    assert actor.UpdateWeightFromDisk is ws.WsyncUpdateWeight
    assert ws._SIDECARS == 3 and ws._CONFIG.keyframe_every == 5 and ws._CONFIG.token is None


def test_slime_config_refuses_a_token_and_bad_json(monkeypatch):
    import wsync.integrations.slime as ws

    _module(monkeypatch, ws.ACTOR, UpdateWeightFromDisk=object)
    monkeypatch.setattr(ws, "_CONFIG", ws._CONFIG)
    for bad in ('{"token": "abab"}', "address=tcp://x", '["tcp://127.0.0.1:0"]', '{"adress": "tcp://x"}'):
        monkeypatch.setenv(ws.CONFIG_ENV, bad)
        with pytest.raises(ValueError, match=ws.CONFIG_ENV):
            ws.megatron_init(types.SimpleNamespace())


def test_prime_rl_launcher_patches_then_runs_the_trainer(monkeypatch, tmp_path):
    import wsync.integrations.prime_rl as wp

    ran = {}

    def setup_weight_broadcast(output_dir, config, parallel_dims=None, lora_config=None):
        return "prime-rl's own"

    def main():  # prime_rl.trainer.rl.train.main: cli(TrainerConfig) reads sys.argv, then train()
        ran["argv"] = list(sys.argv)
        ran["filesystem"] = train.setup_weight_broadcast(tmp_path, types.SimpleNamespace(type="filesystem"))
        ran["nccl"] = train.setup_weight_broadcast(tmp_path, types.SimpleNamespace(type="nccl"))

    train = _module(monkeypatch, wp.TRAINERS[0], setup_weight_broadcast=setup_weight_broadcast, main=main)
    _module(monkeypatch, wp.TRAINERS[1], setup_weight_broadcast=setup_weight_broadcast)
    monkeypatch.setattr(wp, "_CONFIG", wp._CONFIG)
    monkeypatch.setattr(wp, "_SIDECARS", wp._SIDECARS)
    monkeypatch.setenv(wp.CONFIG_ENV, json.dumps({"address": "tcp://127.0.0.1:0", "sidecars": 2}))
    monkeypatch.setattr(sys, "argv", ["-m", "@", "trainer.toml"])
    wp.main()
    assert ran["argv"][1:] == ["@", "trainer.toml"]
    assert isinstance(ran["filesystem"], wp.WsyncWeightBroadcast) and ran["nccl"] == "prime-rl's own"
    assert wp._SIDECARS == 2
    ran["filesystem"].close()
