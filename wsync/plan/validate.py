"""Check the loop model against the reference loop: measured components in, predicted samples/s out.

`wsync bench loop` runs the reference loop (trainer/) in sync and async
mode and records, per run, where each side's time went. From one run we take
only per-component costs, never the throughput itself:

- decode step time: the sampler's decode seconds over its decode steps. The
  reference decoder runs every slot each step (idle slots feed padding), so
  one step costs the same at any batch: a flat decode curve;
- trainer step time: train seconds over steps;
- sync time: what the trainer spends publishing, plus, in sync mode, what the
  sampler spends waiting for and applying the version before it can start
  (in async mode that apply time is the engine pause instead);
- response lengths: the task's prompt-length law (digits, Pareto tail) gives
  each group's cap; the chance of an early EOS per token is fitted so the mean
  matches the tokens the samplers generated per sample;
- the layout: samplers, slots, group size, groups per step, staleness cap.

The discrete-event simulator (`sim.py`) then schedules those costs: stragglers,
group admission into free slots, the admission window, stale drops, idle time.
On shared cores a component costs more when the processes overlap (async)
than when they take turns (sync), so each run's costs are read from that run.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from .loop import SimulatedLoop
from .models import PlanError
from .sim import LoopResult, simulate

TOLERANCE = 0.20  # the model must land within 20% of the measured samples/s


@dataclass(frozen=True, kw_only=True)
class LoopMeasurement:
    """Per-component costs of one reference-loop run, and the throughput it reached."""

    mode: str  # sync | async
    steps: int  # trainer steps run
    samplers: int  # sampler processes (one engine each)
    slots: int  # decode slots per sampler
    group_size: int  # samples per prompt
    batch_groups: int  # groups per trainer step
    max_staleness: int  # async staleness cap (0 in sync mode)
    decode_step_s: float  # seconds per decode step (all slots computed)
    train_step_s: float  # trainer compute seconds per step
    sync_s: float  # seconds per step the trainer (sync: the whole loop) waits for a weight update
    pause_s: float  # async: seconds an engine stops decoding to apply a version
    caps: tuple[tuple[int, float], ...]  # (response cap, probability) of a prompt
    mean_response: float  # generated response tokens per sample
    measured_samples_per_s: float  # what the run reached: the number to predict
    label: str = ""


def task_caps(min_digits: int, max_digits: int, tail_prob: float, alpha: float = 1.2) -> tuple[tuple[int, float], ...]:
    """Response caps (digits + EOS) of trainer.task's prompt law, in closed form.

    A prompt has `min_digits` digits, or with `tail_prob` n = min(int(min * (1 + X)) + 1, max)
    digits with X ~ Lomax(alpha), i.e. P(1 + X >= y) = y**-alpha for y >= 1.
    """
    probs = {min_digits + 1: 1.0 - (tail_prob if max_digits > min_digits else 0.0)}
    if max_digits > min_digits and tail_prob > 0:
        surv = lambda k: (k / min_digits) ** -alpha  # noqa: E731 - P(int(min * (1 + X)) >= k)
        for k in range(min_digits, max_digits - 1):  # n = k + 1 digits
            probs[k + 2] = probs.get(k + 2, 0.0) + tail_prob * (surv(k) - surv(k + 1))
        probs[max_digits + 1] = probs.get(max_digits + 1, 0.0) + tail_prob * surv(max_digits - 1)
    return tuple(sorted(probs.items()))


def mean_length(caps, early_stop: float) -> float:
    """E[min(cap, G)] with G geometric(early_stop) on 1, 2, ...: sum over k < cap of (1 - p)**k."""
    q = 1.0 - early_stop
    return sum(p * (cap if early_stop == 0 else (1 - q ** cap) / early_stop) for cap, p in caps)


def fit_early_stop(caps, mean: float) -> float:
    """The per-token EOS chance that brings the mean response length down to `mean` (bisection)."""
    if mean >= mean_length(caps, 0.0):
        return 0.0
    lo, hi = 0.0, 0.999
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if mean_length(caps, mid) > mean else (lo, mid)
    return (lo + hi) / 2


def from_bench_run(run: dict, args: dict, label: str = "") -> LoopMeasurement:
    """Read one run of a `wsync bench loop` results file (its `runs[i]` and `args`)."""
    try:
        s, t = run["samplers"], run["trainer"]
        run["sync"]  # a run without its sync clocks is not one the model can read
        steps, n = int(args["steps"]), int(args["samplers"])
        trained = sum(run["staleness_hist"].values())
        # tokens the samplers generated (dropped samples included) per sample they generated
        tokens = s["slot_utilisation"] * s["decode_steps"] * args["slots"]
        generated = run.get("samples_generated") or trained + run["dropped_stale"]
        sync_mode = run["mode"] == "sync"
        wait = (s["wait_version_s"] + s["apply_s"]) / n if sync_mode else 0.0
        return LoopMeasurement(
            mode=run["mode"], steps=steps, samplers=n, slots=int(args["slots"]), group_size=int(args["group_size"]),
            batch_groups=int(args["batch_groups"]), max_staleness=0 if sync_mode else int(args["max_staleness"]),
            decode_step_s=s["decode_s"] / s["decode_steps"], train_step_s=t["train_s"] / steps,
            sync_s=(t["publish_s"] + wait) / steps, pause_s=0.0 if sync_mode else s["apply_s"] / n / steps,
            caps=task_caps(int(args["digits"]), int(args["max_digits"]), float(args["long_tail"]),
                           float(args.get("tail_alpha", 1.2))),
            mean_response=tokens / generated, measured_samples_per_s=run["samples_per_s"], label=label)
    except (KeyError, TypeError, ZeroDivisionError) as e:
        raise PlanError(f"not a `wsync bench loop` run with the recorded clocks the model needs ({e!r}); "
                        "regenerate with `wsync bench loop`") from e


def loop_config(m: LoopMeasurement, seed: int = 0) -> SimulatedLoop:
    """The simulator's config for a measured run: measured costs replace every modelled one."""
    return SimulatedLoop(
        mode=m.mode, max_staleness=max(m.max_staleness, 0), steps=m.steps, warmup_steps=0,
        train_gpus=1, infer_gpus=m.samplers, tp=1, max_batch=m.slots, group_size=m.group_size,
        samples_per_step=m.group_size * m.batch_groups, decode_curve=((1, m.decode_step_s), (m.slots, m.decode_step_s)),
        train_step_s=m.train_step_s, sync_s=m.sync_s, engine_pause_s=m.pause_s, length_table=m.caps,
        early_stop=fit_early_stop(m.caps, m.mean_response), prompt_tokens=0, abort_stale=False,
        response_max=max(c for c, _ in m.caps), seed=seed)


