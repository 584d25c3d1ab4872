"""verl 0.9.1 for real: its own Hydra config, workers as Ray actors, CheckpointEngineManager.update_weights.

What is verl's own, unmodified, on CPU: the config (``verl/trainer/config/ppo_trainer.yaml`` composed
by Hydra with ``checkpoint_engine.backend=wsync`` and ``custom_backend_module``), the actor worker group
(``ActorRolloutRefWorker`` with role "actor": 2 ranks of a real FSDP2 engine over gloo, built by
``init_model``, its AdamW and its ``update_weights``), the rollout side's ``CheckpointEngineWorker``
(which builds our engine from the same config and feeds ``receive_weights`` to its server adapter),
``RolloutReplica``, ``RayWorkerGroup``/``RayResourcePool`` and ``CheckpointEngineManager``, which
drives prepare, build_topology, init_process_group, send/receive and finalize.

Made to run on CPU, because verl 0.9.1 has no CPU platform:
- ``tests/verl_cpu_platform.py``: a CPU platform registered through verl's plugin hook
  (``VERL_USE_EXTERNAL_MODULES``, ``VERL_PLATFORM=cpu``) in the driver and every worker;
  ``VERL_ENGINE_DEVICE=cuda`` (verl's switch) picks its FSDP engine, registered for cuda and npu only.
- ``Actor.init_model`` opens the process group with gloo alone before verl's ``init_model``: verl asks
  for "cpu:gloo,<device>:<backend>", which torch refuses when the device is cpu as well.
- ``attn_implementation=sdpa`` in the model's override_config: there is no flash-attn on CPU.

Stand-ins, because verl's inference engines (vLLM, SGLang) need a GPU:
- ``HFServerAdapter``: the rollout worker's server adapter. Where vLLM's would hand each received
  (name, tensor) to the engine's ``load_weights``, it copies them into a transformers model of the
  same checkpoint, and reports per-tensor sha256 of that model's bytes.
- ``Replica``: a RolloutReplica whose ``launch_servers`` starts no HTTP server (there is no engine to
  serve), so abort/resume around the update have no servers to reach.
- ``Actor.train_step``: the trainer's step is the FSDP engine's own forward, backward and
  ``optimizer_step`` on random tokens (a language-model loss), not a PPO batch from a dataset.

Weights cross from actor rank 0 to both rollout workers through wsync over tcp 127.0.0.1; Ray
carries only verl's control calls. After every step the sha256 of every tensor on every rollout
worker equals the trainer's. Skips without verl, unless WSYNC_REQUIRE_VERL=1 (CI's verl stage).
"""
import asyncio
import hashlib
import importlib.util
import os

import pytest
import torch

REQUIRE = os.environ.get("WSYNC_REQUIRE_VERL") == "1"
HERE = os.path.dirname(os.path.abspath(__file__))
# verl picks its platform once per process: ours (tests/verl_cpu_platform.py) here and in every worker;
# its FSDP engine is registered for cuda and npu only, and VERL_ENGINE_DEVICE is verl's switch to choose it
PLATFORM_ENV = {"VERL_PLATFORM": "cpu", "VERL_USE_EXTERNAL_MODULES": "verl_cpu_platform", "VERL_ENGINE_DEVICE": "cuda"}
if importlib.util.find_spec("verl") is not None:
    os.environ.update(PLATFORM_ENV)  # before verl's first import, which loads the plugin
try:
    import ray
    import verl.checkpoint_engine  # noqa: F401  (verl's engines register first, as in a verl worker)
except ImportError as e:
    if REQUIRE:
        raise
    pytest.skip(f"verl is not installed ({e}); CI's verl stage runs this with WSYNC_REQUIRE_VERL=1",
                allow_module_level=True)

from verl.checkpoint_engine import CheckpointEngineManager, CheckpointEngineRegistry, CheckpointEngineWorker
from verl.single_controller.base.decorator import Dispatch, register
from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
from verl.utils.config import omega_conf_to_dataclass
from verl.workers.config import HFModelConfig
from verl.workers.engine_workers import ActorRolloutRefWorker
from verl.workers.rollout import BaseRollout, RolloutReplica

