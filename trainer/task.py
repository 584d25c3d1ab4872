"""The verifiable task the reference loop learns: reverse a string of digits.

It is small enough for a 2-layer policy to learn on 2 CPU cores in minutes, and
its reward is dense (the fraction of positions right), so GRPO gets a signal
from the very first random policy. The digit count can be drawn from a long
tail: a few prompts then need many more decode steps than the rest, which is
the straggler effect that leaves synchronous RL idle.

Token layout of one sequence (ids from ``Vocab``)::

    BOS d1 d2 ... dn SEP | dn ... d2 d1 EOS
    '---- prompt -------'  '--- response ---'
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


class Vocab:
    """Our own tiny tokenizer: four specials and the ten digits; nothing downloaded."""

    PAD, BOS, SEP, EOS = 0, 1, 2, 3
    DIGIT0 = 4
    SIZE = 16  # 14 used; rounded up so embedding rows stay aligned

    @classmethod
    def encode_digits(cls, digits) -> list[int]:
        return [cls.DIGIT0 + int(d) for d in digits]

    @classmethod
    def decode(cls, ids) -> str:
        names = {cls.PAD: "_", cls.BOS: "^", cls.SEP: "|", cls.EOS: "$"}
        return "".join(names.get(i, str(i - cls.DIGIT0) if 0 <= i - cls.DIGIT0 < 10 else "?") for i in ids)


@dataclass(kw_only=True)
class TaskConfig:
    min_digits: int = 4  # digit count of an ordinary prompt
    max_digits: int = 4  # cap of the long tail; equal to min_digits means every prompt has the same length
    tail_prob: float = 0.0  # probability that a prompt is drawn from the tail instead of min_digits
    tail_alpha: float = 1.2  # Pareto shape of the tail (smaller = heavier)

    def __post_init__(self):
        if not 1 <= self.min_digits <= self.max_digits:
            raise ValueError(f"need 1 <= min_digits <= max_digits, got {self.min_digits}, {self.max_digits}")
        if not 0.0 <= self.tail_prob <= 1.0:
            raise ValueError(f"tail_prob must lie in [0, 1], got {self.tail_prob}")

    @property
    def max_response(self) -> int:
        """Decode steps a response may take: the reversed digits plus EOS."""
        return self.max_digits + 1

    @property
    def max_sequence(self) -> int:
        return self.max_digits + 2 + self.max_response


def long_tail(min_digits: int, max_digits: int, tail_prob: float, alpha: float = 1.2) -> TaskConfig:
    """A TaskConfig whose response lengths have a long tail (the straggler setting)."""
    return TaskConfig(min_digits=min_digits, max_digits=max_digits, tail_prob=tail_prob, tail_alpha=alpha)


def sample_digits(cfg: TaskConfig, rng: np.random.Generator) -> list[int]:
    """One prompt's digits; with probability tail_prob its length comes from a Pareto tail."""
    n = cfg.min_digits
    if cfg.max_digits > cfg.min_digits and rng.random() < cfg.tail_prob:
        # Pareto(alpha) + 1 >= 1, scaled so the tail starts just above the ordinary length
        n = int(cfg.min_digits * (1.0 + rng.pareto(cfg.tail_alpha))) + 1
        n = min(n, cfg.max_digits)
    return [int(d) for d in rng.integers(0, 10, size=n)]


def prompt_ids(digits) -> list[int]:
    return [Vocab.BOS, *Vocab.encode_digits(digits), Vocab.SEP]


def target_ids(digits) -> list[int]:
    return Vocab.encode_digits(reversed(list(digits)))


def response_limit(digits) -> int:
    """Decode steps allowed for this prompt: one per digit plus the EOS."""
    return len(digits) + 1


def reward(digits, response) -> float:
    """Fraction of target positions the response got right (tokens after EOS are ignored).

    A missing EOS costs nothing beyond the digits it displaced: the response is
    capped at ``response_limit`` tokens by the sampler anyway.
    """
    target = target_ids(digits)
    got = list(response)
    if Vocab.EOS in got:
        got = got[: got.index(Vocab.EOS)]
    hits = sum(1 for t, g in zip(target, got) if t == g)
    return hits / len(target)
