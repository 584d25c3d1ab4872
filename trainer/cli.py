"""`wsync loop` (and `python -m trainer`): run the reference RL loop from the command line.

    wsync loop --steps 100 --json async.json      # async, long-tailed response lengths
    wsync loop --mode sync --steps 100            # the synchronous baseline on the same task

Imports nothing heavy at module level: the wsync parser is built on every call.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def add_parsers(sub) -> None:
    p = sub.add_parser("loop", help="run the reference async RL loop (GRPO, in-flight weight updates)")
    add_arguments(p)
    p.set_defaults(fn=_from_wsync)


def _from_wsync(a) -> None:
    a.argv = sys.argv[2:]  # after "wsync loop"
    run_from_args(a)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mode", choices=["sync", "async"], default="async",
                   help="sync: samplers wait for every step, every sample on-policy; async: sampling overlaps "
                        "training, samples up to --max-staleness versions old (default async)")
    # AReaL's default bound; at 2 most of the long tail is dropped as stale and the sampler limits async
    p.add_argument("--max-staleness", type=int, default=4,
                   help="eta: versions a sample may lag before it is dropped (async; default 4)")
    p.add_argument("--seconds", type=float, default=0.0,
                   help="wall-time budget in seconds, sampler start-up excluded (default: 60 if --steps is not "
                        "given, else no time limit)")
    p.add_argument("--steps", type=int, default=0, help="trainer steps to run (default 0: no step limit)")
    p.add_argument("--samplers", type=int, default=1, help="sampler processes (default 1)")
    p.add_argument("--slots", type=int, default=128,
                   help="sequences each sampler decodes together, as max_num_seqs in vLLM (default 128)")
    p.add_argument("--refill-at", type=float, default=0.25,
                   help="refill freed slots once this fraction of them is free: fewer, larger prefills (default 0.25)")
    p.add_argument("--group-size", type=int, default=8, help="samples per prompt, the GRPO group (default 8)")
    p.add_argument("--batch-groups", type=int, default=16, help="groups per trainer step (default 16)")
    p.add_argument("--digits", type=int, default=3, help="digits of an ordinary prompt (default 3)")
    # RL responses are long-tailed: a few long ones hold a synchronous step back, which is what async removes
    p.add_argument("--max-digits", type=int, default=24, help="longest prompt of the long tail (default 24)")
    p.add_argument("--long-tail", type=float, default=0.25,
                   help="probability a prompt comes from the long tail (default 0.25; 0: every prompt --digits long)")
    p.add_argument("--tail-alpha", type=float, default=1.2, help="Pareto shape of the tail (default 1.2)")
    p.add_argument("--lr", type=float, default=1e-3, help="trainer learning rate (default 1e-3)")
    p.add_argument("--is-cap", type=float, default=4.0, help="C: truncation of importance weights (default 4.0)")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (default 1.0)")
    p.add_argument("--top-p", type=float, default=1.0,
                   help="nucleus sampling: keep the likeliest tokens up to this probability mass (default 1.0: all)")
    p.add_argument("--kv-cache", choices=["keep", "recompute"], default="keep",
                   help="in-flight sequences' KV cache after a weight update (default keep)")
    p.add_argument("--address", default=None,
                   help="publisher address, tcp://HOST:PORT or local://NAME (default tcp://127.0.0.1:0, a free port); "
                        "with --ray: the Ray cluster to join, auto or HOST:PORT (default: start a local cluster)")
    p.add_argument("--ray", action="store_true",
                   help="run on Ray: the trainer as FSDP2 ranks of one actor group, samplers as actors on other "
                        "nodes, weights over wsync tcp (docs/ray.md)")
    p.add_argument("--trainer-ranks", type=int, default=2, help="with --ray: FSDP2 ranks of the trainer (default 2)")
    p.add_argument("--publish-port", type=int, default=0,
                   help="with --ray: the tcp port samplers fetch weights from on the trainer node (default 0: any free)")
    p.add_argument("--codec", choices=["delta", "raw"], default="delta",
                   help="delta: only what changed each step; raw: whole weights every step (default delta)")
    p.add_argument("--seed", type=int, default=0, help="random seed of the model, prompts and sampling (default 0)")
    p.add_argument("--metrics-port", type=int,
                   help="Prometheus metrics on 127.0.0.1: the trainer on PORT, sampler i on PORT+1+i (default: none)")
    p.add_argument("--quiet", action="store_true", help="no live progress line")
    p.add_argument("--json", type=Path, help="write the summary (with per-step history) to this file")
    p.add_argument("--png", type=Path, help="reward vs wall time plot (needs matplotlib; default: next to --json)")


def config_from_args(a):
    from .decode import DecodeConfig
    from .grpo import GRPOConfig
    from .loop import LoopConfig
    from .task import TaskConfig

    if a.steps <= 0 and a.seconds <= 0:
        a.seconds = 60.0
    task = TaskConfig(min_digits=a.digits, max_digits=max(a.max_digits, a.digits), tail_prob=a.long_tail,
                      tail_alpha=a.tail_alpha)
    return LoopConfig(
        mode=a.mode, max_staleness=a.max_staleness, steps=a.steps, seconds=a.seconds, samplers=a.samplers,
        group_size=a.group_size, batch_groups=a.batch_groups, seed=a.seed, codec=a.codec,
        address=a.address if a.address and not getattr(a, "ray", False) else "tcp://127.0.0.1:0",
        metrics_port=a.metrics_port,
        progress=not a.quiet, task=task, grpo=GRPOConfig(lr=a.lr, is_cap=a.is_cap),
        decode=DecodeConfig(slots=a.slots, temperature=a.temperature, top_p=a.top_p, kv_cache=a.kv_cache,
                            refill_at=a.refill_at),
    )


def ray_config_from_args(a):
    """False without --ray, else the RayConfig the flags make."""
    if not getattr(a, "ray", False):
        return False
    from .ray_loop import RayConfig

    return RayConfig(address=a.address, trainer_ranks=a.trainer_ranks, publish_port=a.publish_port)


def run_from_args(a, prog: str = "wsync loop") -> dict:
    import os

    # before torch or wsync's C++ backend start an OpenMP pool in this process: one thread each, the
    # loop's processes share the cores (spinning idle OpenMP threads cost the samplers dearly on 2 cores)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from .loop import run
    from .metrics import plot
    from .ray_loop import TrainerFailed  # imports no ray

    try:
        result = run(config_from_args(a), ray=ray_config_from_args(a))
    except TrainerFailed as e:
        print(f"{prog}: {e}", file=sys.stderr)  # what each sampler still serves
        if a.json:
            a.json.parent.mkdir(parents=True, exist_ok=True)
            a.json.write_text(json.dumps(e.result.summary, indent=1))
        raise SystemExit(1) from None
    s = result.summary
    s["command"] = " ".join([prog, *getattr(a, "argv", [])])
    png = a.png or (a.json.with_suffix(".png") if a.json else None)
    if png is not None:
        s["png"] = str(png) if plot(s["history"], png, f"{a.mode} (eta={s['config']['max_staleness']})") else None
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(s, indent=1))
    print(one_line(s))
    return s


def one_line(s: dict) -> str:
    t, smp = s["trainer"], s["samplers"]
    return (f"{s['config']['mode']}: {s['steps']} steps in {s['wall_s']:.1f}s, {s['samples_per_s']:.1f} samples/s, "
            f"reward {s['reward_first']:.3f} -> {s['reward_last']:.3f}, dropped {s['dropped_stale']}, "
            f"trainer idle {t['idle_pct']:.1f}% (waiting for samples {t['wait_samples_s']:.1f}s), "
            f"sampler idle {smp['idle_pct']:.1f}% (no work {smp['no_work_s']:.1f}s, "
            f"waiting for a version {smp['wait_version_s']:.1f}s, queue full {smp['queue_full_s']:.1f}s), "
            f"slots used {smp['slot_utilisation']:.0%}, sync {s['sync']['bytes_per_version_mean'] / 1e3:.1f} kB/version")


def main(argv=None) -> int:
    from wsync.errors import WsyncError

    p = argparse.ArgumentParser(prog="python -m trainer", description="The reference async RL loop.")
    add_arguments(p)
    a = p.parse_args(argv)
    a.argv = list(sys.argv[1:] if argv is None else argv)
    try:
        run_from_args(a, prog="python -m trainer")
    except (WsyncError, ValueError) as e:
        print(f"trainer: error: {e}", file=sys.stderr)
        return 2
    return 0
