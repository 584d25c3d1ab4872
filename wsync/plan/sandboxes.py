"""Sandbox pool sizing for agentic rollouts: how many sandboxes keep the samplers fed.

Rollouts arrive at `rollouts_per_s`; each holds one sandbox from start-up through
its last action. Failed sessions are retried (a failure strikes at a uniform
point of the session, so it holds its sandbox half as long on average).
Little's law gives the mean number held, L = arrival rate x hold time. With
Poisson arrivals the number held is Poisson(L) whatever the hold-time
distribution (M/G/inf), so the pool for a quantile q is the q-quantile of
Poisson(L), and the Erlang-B formula (also insensitive to the hold-time
distribution) gives the chance a rollout finds that pool full.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from .models import PlanError


@dataclass(frozen=True, kw_only=True)
class SandboxConfig:
    rollouts_per_s: float  # rollouts that start per second (each needs one sandbox)
    actions_per_rollout: float = 20.0  # tool calls / environment steps per rollout
    action_latency_s: float = 2.0  # time the sandbox takes to execute one action
    think_s: float = 0.0  # model time between actions while the sandbox is held
    startup_s: float = 30.0  # time from request to a ready sandbox
    failure_rate: float = 0.02  # chance a session fails and the rollout starts over
    quantile: float = 0.99  # share of time the pool must cover demand

    def validate(self) -> None:
        if self.rollouts_per_s <= 0:
            raise PlanError(f"rollouts_per_s must be positive, got {self.rollouts_per_s}")
        if not 0.0 <= self.failure_rate < 1.0:
            raise PlanError(f"failure_rate must be in [0, 1), got {self.failure_rate}")
        if not 0.0 < self.quantile < 1.0:
            raise PlanError(f"quantile must be in (0, 1), got {self.quantile}")
        if min(self.actions_per_rollout, self.action_latency_s, self.think_s, self.startup_s) < 0:
            raise PlanError("actions, latencies and start-up time must be >= 0")


@dataclass(frozen=True, kw_only=True)
class SandboxPlan:
    attempts_per_rollout: float  # 1 / (1 - failure_rate)
    hold_s: float  # mean sandbox-seconds per attempt, start-up included
    mean_in_use: float  # Little's law: L = attempt rate x hold time
    pool_size: int  # q-quantile of Poisson(L)
    blocking: float  # Erlang-B chance a new rollout finds all `pool_size` sandboxes taken
    rollout_latency_s: float  # a successful rollout, start-up included (prewarmed pools hide it)
    sandbox_s_per_rollout: float  # sandbox-seconds billed per successful rollout


def poisson_quantile(mean: float, q: float) -> int:
    """Smallest n with P[Poisson(mean) <= n] >= q, summed in log space so large means do not underflow."""
    if mean <= 0:
        return 0
    start = max(0, int(mean - 12 * math.sqrt(mean) - 12))  # mass below this is < 1e-30
    cdf, n = 0.0, start
    while True:
        cdf += math.exp(n * math.log(mean) - mean - math.lgamma(n + 1))
        if cdf >= q:
            return n
        n += 1


def erlang_b(servers: int, load: float) -> float:
    """Blocking probability of an M/G/N/N loss system with offered load `load` (Erlangs)."""
    b = 1.0
    for n in range(1, servers + 1):
        b = load * b / (n + load * b)
    return b


def plan_sandboxes(cfg: SandboxConfig) -> SandboxPlan:
    cfg.validate()
    session = cfg.actions_per_rollout * (cfg.action_latency_s + cfg.think_s)
    attempts = 1.0 / (1.0 - cfg.failure_rate)
    hold = cfg.startup_s + session * (1.0 - cfg.failure_rate / 2.0)
    load = cfg.rollouts_per_s * attempts * hold
    pool = poisson_quantile(load, cfg.quantile)
    return SandboxPlan(attempts_per_rollout=attempts, hold_s=hold, mean_in_use=load, pool_size=pool,
                       blocking=erlang_b(pool, load), rollout_latency_s=cfg.startup_s + session,
                       sandbox_s_per_rollout=attempts * hold)
