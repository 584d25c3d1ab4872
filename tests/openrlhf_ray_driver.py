"""An OpenRLHF driver on a local Ray cluster, run by test_integrations_openrlhf as its own process.

It does what ``openrlhf.cli.train_ppo_ray`` does up to the first weight sync, with OpenRLHF's
own pieces: the CLI's argument parser, ``create_vllm_engines`` (real ``RolloutRayActor``
actors), ``RayActorGroup(PolicyModelActor)`` (real trainer actors), ``DeepspeedStrategy`` and
``Actor`` with real DeepSpeed (CPU accelerator, gloo), the real ``ActorPPOTrainer`` and
``PolicyModelActor.broadcast_to_vllm``. The only wsync line is the job's ``runtime_env``: the
driver never patches anything. Each step is a real optimizer step through DeepSpeed, then a
sync; the raw bytes of every parameter on each trainer rank and each engine come back to the
test.

What cannot run on a CPU machine is replaced (see openrlhf_standins/README.md): vLLM and
flash-attn; CUDA's ``torch.cuda.synchronize``/``empty_cache`` are no-ops in the trainer actor
(CPU torch has no CUDA), and ``DeepspeedStrategy.setup_distributed`` is replaced by its CPU
equivalent (``deepspeed.init_distributed`` over gloo; the CUDA calls around it are skipped).

usage: python openrlhf_ray_driver.py MODEL_DIR TOKEN_FILE OUT_JSON [ZERO_STAGE] [TRAINER_RANKS] [STEPS]
"""
import argparse
import json
import os
import runpy
import sys


def cli_args(argv):
    """OpenRLHF's own parser (built inside train_ppo_ray's __main__ block), hierarchized as the CLI does."""
    class Parsed(Exception):
        pass

    grabbed = {}
    parse = argparse.ArgumentParser.parse_args

    def grab(parser, *a, **k):
        grabbed["parser"] = parser
        raise Parsed

    argparse.ArgumentParser.parse_args = grab
    try:
        runpy.run_module("openrlhf.cli.train_ppo_ray", run_name="__main__")
    except Parsed:
        pass
    finally:
        argparse.ArgumentParser.parse_args = parse
    from openrlhf.utils.config import hierarchize

    args = hierarchize(grabbed["parser"].parse_args(argv))
    args.actor.eps_clip_low_high = (args.actor.eps_clip, args.actor.eps_clip)  # as the CLI's checks do
    return args


# -- run inside the PolicyModelActor processes (through Ray's __ray_call__) -------------------------

