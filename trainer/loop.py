"""The reference RL loop's entry point: ``run`` on this machine (the driver and its samplers, driver.py) or
on a Ray cluster (ray_loop.py). The configuration and result types are the driver's, named here too so that
callers need only this module."""
from __future__ import annotations

from .driver import Driver, LoopConfig, Result, SamplerFailed
from .ray_loop import run_on_ray

__all__ = ["Driver", "LoopConfig", "Result", "SamplerFailed", "run"]


def run(cfg: LoopConfig, ray=False) -> Result:
    """Run the loop until its step or time budget is spent; returns the summary (and test extras).

    ray=True (or a trainer.ray_loop.RayConfig): the trainer as a Ray actor group and the samplers as actors on
    other nodes (trainer/ray_loop.py); the default runs the samplers as processes of this machine."""
    if ray:
        if cfg.promote is not None:
            raise ValueError("promotion to a prod channel (LoopConfig.promote) runs in the local loop, not on Ray")
        return run_on_ray(cfg, ray)
    return Driver(cfg).run()
