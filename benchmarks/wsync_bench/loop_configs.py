"""The benchmark's two loop configurations and the numbers it keeps of a run: one module that the one-host
benchmark (loop.py) and its Ray variant (loop_ray.py) both build on."""
from __future__ import annotations


def configs(a):
    from trainer.decode import DecodeConfig
    from trainer.grpo import GRPOConfig
    from trainer.loop import LoopConfig
    from trainer.task import TaskConfig

    task = TaskConfig(min_digits=a.digits, max_digits=a.max_digits, tail_prob=a.long_tail)
    common = dict(steps=a.steps, seed=a.seed, samplers=a.samplers, group_size=a.group_size,
                  batch_groups=a.batch_groups, progress=not a.quiet, task=task, grpo=GRPOConfig(lr=a.lr),
                  decode=DecodeConfig(slots=a.slots, kv_cache=a.kv_cache, refill_at=a.refill_at))
    return {"sync": LoopConfig(mode="sync", **common),
            "async": LoopConfig(mode="async", max_staleness=a.max_staleness, **common)}


def brief(s: dict) -> dict:
    """The numbers a reader compares, from one run's summary."""
    return {
        "samples_per_s": s["samples_per_s"], "tokens_per_s": s["tokens_per_s"], "wall_s": s["wall_s"],
        "reward_first": s["reward_first"],
        "reward_last": s["reward_last"], "dropped_stale": s["dropped_stale"],
        "staleness_hist": s["staleness_hist"], "versions_spanned_hist": s["versions_spanned_hist"],
        "trainer_idle_pct": s["trainer"]["idle_pct"], "trainer": s["trainer"],
        "sampler_idle_pct": s["samplers"]["idle_pct"], "samplers": s["samplers"], "sync": s["sync"],
    }