def predict(m: LoopMeasurement, seeds: int = 3) -> tuple[float, LoopResult]:
    """Predicted samples/s (mean over `seeds` simulated runs) and the first run's full result."""
    results = [simulate(loop_config(m, seed)) for seed in range(seeds)]
    return sum(r.samples_per_s for r in results) / len(results), results[0]


def validate(path: Path | str, seeds: int = 3) -> list[dict]:
    """One row per run of a `wsync bench loop` results file: measured vs predicted samples/s and idle shares."""
    return validate_runs(json.loads(Path(path).read_text()), seeds)


def validate_runs(doc: dict, seeds: int = 3) -> list[dict]:
    """validate() of a results file already read: its `runs` and `args` (the packaged loop entry has both)."""
    rows = []
    for i, run in enumerate(doc["runs"]):
        m = from_bench_run(run, doc["args"], label=f"{run['mode']} #{run.get('repeat', i)}")
        pred, r = predict(m, seeds)
        rows.append({
            "run": m.label, "mode": m.mode, "measured_samples_per_s": m.measured_samples_per_s,
            "predicted_samples_per_s": pred, "error": pred / m.measured_samples_per_s - 1.0,
            "within_tolerance": abs(pred / m.measured_samples_per_s - 1.0) <= TOLERANCE,
            "decode_step_ms": m.decode_step_s * 1e3, "train_step_s": m.train_step_s, "sync_s": m.sync_s,
            "mean_response": m.mean_response,
            "trainer_idle_measured": run["trainer_idle_pct"] / 100, "trainer_idle_predicted": r.trainer_idle,
            "sampler_idle_measured": run["sampler_idle_pct"] / 100, "sampler_idle_predicted": r.sampler_idle,
            "dropped_measured": run["dropped_stale"] / (sum(run["staleness_hist"].values()) + run["dropped_stale"]),
            "dropped_predicted": r.dropped_fraction,
        })
    return rows


def with_costs(m: LoopMeasurement, **changes) -> LoopMeasurement:
    """A what-if: the same run with some measured costs replaced (e.g. a 10x slower sync)."""
    return replace(m, **changes)