from helpers import TOKEN_HEX

STEPS = 3


def digests(named) -> dict:
    return {n: hashlib.sha256(t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()).hexdigest()
            for n, t in named}


class Actor(ActorRolloutRefWorker):
    """verl's actor worker, plus a training step and a digest of what its engine exports."""

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self):
        # verl asks for "cpu:gloo,<device>:<backend>", which torch refuses when the device is cpu too;
        # the same verl helper with gloo alone first (init_model then finds the group initialized)
        from verl.utils.distributed import initialize_global_process_group_ray

        initialize_global_process_group_ray(backend="cpu:gloo")
        return super().init_model()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def train_step(self, seed: int) -> float:
        engine = self.actor.engine
        gen = torch.Generator().manual_seed(seed)  # the same batch on both ranks: FSDP averages the grads
        ids = torch.randint(0, engine.module.config.vocab_size, (2, 12), generator=gen)
        engine.optimizer_zero_grad()
        loss = engine.module(input_ids=ids, labels=ids).loss
        loss.backward()
        engine.optimizer_step()
        return loss.item()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def weight_digests(self) -> dict:
        params, _ = self.actor.engine.get_per_tensor_param()  # collective: every rank gathers
        return digests(params)


class HFServerAdapter(BaseRollout):
    """Stand-in for vLLM/SGLang's server adapter: received tensors go into a transformers model."""

    def __init__(self, config, model_config: HFModelConfig):
        super().__init__(config, model_config, device_mesh=None)
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_config.local_path, torch_dtype=torch.float32)
        self.loaded = 0

    async def update_weights(self, weights, **kwargs):
        params = self.model.state_dict()
        async for name, tensor in weights:
            target = params[name]  # a KeyError names a tensor the engine does not have
            assert target.dtype == tensor.dtype and target.shape == tensor.shape, (name, tensor.dtype, tensor.shape)
            target.copy_(tensor)
            self.loaded += 1

    async def resume(self, tags):
        pass

    async def release(self):
        pass


class RolloutWorker(CheckpointEngineWorker):
    """verl's rollout-side worker with the stand-in adapter; everything else is CheckpointEngineWorker's."""

    def __init__(self, rollout_config, model_config):
        super().__init__(rollout_config, model_config, HFServerAdapter(rollout_config, model_config))

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def weight_digests(self) -> dict:
        return digests(self.server_adapter.model.state_dict().items())

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def loaded(self) -> int:
        return self.server_adapter.loaded


class Replica(RolloutReplica):
    async def launch_servers(self):
        """No inference server to launch: the stand-in adapter lives in the worker itself."""


