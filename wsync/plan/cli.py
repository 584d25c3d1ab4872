"""`wsync plan ...`: the systems model on the command line, every subcommand with --json.

    wsync plan models                         catalog: parameters, active, checkpoint bytes
    wsync plan transfer [--published]         sync time per model, link and codec, and the idle cost
    wsync plan route --model M --trainer fsdp:4 --engine vllm:tp=2   the routing plan: per-rank bytes, busiest rank
    wsync plan lora --model M --rank R --layout L [--targets ...]
    wsync plan loop [--mode sync|async ...]   decode roofline and one simulated loop (sync vs async)
    wsync plan sweep [--png out.png]          trainer/sampler splits x batch x staleness cap, Pareto table
    wsync plan sandboxes --rate R ...         sandbox pool for a rollout rate (Little's law, Poisson quantile)
    wsync plan validate [LOOP.json]           the loop model vs the reference loop's measured samples/s
"""
from __future__ import annotations

import argparse
import dataclasses

from . import measured
from .loop import GPUS, SimulatedLoop
from .models import PlanError
from .report import cmd_loop, cmd_lora, cmd_models, cmd_sandboxes, cmd_sweep, cmd_transfer, cmd_validate
from .reshard import cmd_route
from .transfer import parse_link


# What each SimulatedLoop field means on the command line (a field left out here shows up in the help tests).
LOOP_HELP = {
    "model": "a catalog name (`wsync plan models`) or a Hugging Face config.json (default %(default)s)",
    "gpu": "GPU model of every rank (default %(default)s)",
    "train_gpus": "GPUs in the trainer pool (default %(default)s)",
    "infer_gpus": "GPUs in the sampler pool (default %(default)s)",
    "tp": "GPUs per inference engine, tensor parallel (default %(default)s)",
    "max_batch": "sequences each engine decodes at once (default %(default)s)",
    "prompt_tokens": "prompt length of every sample, tokens (default %(default)s)",
    "response_mean": "mean response length, tokens (default %(default)s)",
    "response_sigma": "lognormal sigma of response lengths, the long tail; 0: all equal (default %(default)s)",
    "response_max": "generation cap, tokens (default %(default)s)",
    "samples_per_step": "samples per trainer step (default %(default)s)",
    "mode": "sync: generate, train and sync in turn; async: overlapped. plan loop simulates both side by side; "
            "this one is recorded in --json's config (default %(default)s)",
    "max_staleness": "async: versions a sample may lag when trained on (default %(default)s)",
    "steps": "trainer steps to simulate (default %(default)s)",
    "warmup_steps": "first steps left out of the steady-state figures (default %(default)s)",
    "sync_s": "seconds per weight sync (default: the wire time of --codec over --link)",
    "engine_pause_s": "seconds engines stop decoding per weight update (default: --sync-s)",
    "link": "trainer-to-engine link: tcp-50g, rdma-3.2t, wan-10g, ... or a rate like 25g, 3.2t, 800m "
            "(default %(default)s)",
    "codec": "what each sync sends: full weights, a delta, or a LoRA adapter (default %(default)s)",
    "infer_mfu": "share of peak FLOP/s a decode step reaches when compute bound (default %(default)s)",
    "mem_efficiency": "share of HBM bandwidth a decode step reaches when memory bound (default %(default)s)",
    "step_overhead_s": "launch and scheduling seconds of each decode step (default %(default)s)",
    "train_mfu": "share of peak FLOP/s the trainer reaches (default %(default)s)",
    "train_flops_per_param": "trainer FLOPs per active weight per token: 6 forward and backward, 2 logprob "
                             "recompute (default %(default)s)",
    "train_step_s": "measured trainer compute seconds per step (default: the FLOP model)",
    "group_size": "samples per prompt, a GRPO group, started and trained together (default %(default)s)",
    "early_stop": "chance per token that a sample ends before its cap; used with a length table "
                  "(default %(default)s)",
    "seed": "random seed of response lengths (default %(default)s)",
}

# The sweep sets these itself at every point of its grid, from the flags named: given, they would be overridden.
SWEEP_SETS = {"train_gpus": "--train-splits", "infer_gpus": "--total-gpus minus --train-splits",
              "max_batch": "--batches", "max_staleness": "--caps", "mode": "--caps (0: sync)"}


def _refuse_for_sweep(p) -> None:
    """The flags of SWEEP_SETS refused in one line, rather than left out: argparse would read `--mode` as
    an abbreviation of `--model`."""

    class SetBySweep(argparse.Action):
        def __call__(self, parser, namespace, values, option_string=None):
            parser.error(f"argument {option_string}: plan sweep sets it at every point, from {SWEEP_SETS[self.dest]}")

    for name in SWEEP_SETS:
        p.add_argument("--" + name.replace("_", "-"), dest=name, action=SetBySweep, default=argparse.SUPPRESS,
                       help=argparse.SUPPRESS)


