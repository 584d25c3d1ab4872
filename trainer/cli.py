"""`wsync loop` (and `python -m trainer`): run the reference RL loop from the command line.

    wsync loop --steps 100 --json async.json      # async, long-tailed response lengths
    wsync loop --mode sync --steps 100            # the synchronous baseline on the same task
    wsync loop --steps 40 --promote-every 5 --gate 0.05 --corrupt-reward-steps 11:20 --rollback-at 32:5
                                                  # continual learning: a prod channel behind a gate (promote.py)

Imports nothing heavy at module level: the wsync parser is built on every call.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .promote import CORRUPTIONS


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
    add_promote_arguments(p)


def add_promote_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("continual learning", "a prod channel that serves only versions a gate passed "
                             "(trainer/promote.py); every option here needs --promote-every")
    g.add_argument("--promote-every", type=int, default=0, metavar="N",
                   help="every N trainer steps, offer the trained version to a channels hub and promote it onto "
                        "prod through the gate; a production engine follows prod, answers --requests prompts per "
                        "step and logs which version answered each (default 0: off)")
    g.add_argument("--gate", type=float, default=None, metavar="THRESHOLD",
                   help="the gate's floor: a candidate's mean reward, greedy on the held-out prompts, must reach "
                        "THRESHOLD (a reward in [0, 1]; default 0.0) and be at most --gate-margin below the reward "
                        "of the version prod serves")
    g.add_argument("--gate-margin", type=float, default=None, metavar="M",
                   help="how far below prod's version a candidate's held-out reward may be (in [0, 1]; 1: the "
                        "floor alone; default 0.05)")
    g.add_argument("--gate-prompts", type=int, default=None, metavar="K",
                   help="held-out prompts the gate decodes, fixed for the run (default 128)")
    g.add_argument("--requests", type=int, default=None, metavar="R",
                   help="requests the production engine answers after each trainer step (default 2)")
    g.add_argument("--corrupt-reward-steps", type=_span, default=None, metavar="A:B",
                   help="a planted bad stretch: trainer steps A to B (inclusive) learn from a corrupted reward; "
                        "the gate should refuse what is offered then while prod keeps its last good version")
    g.add_argument("--corrupt-kind", choices=list(CORRUPTIONS), default=None,
                   help="the corruption: junk pays for tokens that are not digits, negate flips the reward's "
                        "sign, random is noise (default junk)")
    g.add_argument("--rollback-at", type=_rollback, default=None, metavar="STEP[:VERSION]",
                   help="after trainer step STEP, roll prod back to VERSION (0 or a multiple of N below STEP; "
                        "default: the version prod served before its current one) while training goes on")


# what the promote options are called on the command line, to name the ones given without --promote-every
_PROMOTE_FLAGS = {"gate": "--gate", "gate_margin": "--gate-margin", "gate_prompts": "--gate-prompts",
                  "requests": "--requests", "corrupt_reward_steps": "--corrupt-reward-steps",
                  "corrupt_kind": "--corrupt-kind", "rollback_at": "--rollback-at"}


def _span(text: str) -> tuple[int, int]:
    a, sep, b = text.partition(":")
    try:
        span = (int(a), int(b))
    except ValueError:
        span = None
    if not sep or span is None or not 1 <= span[0] <= span[1]:
        raise argparse.ArgumentTypeError(f"expected A:B, two trainer steps with 1 <= A <= B (e.g. 11:20), "
                                         f"got {text!r}")
    return span


def _rollback(text: str) -> tuple[int, int | None]:
    step, sep, to = text.partition(":")
    try:
        got = (int(step), int(to) if sep else None)
    except ValueError:
        got = None
    if got is None or got[0] < 1 or (got[1] is not None and got[1] < 0):
        raise argparse.ArgumentTypeError(f"expected STEP or STEP:VERSION, a trainer step >= 1 and a version >= 0 "
                                         f"(e.g. 30:10), got {text!r}")
    return got


def promote_config_from_args(a):
    """The PromoteConfig the flags make, or None without --promote-every (ValueError for a flag given alone)."""
    from .promote import PromoteConfig

    given = [flag for dest, flag in _PROMOTE_FLAGS.items() if getattr(a, dest, None) is not None]
    every = getattr(a, "promote_every", 0)
    if every < 0:
        raise ValueError(f"--promote-every must be a number of trainer steps >= 1 (0: off), got {every}")
    if not every:
        if given:
            raise ValueError(f"{', '.join(given)} {'needs' if len(given) == 1 else 'need'} --promote-every N: "
                             "without it nothing is promoted")
        return None
    if getattr(a, "ray", False):
        raise ValueError("--promote-every runs with the one-machine loop, not with --ray")
    opts = {"gate": a.gate, "margin": a.gate_margin, "prompts": a.gate_prompts, "requests": a.requests,
            "corrupt": a.corrupt_reward_steps, "corruption": a.corrupt_kind, "rollback": a.rollback_at}
    return PromoteConfig(every=every, **{k: v for k, v in opts.items() if v is not None})


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
        metrics_port=a.metrics_port, promote=promote_config_from_args(a),
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
    if "promotion" in s:
        from .promote import one_line as promotion_line

        print(promotion_line(s["promotion"]))
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
