"""What the loop measures: one record per trainer step, a live progress line, the final summary.

The summary answers the two questions the reference loop exists for: did the
policy learn (reward over steps and wall time), and where did each side's time
go (trainer: training, publishing, waiting for samples; samplers: decoding,
waiting for work under admission control, waiting for a version, blocked on a
full queue). Staleness, versions spanned per sequence and the importance
ratio statistics show what asynchrony cost in off-policyness.
"""
from __future__ import annotations

import sys
import time
from collections import Counter


def _hist(counter: Counter) -> dict:
    return {str(k): counter[k] for k in sorted(counter)}


def _mean(xs) -> float:
    xs = list(xs)
    return sum(xs) / len(xs) if xs else 0.0


class Recorder:
    """Collects step records and the cumulative clocks of trainer and samplers."""

    def __init__(self, *, progress: bool = True, window: int = 5):
        self.t0 = time.perf_counter()
        self.progress, self.window = progress, window
        self.steps: list[dict] = []
        self.trainer = {"train_s": 0.0, "publish_s": 0.0, "wait_samples_s": 0.0}
        self.samplers: dict[int, dict] = {}  # latest cumulative stats per worker
        self.staleness: Counter = Counter()
        self.spans: Counter = Counter()
        self.dropped = 0
        self.trained = 0
        self.tokens = 0

    def restart_clock(self) -> None:
        """Start wall time when every sampler is up: process start and imports are not the loop's cost."""
        self.t0 = time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def sampler_stats(self, worker: int, stats: dict) -> None:
        self.samplers[worker] = stats

    def step(self, version: int, groups: list[list[dict]], train: dict, sync: dict, queue_depth: int) -> dict:
        samples = [s for g in groups for s in g]
        self.trained += len(samples)
        self.tokens += sum(len(s["response"]) for s in samples)
        st, sp = Counter(), Counter()
        for s in samples:
            st[s["staleness"]] += 1
            sp[len(set(s["versions"]))] += 1
        self.staleness.update(st)
        self.spans.update(sp)
        rec = {
            "step": version, "t": round(self.elapsed(), 4),
            "reward": _mean(s["reward"] for s in samples),
            "response_len": _mean(len(s["response"]) for s in samples),
            "staleness": _hist(st), "versions_spanned": _hist(sp),
            **{k: train[k] for k in ("ratio_mean", "ratio_max", "ess", "clip_frac", "logprob_diff_max", "loss",
                                     "grad_norm")},
            "queue_depth": queue_depth, "dropped": self.dropped,
            "samples_per_s": self.trained / max(self.elapsed(), 1e-9),
            "trainer_idle_pct": self.trainer_idle_pct(), "sampler_idle_pct": self.sampler_idle_pct(),
            "sync_s": sync.get("seconds", 0.0), "sync_bytes": sync.get("bytes", 0),
        }
        self.steps.append(rec)
        if self.progress:
            self._print(rec)
        return rec

    def trainer_idle_pct(self) -> float:
        busy = self.trainer["train_s"] + self.trainer["publish_s"]
        return 100.0 * self.trainer["wait_samples_s"] / max(busy + self.trainer["wait_samples_s"], 1e-9)

    def sampler_clock(self) -> dict:
        keys = ("decode_s", "no_work_s", "wait_version_s", "queue_full_s", "apply_s")
        return {k: sum(s.get(k, 0.0) for s in self.samplers.values()) for k in keys}

    def sampler_idle_pct(self) -> float:
        c = self.sampler_clock()
        idle = c["no_work_s"] + c["wait_version_s"] + c["queue_full_s"]
        return 100.0 * idle / max(idle + c["decode_s"] + c["apply_s"], 1e-9)

    def _print(self, r: dict) -> None:
        stale = max((int(k) for k in r["staleness"]), default=0)
        two = sum(n for k, n in r["versions_spanned"].items() if int(k) > 1)
        line = (f"step {r['step']:>4}  t {r['t']:6.1f}s  reward {r['reward']:.3f}  {r['samples_per_s']:6.1f} samples/s  "
                f"stale<={stale}  spanning {two:>3}  ratio {r['ratio_mean']:.3f}/{r['ratio_max']:.2f}  "
                f"ess {r['ess']:.3f}  clip {r['clip_frac']:.3f}  q {r['queue_depth']:>2}  "
                f"idle T {r['trainer_idle_pct']:4.1f}% S {r['sampler_idle_pct']:4.1f}%")
        if sys.stderr.isatty():  # one line rewritten in place
            print("\r" + line, end="", file=sys.stderr, flush=True)
        elif r["step"] % 10 == 0 or r["step"] == 1:  # logs get a line every 10 steps
            print(line, file=sys.stderr, flush=True)

    def summary(self, window: int | None = None) -> dict:
        w = window or self.window
        rewards = [r["reward"] for r in self.steps]
        wall = self.elapsed()
        clock = self.sampler_clock()
        slots = sum(s.get("slots", 0) for s in self.samplers.values())
        steps = sum(s.get("steps", 0) for s in self.samplers.values())
        return {
            "steps": len(self.steps), "wall_s": wall,
            "samples_trained": self.trained, "samples_per_s": self.trained / max(wall, 1e-9),
            "tokens_per_s": self.tokens / max(wall, 1e-9),
            "samples_generated": sum(s.get("sequences", 0) for s in self.samplers.values()),
            "dropped_stale": self.dropped,
            "reward_first": _mean(rewards[:w]), "reward_last": _mean(rewards[-w:]),
            "staleness_hist": _hist(self.staleness), "versions_spanned_hist": _hist(self.spans),
            "trainer": {**{k: round(v, 4) for k, v in self.trainer.items()},
                        "idle_pct": self.trainer_idle_pct()},
            "samplers": {**{k: round(v, 4) for k, v in clock.items()}, "idle_pct": self.sampler_idle_pct(),
                         # mean fraction of slots holding a sequence per decode step
                         "slot_utilisation": (sum(s.get("tokens", 0) for s in self.samplers.values())
                                              / max(sum(s.get("steps", 0) * s.get("slots", 0)
                                                        for s in self.samplers.values()), 1)),
                         "decode_steps": steps, "slots": slots},
        }


