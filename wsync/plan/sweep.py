"""Layout sweeps: how to split GPUs between trainer and samplers, at what batch and staleness cap.

Each point of the grid runs the loop simulator; the table keeps throughput and
staleness side by side and marks the Pareto front (no other point has both more
tokens/s and less mean staleness). A PNG of the front is drawn when matplotlib
is installed; without it the table is the whole answer.
"""
from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass, replace

from .loop import SimulatedLoop
from .models import PlanError
from .sim import simulate


@dataclass(frozen=True, kw_only=True)
class SweepPoint:
    train_gpus: int
    infer_gpus: int
    max_batch: int
    max_staleness: int  # 0 with mode sync: the on-policy baseline
    mode: str
    tokens_per_s: float
    samples_per_s: float
    staleness_mean: float
    staleness_p99: float
    dropped_fraction: float
    trainer_idle: float
    sampler_idle: float
    pareto: bool = False


def sweep(base: SimulatedLoop, *, total_gpus: int, train_gpus: list[int], batches: list[int],
          caps: list[int]) -> list[SweepPoint]:
    """Simulate every (train/infer split, batch, cap) and mark the throughput-staleness Pareto front."""
    points = []
    for tg, b, cap in itertools.product(train_gpus, batches, caps):
        ig = total_gpus - tg
        if tg < 1 or ig < base.tp:
            raise PlanError(f"train_gpus={tg} leaves {ig} of {total_gpus} GPUs for samplers; "
                            f"need at least tp={base.tp}")
        cfg = replace(base, train_gpus=tg, infer_gpus=ig, max_batch=b, max_staleness=cap,
                      mode="sync" if cap == 0 else "async")
        r = simulate(cfg)
        points.append(SweepPoint(train_gpus=tg, infer_gpus=ig, max_batch=b, max_staleness=cap, mode=cfg.mode,
                                 tokens_per_s=r.tokens_per_s, samples_per_s=r.samples_per_s,
                                 staleness_mean=r.staleness_mean, staleness_p99=r.staleness_p99,
                                 dropped_fraction=r.dropped_fraction, trainer_idle=r.trainer_idle,
                                 sampler_idle=r.sampler_idle))
    return mark_pareto(points)


def mark_pareto(points: list[SweepPoint]) -> list[SweepPoint]:
    """Flag points no other point beats on both tokens/s (higher) and mean staleness (lower)."""
    def dominated(p: SweepPoint) -> bool:
        return any(q.tokens_per_s >= p.tokens_per_s and q.staleness_mean <= p.staleness_mean
                   and (q.tokens_per_s > p.tokens_per_s or q.staleness_mean < p.staleness_mean) for q in points)

    marked = [replace(p, pareto=not dominated(p)) for p in points]
    return sorted(marked, key=lambda p: (-p.pareto, -p.tokens_per_s))


def as_rows(points: list[SweepPoint]) -> list[dict]:
    return [asdict(p) for p in points]


def plot(points: list[SweepPoint], path: str) -> str | None:
    """Write a PNG of tokens/s against mean staleness; returns None when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for mode, marker in (("sync", "s"), ("async", "o")):
        pts = [p for p in points if p.mode == mode]
        ax.scatter([p.staleness_mean for p in pts], [p.tokens_per_s for p in pts], marker=marker,
                   alpha=0.5, label=f"{mode} layouts")
    front = sorted((p for p in points if p.pareto), key=lambda p: p.staleness_mean)
    ax.plot([p.staleness_mean for p in front], [p.tokens_per_s for p in front], "k-", label="Pareto front")
    for p in front:
        ax.annotate(f"{p.train_gpus}T/{p.infer_gpus}I b{p.max_batch} k{p.max_staleness}",
                    (p.staleness_mean, p.tokens_per_s), fontsize=7, xytext=(4, 2), textcoords="offset points")
    ax.set_xlabel("mean staleness (versions)")
    ax.set_ylabel("trained tokens / s")
    ax.set_title("RL loop layouts: throughput vs staleness")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