def tiny_checkpoint(path) -> None:
    """A random-init Qwen3 and a word-level tokenizer, saved as a Hugging Face checkpoint (no downloads)."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                   tie_word_embeddings=False, max_position_embeddings=64)
    transformers.Qwen3ForCausalLM(cfg).save_pretrained(path)
    vocab = {"<pad>": 0, "<eos>": 1, **{f"w{i}": i for i in range(2, 256)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>").save_pretrained(path)


def verl_config(model_path):
    """verl's ppo_trainer config through Hydra, as `python -m verl.trainer.main_ppo ...overrides` builds it."""
    from hydra import compose, initialize_config_dir

    import verl.trainer

    overrides = [
        f"actor_rollout_ref.model.path={model_path}",
        "actor_rollout_ref.actor.strategy=fsdp2",
        "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",  # no flash-attn on CPU
        "actor_rollout_ref.actor.use_torch_compile=False",
        "actor_rollout_ref.actor.fsdp_config.use_torch_compile=False",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
        "actor_rollout_ref.actor.optim.lr=1e-3",
        "actor_rollout_ref.rollout.name=vllm",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=1",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        "actor_rollout_ref.rollout.checkpoint_engine.backend=wsync",
        "actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module=wsync.integrations.verl",
        "actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes=1",
        "+actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.wsync.address=tcp://127.0.0.1:0",
        "+actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.wsync.keyframe_every=2",
        "trainer.device=cpu",
    ]
    config_dir = os.path.join(os.path.dirname(verl.trainer.__file__), "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        return compose(config_name="ppo_trainer", overrides=overrides)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """One local Ray cluster on loopback for this module; the token reaches every worker through runtime_env."""
    # Ray's node address (and so verl's MASTER_ADDR for gloo) is this host's outward address unless told
    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    ray.init(address="local", num_cpus=4, _node_ip_address="127.0.0.1", include_dashboard=False,
             log_to_driver=True, runtime_env={"env_vars": {"WSYNC_TOKEN": TOKEN_HEX, "PYTHONPATH": HERE, "OMP_NUM_THREADS": "1",
                                                           "TOKENIZERS_PARALLELISM": "false", **PLATFORM_ENV}})
    try:
        path = str(tmp_path_factory.mktemp("tiny-qwen3"))
        tiny_checkpoint(path)
        yield verl_config(path)
    finally:
        ray.shutdown()
        monkeypatch.undo()


def test_registry_in_a_verl_worker(cluster):
    """verl's registry resolves "wsync" after importing custom_backend_module, as its workers do."""
    from verl.utils.import_utils import import_external_libs

    import_external_libs("wsync.integrations.verl")
    import wsync.integrations.verl as wv

    assert CheckpointEngineRegistry.get("wsync") is wv.engine_class()
    engine = CheckpointEngineRegistry.new("wsync", bucket_size=1 << 20, is_master=False, token=TOKEN_HEX)
    assert engine.prepare() == {}


def test_update_weights_bit_exact(cluster):
    config = cluster
    actor_pool = RayResourcePool(process_on_nodes=[2], use_gpu=False, max_colocate_count=1)
    actor_wg = RayWorkerGroup(resource_pool=actor_pool, device_name="cpu", ray_cls_with_init=RayClassWithInitArgs(
        cls=ray.remote(Actor), config=config.actor_rollout_ref, role="actor"))
    actor_wg.init_model()

    rollout_config = omega_conf_to_dataclass(config.actor_rollout_ref.rollout)
    model_config = omega_conf_to_dataclass(config.actor_rollout_ref.model, dataclass_type=HFModelConfig)
    rollout_pool = RayResourcePool(process_on_nodes=[2], use_gpu=False, max_colocate_count=1)
    rollout_wg = RayWorkerGroup(resource_pool=rollout_pool, device_name="cpu", ray_cls_with_init=RayClassWithInitArgs(
        cls=ray.remote(RolloutWorker), rollout_config=rollout_config, model_config=model_config))
    replicas = [Replica(replica_rank=r, config=rollout_config, model_config=model_config) for r in range(2)]

    async def init_replicas():
        await asyncio.gather(*(r.init_hybrid(rollout_wg) for r in replicas))

    asyncio.run(init_replicas())
    assert [len(r.workers) for r in replicas] == [1, 1]

    manager = CheckpointEngineManager(config=rollout_config.checkpoint_engine, actor_wg=actor_wg, replicas=replicas)
    served = rollout_wg.weight_digests()
    assert served[0] == served[1] == actor_wg.weight_digests()[0]  # the same checkpoint on both sides to start
    keyframes = []
    for step in range(1, STEPS + 1):
        actor_wg.train_step(seed=step)
        trainer = actor_wg.weight_digests()
        assert trainer[0] == trainer[1] and trainer[0].keys() == served[0].keys()
        changed = [n for n in trainer[0] if trainer[0][n] != served[0][n]]
        assert changed, "the training step left every weight as it was"
        metrics = manager.update_weights(global_steps=step)
        assert metrics["wsync/version"] == step and metrics["wsync/wire_bytes"] > 0
        keyframes.append(metrics["wsync/keyframe"])
        served = rollout_wg.weight_digests()
        for rank, worker in enumerate(served):
            wrong = [n for n in trainer[0] if worker[n] != trainer[0][n]]
            assert not wrong, f"step {step}: rollout worker {rank} differs from the trainer in {wrong}"
    assert keyframes[0] == 1.0 and 0.0 in keyframes  # the first version whole, later ones as deltas
    assert all(n > 0 for n in rollout_wg.loaded())