def rolling_mean(xs: list[float], window: int) -> list[float]:
    """Mean of each value and the window - 1 before it (fewer at the start): a noisy per-step reward made readable."""
    out, total = [], 0.0
    for i, x in enumerate(xs):
        total += x
        if i >= window:
            total -= xs[i - window]
        out.append(total / min(i + 1, window))
    return out


def mean_staleness(rec: dict) -> float:
    """Mean versions behind of the samples one step trained on (from its histogram)."""
    n = sum(rec["staleness"].values())
    return sum(int(k) * v for k, v in rec["staleness"].items()) / n if n else 0.0


COLORS = {"sync": "tab:blue", "async": "tab:orange"}


def plot(steps: list[dict], path, title: str = "") -> bool:
    """PNG of one run: reward, throughput and staleness over wall time; False (nothing written) without matplotlib."""
    mode = "async" if any(mean_staleness(r) for r in steps) else "sync"
    return plot_runs([{"label": title or mode, "mode": mode, "steps": steps}], path, title)


def plot_runs(runs: list[dict], path, title: str = "") -> bool:
    """Runs side by side ({"label", "mode", "steps"} each, e.g. sync beside async): three panels over wall time.

    Reward per step is noisy (a batch of a few groups), so each run is drawn as
    a rolling mean with the raw line faint behind it; throughput is the
    cumulative samples/s the loop reports; staleness is the mean number of
    versions the trained samples were behind (0 for sync).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (rw, tp, st) = plt.subplots(3, 1, figsize=(7, 7.5), sharex=True)
    seen: dict[str, int] = {}
    for run in runs:
        steps = run["steps"]
        if not steps:
            continue
        k = seen[run["mode"]] = seen.get(run["mode"], -1) + 1
        color, ls = COLORS.get(run["mode"], "tab:gray"), ["-", "--", ":", "-."][k % 4]
        t = [r["t"] for r in steps]
        reward = [r["reward"] for r in steps]
        window = max(3, len(steps) // 15)
        rw.plot(t, reward, color=color, lw=0.8, alpha=0.25)
        rw.plot(t, rolling_mean(reward, window), color=color, ls=ls, lw=1.8,
                label=f"{run['label']} (mean of {window} steps)")
        tp.plot(t, [r["samples_per_s"] for r in steps], color=color, ls=ls, lw=1.5, label=run["label"])
        st.plot(t, rolling_mean([mean_staleness(r) for r in steps], window), color=color, ls=ls, lw=1.5,
                label=run["label"])
    rw.set_ylabel("mean reward")
    rw.legend(fontsize=8, loc="lower right")
    tp.set_ylabel("samples/s (since start)")
    st.set_ylabel("staleness (versions)")
    st.set_xlabel("wall time (s)")
    for ax in (rw, tp, st):
        ax.grid(alpha=0.3)
    tp.set_ylim(bottom=0)
    st.set_ylim(bottom=0)
    rw.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