def _link(spec: str) -> str:
    """--link checked while parsing, so a wrong one is a usage error (exit 2) before any work."""
    try:
        parse_link(spec)
    except PlanError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return spec


def _loop_flags(p, skip: tuple = ()) -> None:
    choices = {"mode": ["sync", "async"], "gpu": list(GPUS), "codec": ["full", "delta", "lora"]}
    for f in dataclasses.fields(SimulatedLoop):
        default = f.default
        if isinstance(default, (tuple, bool)) or f.name == "decode_curve" or f.name in skip:
            continue  # set from code, or via --decode-curve
        kind = float if default is None else type(default)
        if f.name == "gpu":
            kind = str.lower  # get_gpu takes H100 as well as h100
        elif f.name == "link":
            kind = _link
        p.add_argument("--" + f.name.replace("_", "-"), dest=f.name, type=kind, default=default,
                       choices=choices.get(f.name), help=LOOP_HELP.get(f.name))
    p.add_argument("--decode-curve", default="",
                   help="measured decode curve 'batch:seconds,...', e.g. 1:0.01,64:0.02 (replaces the roofline)")


def add_parsers(sub) -> None:
    plan = sub.add_parser("plan", help="systems model: sync cost, LoRA size, RL loop, layouts, sandboxes")
    ps = plan.add_subparsers(dest="plan_cmd", required=True)

    m = ps.add_parser("models", help="catalog models: parameters and bytes from their configs")
    m.add_argument("--json", action="store_true", help="print JSON instead of a table")
    m.set_defaults(fn=cmd_models)

    t = ps.add_parser("transfer", help="weight-update time per model, link and codec",
                      description="Weight-update time per model, link and codec, and the idle cost. Codec speeds and "
                                  f"per-tensor costs are measured inputs: {measured.WHERE}.")
    t.add_argument("--model", action="append", help="catalog name or config.json (repeatable; default: the published four)")
    t.add_argument("--link", action="append", help="tcp-50g, rdma-3.2t, wan-10g, ... or a rate like 25g (repeatable)")
    t.add_argument("--codec", action="append", choices=["full", "delta", "lora"], help="repeatable; default all three")
    t.add_argument("--delta-saving", type=float, default=None,
                   help="fraction of bytes a delta removes, for every model (default 0.98; a quantized checkpoint's "
                        "delta then comes from the measured fractions of its codes, scales and BF16 rest that change)")
    t.add_argument("--tier", choices=["packed", "sparse"], default="packed", help="delta tier whose speed is used")
    t.add_argument("--lora-rank", type=int, default=32, help="LoRA rank, for the adapter-only row (default: 32)")
    t.add_argument("--lora-layout", default="shared-outer", choices=["shared-outer", "per-expert", "dense"],
                   help="how MoE experts carry LoRA factors (default: shared-outer)")
    t.add_argument("--dtype", help="count every weight in this dtype (default: the checkpoint as published)")
    t.add_argument("--backend", default="fastest",
                   help="codec speeds to price with: fastest (the fastest measured backend), ref, cpu, cuda[:GPU] "
                        "(the newest whole sync measured on a GPU by `wsync bench gpu-sync`, that GPU's if "
                        "named; else a measured cuda codec run, else the GPU's bandwidth bound, h100 unless named; "
                        "the output says which), or "
                        "gpu-bound:GPU (h100, h200, b200, a100: HBM bandwidth over the bytes moved, not a measurement)")
    t.add_argument("--encode-gbps", type=float, help="override the measured encode speed (GB/s per worker)")
    t.add_argument("--apply-gbps", type=float, help="override the measured apply speed (GB/s per worker)")
    t.add_argument("--encode-workers", type=int, default=1, help="trainer ranks encoding shards in parallel")
    t.add_argument("--apply-workers", type=int, default=1, help="engine ranks applying shards in parallel")
    t.add_argument("--buckets", type=int, default=16, help="buckets the sync is pipelined over")
    t.add_argument("--usd-per-gpu-s", type=float, default=0.01, help="price of an idle GPU-second")
    t.add_argument("--gpus", type=int, default=1, help="GPUs idle during a sync (prices the whole fleet)")
    t.add_argument("--trainer-ranks", type=int, help="sharded sync: trainer ranks sending their own slices, each over "
                   "its own --link (with --engine-ranks)")
    t.add_argument("--engine-ranks", type=int, help="sharded sync: ranks of the one engine receiving")
    t.add_argument("--from-plan", action="store_true", help="sharded sync: the busiest link's bytes from the routing "
                   "plan of fsdp:M -> vllm:tp=N (standard attention; else total / min(M, N))")
    t.add_argument("--published", action="store_true", help="reproduce the published tables and say what does not add up")
    t.add_argument("--json", action="store_true", help="print JSON instead of a table")
    t.add_argument("--per-tensor-us", type=float, default=None,
                   help="seconds per tensor at each end, in microseconds (default: the newest `wsync bench codec "
                        "--shape moe` run in the measured inputs)")
    t.set_defaults(fn=cmd_transfer)

    ro = ps.add_parser("route", help="routing plan of sharded trainer ranks into sharded engine ranks")
    ro.add_argument("--model", required=True, help="catalog name or a Hugging Face config.json (or its directory)")
    ro.add_argument("--trainer", default="fsdp:4", help="fsdp:N, hsdp:RxS or tp:N (default: fsdp:4)")
    ro.add_argument("--engine", default="vllm:tp=2",
                    help="vllm:tp=N[,ep=0][,replicas=R] or hf:tp=N[,pad=P][,replicas=R] (default: vllm:tp=2)")
    ro.add_argument("--json", action="store_true", help="print JSON instead of a table")
    ro.set_defaults(fn=cmd_route)

    lo = ps.add_parser("lora", help="LoRA adapter bytes for a model, rank and layout")
    lo.add_argument("--model", required=True, help="model name (see `wsync plan models`)")
    lo.add_argument("--rank", type=int, default=32, help="LoRA rank (default: 32)")
    lo.add_argument("--layout", default="shared-outer", choices=["shared-outer", "per-expert", "dense"],
                    help="how MoE experts carry LoRA factors (default: shared-outer)")
    lo.add_argument("--targets", nargs="+", default=["all-linear"],
                    help="all-linear, attention, mlp, experts, dense_mlp, shared_experts, or module names")
    lo.add_argument("--dtype", default="bf16", help="adapter dtype (default: bf16)")
    lo.add_argument("--no-mtp", action="store_true", help="leave MTP layers out of the adapter")
    lo.add_argument("--json", action="store_true", help="print JSON instead of a table")
    lo.set_defaults(fn=cmd_lora)

    lp = ps.add_parser("loop", help="decode roofline and a simulated RL loop, sync vs async")
    _loop_flags(lp)
    lp.add_argument("--json", action="store_true", help="print JSON instead of a table")
    lp.set_defaults(fn=cmd_loop)

    sw = ps.add_parser("sweep", help="GPU split x batch x staleness cap: throughput-staleness Pareto table")
    _loop_flags(sw, skip=tuple(SWEEP_SETS))
    _refuse_for_sweep(sw)
    sw.add_argument("--total-gpus", type=int, default=16, help="GPUs to split between trainer and samplers (default: 16)")
    sw.add_argument("--train-splits", type=int, nargs="+", default=[2, 4, 8],
                    help="trainer GPUs to try; the rest of --total-gpus sample (default: 2 4 8)")
    sw.add_argument("--batches", type=int, nargs="+", default=[32, 64, 128], help="rollout batch sizes to try (default: 32 64 128)")
    sw.add_argument("--caps", type=int, nargs="+", default=[0, 1, 2, 4], help="staleness caps to try; 0: the sync loop (default: 0 1 2 4)")
    sw.add_argument("--png", help="write a plot of tokens/s against staleness here (needs matplotlib)")
    sw.add_argument("--json", action="store_true", help="print JSON instead of a table")
    sw.set_defaults(fn=cmd_sweep, steps=8)

    sb = ps.add_parser("sandboxes", help="sandbox pool size for a rollout rate")
    sb.add_argument("--rate", type=float, required=True, help="rollouts started per second")
    sb.add_argument("--actions", type=float, default=20.0, help="actions per rollout")
    sb.add_argument("--action-latency", type=float, default=2.0, help="seconds per action in the sandbox")
    sb.add_argument("--think", type=float, default=0.0, help="model seconds between actions (sandbox held)")
    sb.add_argument("--startup", type=float, default=30.0, help="sandbox start-up seconds")
    sb.add_argument("--failure-rate", type=float, default=0.02, help="fraction of sandboxes that fail and restart (default: 0.02)")
    sb.add_argument("--quantile", type=float, default=0.99, help="size the pool for this quantile of demand (default: 0.99)")
    sb.add_argument("--json", action="store_true", help="print JSON instead of a table")
    sb.set_defaults(fn=cmd_sandboxes)

    va = ps.add_parser("validate", help="predict the reference loop's measured samples/s from its measured costs")
    va.add_argument("results", nargs="?", help="a `wsync bench loop` JSON (default: the newest *-loop.json "
                                               f"run in {measured.WHERE})")
    va.add_argument("--seeds", type=int, default=3, help="simulated runs averaged per prediction")
    va.add_argument("--json", action="store_true", help="print JSON instead of a table")
    va.set_defaults(fn=cmd_validate)