def build_trainer(self, args, max_steps, engines):
    """PolicyModelActor.init_model_from_pretrained, less its CUDA calls."""
    import deepspeed
    import torch
    import torch.distributed as dist
    from openrlhf.models import Actor
    from openrlhf.trainer.ray import ppo_actor
    from openrlhf.utils import get_strategy

    # CUDA stand-in (CPU torch): the replay buffer names cuda:N as its target, nothing is placed there here
    torch.cuda.synchronize = torch.cuda.empty_cache = lambda *a, **k: None
    torch.cuda.current_device = lambda: 0
    strategy = get_strategy(args)
    deepspeed.init_distributed(dist_backend="gloo")  # setup_distributed, less set_device and a cuda mesh
    strategy.world_size = dist.get_world_size()
    strategy.accumulated_gradient = max(1, strategy.train_batch_size // strategy.micro_train_batch_size
                                        // strategy.world_size)
    self.strategy, self.vllm_engines = strategy, engines
    actor = Actor(args.actor.model_name_or_path, attn_implementation=args.ds.attn_implementation,
                  param_dtype=args.ds.param_dtype, ds_config=strategy.get_ds_train_config())
    cfg = dict(optim=args.actor.optim, muon=vars(args.actor.muon), adam=vars(args.actor.adam),
               lr_scheduler=args.actor.lr_scheduler, lr_warmup_ratio=args.actor.lr_warmup_ratio,
               min_lr_ratio=args.actor.min_lr_ratio, max_norm=args.actor.max_norm, scheduler_steps=max_steps)
    self.actor, self.actor_optim, self.actor_scheduler = strategy.prepare((actor, cfg))
    self.ema_model = None
    self.trainer = ppo_actor.ActorPPOTrainer(
        strategy, self.actor, ema_model=None, actor_optim=self.actor_optim, actor_scheduler=self.actor_scheduler,
        micro_train_batch_size=args.train.micro_batch_size, tokenizer=None, eps_clip=args.actor.eps_clip,
        ema_beta=args.train.ema_beta, vllm_engines=engines)
    cls = ppo_actor.ActorPPOTrainer
    return {"rank": dist.get_rank(),
            "sync_group": cls._init_vllm_sync_group.__module__, "broadcast": cls.broadcast_to_vllm.__module__,
            "address": getattr(getattr(self.trainer, "_wsync_pub", None), "address", None)}


def train_step(self, seed):
    """One optimizer step through OpenRLHF's strategy (DeepSpeed engine backward and step)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, self.actor.model.module.config.vocab_size, (2, 12), generator=gen)
    loss = self.actor.model(ids, labels=ids).loss
    self.strategy.backward(loss, self.actor, self.actor_optim)
    self.strategy.optimizer_step(self.actor_optim, self.actor, self.actor_scheduler)
    return loss.item()


def raw(model):
    return {n: p.detach().contiguous().view(-1).view(__import__("torch").uint8).numpy().tobytes()
            for n, p in model.named_parameters()}


def trainer_bytes(self):
    return raw(self.actor.model.module)


def engine_state(self):
    worker = self.llm.worker
    cls = type(worker).__mro__[1]  # OpenRLHF's WorkerWrap, as mixed in by the engine
    return {"version": getattr(getattr(worker, "_wsync_sub", None), "version", None),
            "update_weight": cls.update_weight.__module__, "bytes": raw(worker.model_runner.model.hf)}


def main(model_dir, token_file, out, zero_stage="2", ranks="1", steps="3"):
    import time

    import ray

    t0 = time.monotonic()
    say = lambda what: print(f"[driver {time.monotonic() - t0:6.1f}s] {what}", flush=True)  # noqa: E731
    import wsync.integrations.openrlhf as wo

    args = cli_args(["--actor.model_name_or_path", model_dir, "--vllm.num_engines", "1",
                     "--vllm.sync_backend", "wsync", "--ds.zero_stage", zero_stage, "--ds.attn_implementation",
                     "eager", "--actor.num_nodes", ranks, "--actor.num_gpus_per_node", "1",
                     "--train.micro_batch_size", "1", "--train.batch_size", ranks, "--vllm.enable_prefix_caching"])
    assert wo.CONFIG_ENV not in os.environ  # the config reaches the actors through the job's runtime_env only
    # the two lines a user adds (plus --vllm.sync_backend wsync); Ray's GPUs are logical here, none is touched
    ray.init(num_cpus=2, num_gpus=int(ranks) + 1, include_dashboard=False,
             runtime_env=wo.runtime_env(address="tcp://127.0.0.1:0", keyframe_every=2, token_file=token_file))
    try:
        from openrlhf.trainer.ray import create_vllm_engines
        from openrlhf.trainer.ray.launcher import RayActorGroup
        from openrlhf.trainer.ray.ppo_actor import ActorPPOTrainer, PolicyModelActor

        say("ray up, OpenRLHF imported")
        result = {"driver_unpatched": ActorPPOTrainer.broadcast_to_vllm.__module__}
        engines = create_vllm_engines(1, 1, model_dir, args.train.seed, full_determinism=False,
                                      enable_prefix_caching=args.vllm.enable_prefix_caching, enforce_eager=True,
                                      max_model_len=128)
        group = RayActorGroup(int(ranks), 1, PolicyModelActor, num_gpus_per_actor=1 / (int(ranks) + 1))
        say("actors created")
        result["trainers"] = ray.get(group.async_run_method("__ray_call__", build_trainer, args, int(steps),
                                                            engines))
        say("trainers built (DeepSpeed), sync group up")
        result["steps"] = []
        for step in range(int(steps)):
            ray.get(group.async_run_method("__ray_call__", train_step, step))
            ray.get(group.async_run_method("broadcast_to_vllm"))  # as PPOTrainer does after each fit
            trainers = ray.get(group.async_run_method("__ray_call__", trainer_bytes))
            engine = ray.get(engines[0].__ray_call__.remote(engine_state))
            result["steps"].append({"trainers": [{k: v.hex() for k, v in t.items()} for t in trainers],
                                    "engine": dict(engine, bytes={k: v.hex() for k, v in engine["bytes"].items()})})
            say(f"step {step} synced")
        with open(out, "w") as f:
            json.dump(result, f)
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:])
