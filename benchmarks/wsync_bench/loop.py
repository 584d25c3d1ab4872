"""Sync vs async on long-tailed responses: the benchmark behind the reference loop's claim.

    wsync bench loop --steps 100 --repeats 2                           # -> ~/.cache/wsync/results/
    wsync bench loop --steps 100 --repeats 2 --out benchmarks/results  # a run to commit
    wsync bench loop --ray --steps 40 --repeats 1                      # the same on a local Ray cluster

Runs the same configuration (same seed, task, policy, batch) once per mode,
alternating sync and async so that background load on a shared machine hits
both alike, and writes one JSON with every run's summary, the per-pair ratios
of samples/s, the rewards reached, and where each side's idle time went. The
machine is named in the file and in its name (``wsync_bench.results.stem``,
as `wsync bench all` names its results), and a PNG beside it plots reward,
throughput and staleness of sync and async together.
"""
from __future__ import annotations

import datetime as dt
import importlib
import json
import os
import sys
from pathlib import Path

from .loop_configs import brief, configs


def add_parsers(bench) -> None:
    p = bench.add_parser("loop", help="the reference loop, sync vs async on long-tailed lengths (--ray: on Ray)",
                         description=__doc__.splitlines()[0],
                         epilog="Default 30 steps, one sync/async pair: about 20 s here (2 cores); the committed "
                                "runs used --steps 100 --repeats 2, about 1.5 min. --ray adds a local Ray cluster's "
                                "start and the same runs on it.")
    p.add_argument("--steps", type=int, default=30, help="trainer steps of each run (default 30)")
    p.add_argument("--repeats", type=int, default=1, help="sync/async pairs, alternated (default 1)")
    # AReaL's default bound; at 2 the long tail mostly ends up dropped as stale and the sampler limits async
    p.add_argument("--max-staleness", type=int, default=4,
                   help="async: versions a sample may lag the trainer before it is dropped (default 4)")
    p.add_argument("--digits", type=int, default=3, help="digits of an ordinary prompt (default 3)")
    p.add_argument("--max-digits", type=int, default=24, help="longest prompt of the long tail (default 24)")
    p.add_argument("--long-tail", type=float, default=0.25,
                   help="fraction of prompts drawn from the long tail (default 0.25)")
    p.add_argument("--samplers", type=int, default=1, help="sampler processes (default 1)")
    p.add_argument("--slots", type=int, default=128,
                   help="sequences the sampler decodes together (its batch, as max_num_seqs in vLLM; default 128)")
    p.add_argument("--group-size", type=int, default=8, help="samples per prompt, the GRPO group (default 8)")
    p.add_argument("--batch-groups", type=int, default=16, help="groups per trainer step (default 16)")
    p.add_argument("--lr", type=float, default=1e-3, help="trainer learning rate (default 1e-3)")
    p.add_argument("--refill-at", type=float, default=0.25,
                   help="refill once this fraction of the slots is free (default 0.25)")
    p.add_argument("--kv-cache", choices=["keep", "recompute"], default="keep",
                   help="in-flight sequences' KV cache after a weight update (default keep)")
    p.add_argument("--seed", type=int, default=0, help="random seed of the model, prompts and sampling (default 0)")
    p.add_argument("--quiet", action="store_true", help="no live progress line")
    p.add_argument("--out", type=Path, default=None,
                   help="folder for the .json and .png (default ~/.cache/wsync/results; benchmarks/results for a run "
                        "to commit)")
    p.add_argument("--ray", action="store_true",
                   help="also on a Ray cluster: sync and async on Ray beside the one-host loop (pip install -e \".[ray]\")")
    p.add_argument("--address", default=None, help="with --ray: a running Ray cluster (default: start a local one)")
    p.add_argument("--trainer-ranks", type=int, default=2, help="with --ray: FSDP2 ranks of the trainer (default 2)")
    p.set_defaults(fn=main)


def main(a) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # see trainer.cli: before any OpenMP pool starts
    if a.ray:
        from .loop_ray import main as on_ray

        return on_ray(a)

    importlib.import_module("transformers")  # the policy's: missing, one line names the extra before any run

    from trainer.loop import run
    from trainer.metrics import plot_runs
    from wsync.hardware import describe

    from .results import default_results_dir, one_line, options, stem

    out_dir = a.out or default_results_dir()

    runs, histories = [], []
    for rep in range(a.repeats):
        for mode, cfg in configs(a).items():
            print(f"[{rep + 1}/{a.repeats}] {mode}", file=sys.stderr)
            summary = run(cfg).summary
            runs.append({"mode": mode, "repeat": rep, **brief(summary)})
            histories.append((mode, rep, summary.get("history", [])))
    pairs = [(runs[i], runs[i + 1]) for i in range(0, len(runs), 2)]
    ratios = [asy["samples_per_s"] / syn["samples_per_s"] for syn, asy in pairs]
    # async drops groups past the staleness bound and trains first on what finishes first (shorter responses):
    # the token rate says how much of the samples/s gain is that
    token_ratios = [asy["tokens_per_s"] / syn["tokens_per_s"] for syn, asy in pairs]
    hw = describe()
    out = {
        "benchmark": "reference loop, sync vs async, long-tailed response lengths",
        "command": "wsync bench loop",
        "hardware": hw, "hardware_line": one_line(hw), "load_average": os.getloadavg(),
        "date": dt.date.today().isoformat(), "args": options(a) | {"out": str(out_dir)},
        "samples_per_s_ratio_async_over_sync": ratios, "tokens_per_s_ratio_async_over_sync": token_ratios,
        "reward_last": {m: [r["reward_last"] for r in runs if r["mode"] == m] for m in ("sync", "async")},
        "runs": runs,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{stem(hw, out['date'])}-loop.json"
    path.write_text(json.dumps(out, indent=1))
    png = path.with_suffix(".png")
    if not plot_runs([{"label": f"{m} #{r + 1}", "mode": m, "steps": h} for m, r, h in histories], png,
                     title=f"sync vs async, {hw['cpu']}, {hw['cores']} cores"):
        png = None
    for (syn, asy), r, rt in zip(pairs, ratios, token_ratios):
        print(f"sync {syn['samples_per_s']:.1f} samples/s reward {syn['reward_last']:.3f} | async "
              f"{asy['samples_per_s']:.1f} samples/s reward {asy['reward_last']:.3f} (dropped {asy['dropped_stale']}) "
              f"| x{r:.2f} samples/s, x{rt:.2f} tokens/s")
    print(f"wrote {path}" + (f" and {png}" if png else ""))
