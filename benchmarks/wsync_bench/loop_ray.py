"""`wsync bench loop --ray`: sync vs async on a local Ray cluster, and what Ray costs over processes.

    wsync bench loop --ray --steps 40 --repeats 1

One local cluster for the whole run (a trainer node, a node per sampler). Each
repeat runs the same configuration four ways: sync and async on Ray (2 FSDP2
trainer ranks, sampler actors, weights over wsync tcp) and sync and async on
the one-host loop (a trainer process, sampler processes), the order reversed on
odd repeats so background load hits all alike. Reported: async over sync
samples/s on each, Ray over the one-host loop per mode, and where the Ray
trainer's step time goes (the GRPO step on the shards, the all-gather and
publish, and the Ray calls around them).
"""
from __future__ import annotations

import datetime as dt
import json
import os
import sys
import time

from wsync.errors import BackendUnavailable


def _where_time_goes(s: dict) -> dict:
    """Per trainer step, seconds: training, publishing (Ray: all-gather + publish), Ray's calls around a step."""
    n = max(s["steps"], 1)
    t = s["trainer"]
    calls = s["ray"]["step_overhead_s"] if "ray" in s else 0.0  # the driver counts Ray's calls as training
    out = {"train_s_per_step": (t["train_s"] - calls) / n, "publish_s_per_step": t["publish_s"] / n,
           "wait_samples_s_per_step": t["wait_samples_s"] / n}
    if "ray" in s:
        out["ray_call_s_per_step"] = calls / n
        steps = s["ray"]["steps"]
        out["gather_s_per_step"] = sum(x["gather_s"] for x in steps) / max(len(steps), 1)
    return out


def main(a) -> None:
    try:
        import ray
    except ModuleNotFoundError as e:
        raise BackendUnavailable(f"wsync bench loop --ray needs ray ({e}): pip install -e '.[ray]'") from None

    from trainer.loop import run
    from trainer.ray_loop import RayConfig, local_cluster
    from wsync.hardware import describe

    from .loop_configs import brief, configs
    from .results import default_results_dir, one_line, options, stem

    out_dir = a.out or default_results_dir()
    t0 = time.perf_counter()
    cluster = local_cluster(a.samplers, a.trainer_ranks) if a.address is None else None
    ray.init(address=cluster.address if cluster else a.address, include_dashboard=False, logging_level="ERROR")
    rcfg = RayConfig(address=cluster.address if cluster else a.address, trainer_ranks=a.trainer_ranks)
    cluster_s = time.perf_counter() - t0
    runs = []
    try:
        for rep in range(a.repeats):
            order = [("ray", "sync"), ("ray", "async"), ("processes", "sync"), ("processes", "async")]
            for where, mode in order if rep % 2 == 0 else order[::-1]:
                print(f"[{rep + 1}/{a.repeats}] {mode} on {where}", file=sys.stderr)
                t = time.perf_counter()
                s = run(configs(a)[mode], ray=rcfg if where == "ray" else False).summary
                runs.append({"where": where, "mode": mode, "repeat": rep, "run_s": time.perf_counter() - t,
                             **_where_time_goes(s), **brief(s)})
    finally:
        ray.shutdown()
        if cluster is not None:
            cluster.shutdown()

    def pick(where, mode):
        return [r for r in runs if r["where"] == where and r["mode"] == mode]

    ratio = {w: [asy["samples_per_s"] / syn["samples_per_s"] for syn, asy in zip(pick(w, "sync"), pick(w, "async"))]
             for w in ("ray", "processes")}
    over = {m: [r["samples_per_s"] / p["samples_per_s"] for r, p in zip(pick("ray", m), pick("processes", m))]
            for m in ("sync", "async")}
    hw = describe()
    doc = {
        "benchmark": "reference loop on a local Ray cluster vs processes on one host, sync vs async, long-tailed lengths",
        "command": "wsync bench loop --ray",
        "hardware": hw, "hardware_line": one_line(hw), "load_average": os.getloadavg(),
        "date": dt.date.today().isoformat(), "args": options(a) | {"out": str(out_dir)}, "cluster_start_s": cluster_s,
        "samples_per_s_ratio_async_over_sync": ratio, "samples_per_s_ratio_ray_over_processes": over, "runs": runs,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{stem(hw, doc['date'])}-loop-ray.json"
    path.write_text(json.dumps(doc, indent=1))
    for w in ("ray", "processes"):
        for syn, asy, r in zip(pick(w, "sync"), pick(w, "async"), ratio[w]):
            print(f"{w}: sync {syn['samples_per_s']:.1f} samples/s reward {syn['reward_last']:.3f} | async "
                  f"{asy['samples_per_s']:.1f} samples/s reward {asy['reward_last']:.3f} | x{r:.2f} samples/s")
    for m in ("sync", "async"):
        for r, p, x in zip(pick("ray", m), pick("processes", m), over[m]):
            print(f"{m}: Ray {r['samples_per_s']:.1f} vs processes {p['samples_per_s']:.1f} samples/s (x{x:.2f}); "
                  f"per step on Ray: train {r['train_s_per_step'] * 1e3:.0f} ms (processes "
                  f"{p['train_s_per_step'] * 1e3:.0f}), gather+publish {r['publish_s_per_step'] * 1e3:.0f} ms "
                  f"(processes publish {p['publish_s_per_step'] * 1e3:.0f}), Ray calls "
                  f"{r['ray_call_s_per_step'] * 1e3:.0f} ms")
    print(f"wrote {path} (cluster start {cluster_s:.1f}s)")
