"""The reference async RL loop on top of wsync.

Sampler processes generate continuously with continuous batching; the trainer
takes GRPO steps on what they produce and publishes every version through a
wsync Publisher; samplers apply new weights in flight, between decode steps.
Every token carries the version and logprob it was sampled with, staleness is
bounded by admission control and corrected by truncated importance weights.

    python -m trainer --mode async --max-staleness 2 --seconds 60 --json run.json
    wsync loop --mode sync --steps 100

Modules: task (what is learned), policy (tiny Qwen3), decode (batched
generation), sampler (the worker process), grpo (the loss), loop (the driver),
metrics (what is measured), cli. Nothing heavy is imported here.
"""
from .loop import LoopConfig, Result, run

__all__ = ["LoopConfig", "Result", "run"]
