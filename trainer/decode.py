"""Continuous-batching decoder with in-flight weight updates.

A fixed number of slots decode together, one token per step. A finished
sequence frees its slot at once and a new prompt can take it on the next step,
so a long response never holds the others back (the straggler effect hits only
a loop that waits for whole batches).

Weights may change between two steps (the sampler applies a new wsync version
there). Each token records the version and the logprob it was sampled with, so
one sequence can carry tokens of two versions. What happens to the KV cache of
the sequences in flight is a setting: ``keep`` reuses keys/values computed by
the old weights (cheap; the trainer's importance weights absorb the mismatch),
``recompute`` re-prefills every sequence in flight with the new weights.

Cache layout: per layer, keys/values ``[slots, kv_heads, L, head_dim]``, one
row per slot, left-padded so all rows share the column count L; ``valid[s, c]``
marks real tokens. Positions come from each row's own token count, so a row's
padding never shifts its rotary phases.
"""
from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, field

from .policy import sampling_logprobs
from .task import Vocab


@dataclass(kw_only=True)
class DecodeConfig:
    slots: int = 32  # sequences decoded together
    # freed slots are refilled once this fraction of them is free (or none is busy). Each refill costs a prefill
    # forward of its own, which on a small model is mostly fixed per-call cost, so fewer, larger ones pay off
    refill_at: float = 0.25
    temperature: float = 1.0  # sampling temperature; logprobs are recorded after it
    top_p: float = 1.0  # nucleus mass; logprobs are those of the renormalised nucleus
    kv_cache: str = "keep"  # keep | recompute: the in-flight sequences' KV cache after a weight update

    def __post_init__(self):
        if self.kv_cache not in ("keep", "recompute"):
            raise ValueError(f"kv_cache must be 'keep' or 'recompute', got {self.kv_cache!r}")
        if self.slots < 1:
            raise ValueError(f"slots must be >= 1, got {self.slots}")
        if not 0.0 <= self.refill_at <= 1.0:
            raise ValueError(f"refill_at must be within [0, 1], got {self.refill_at}")


@dataclass(kw_only=True)
class Sequence:
    prompt: list  # token ids, ending in SEP
    limit: int  # most response tokens allowed
    tag: dict = field(default_factory=dict)  # caller's bookkeeping (group id, digits), carried through
    response: list = field(default_factory=list)  # sampled token ids
    versions: list = field(default_factory=list)  # policy version each response token was sampled with
    logprobs: list = field(default_factory=list)  # its logprob under that version (after temperature/top-p)

    @property
    def done(self) -> bool:
        return len(self.response) >= self.limit or (self.response and self.response[-1] == Vocab.EOS)

    def fed(self) -> list:
        """Tokens whose keys/values belong in the cache: all but the last, which the next step feeds."""
        return (self.prompt + self.response)[:-1]

    def last(self) -> int:
        return (self.prompt + self.response)[-1]


@functools.lru_cache(maxsize=None)
def _cache_name(model_type) -> str:
    """The keyword the model's forward takes its KV cache under, and the output field it comes back in.

    Newer transformers 5 releases call it `cache` and only warn on `past_key_values` until they drop it;
    earlier ones know only `past_key_values`. Read from the signature rather than a version number: a
    forward that lacks `cache` would swallow it into **kwargs and decode without any cache at all.
    """
    return "cache" if "cache" in inspect.signature(model_type.forward).parameters else "past_key_values"


class Decoder:
    """Decodes up to ``cfg.slots`` sequences at a time on ``model``, whose weights may change between steps."""

    def __init__(self, model, cfg: DecodeConfig, seed: int = 0):
        import torch

        self.model, self.cfg = model, cfg
        self.rows: list[Sequence | None] = [None] * cfg.slots
        self.gen = torch.Generator().manual_seed(seed)
        self.kv = None  # list of (keys, values) per layer, or None when nothing is cached yet
        self.valid = torch.zeros((cfg.slots, 0), dtype=torch.bool)
        self.fresh: set[int] = set()  # rows whose prompt is not in the cache yet
        self.steps = 0

    @property
    def free(self) -> int:
        return sum(r is None for r in self.rows)

    @property
    def active(self) -> int:
        return self.cfg.slots - self.free

    @property
    def refilling(self) -> bool:
        """Whether to admit new sequences now: enough slots are free to share one prefill (see refill_at),
        nothing is running, or a refill has begun (it goes on until the slots are full)."""
        return not self.active or bool(self.fresh) or self.free >= self.cfg.refill_at * self.cfg.slots

    def add(self, seq: Sequence) -> None:
        i = self.rows.index(None)  # ValueError when full: callers check `free` first
        self.rows[i] = seq
        self.fresh.add(i)

    def weights_changed(self) -> None:
        """Called after new weights were written into the model in place."""
        if self.cfg.kv_cache == "recompute":
            self.fresh.update(i for i, r in enumerate(self.rows) if r is not None)

    def step(self, version: int) -> list[Sequence]:
        """Sample one token for every active sequence; return those that finished (their slots are free again)."""
        import torch

        if not self.active:
            return []
        with torch.no_grad():
            if self.fresh:
                self._prefill(sorted(self.fresh))
            logits = self._decode()
            logp = sampling_logprobs(logits, self.cfg.temperature, self.cfg.top_p)
            tokens = torch.multinomial(logp.exp(), 1, generator=self.gen).squeeze(-1)
            chosen = logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
        done = []
        for i, seq in enumerate(self.rows):
            if seq is None:
                continue
            seq.response.append(int(tokens[i]))
            seq.versions.append(version)
            seq.logprobs.append(float(chosen[i]))
            if seq.done:
                done.append(seq)
                self.rows[i] = None
        self.steps += 1
        self._trim()
        return done

    def _prefill(self, rows: list[int]) -> None:
        """Compute the cache of `rows` from scratch with the current weights and write it into their slots.

        The forward is only as wide as the longest of these rows (a new short
        prompt does not pay for the cache's width); the result goes into the
        rightmost columns, the rest of each such row is masked.
        """
        import torch
        from transformers.cache_utils import DynamicCache

        width = max(len(self.rows[i].fed()) for i in rows)
        self._widen(width)
        left = self.valid.shape[1] - width  # columns of the cache to the left of these rows' tokens
        ids = torch.full((len(rows), width), Vocab.PAD, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.bool)
        for j, i in enumerate(rows):
            fed = self.rows[i].fed()
            ids[j, width - len(fed):] = torch.tensor(fed, dtype=torch.long)
            mask[j, width - len(fed):] = True
        name = _cache_name(type(self.model))
        out = self.model(input_ids=ids, attention_mask=mask.long(), position_ids=positions(mask),
                         use_cache=True, **{name: DynamicCache()})
        idx = torch.tensor(rows)
        new = [(layer.keys, layer.values) for layer in getattr(out, name).layers]
        if self.kv is None:
            self.kv = [(k.new_zeros((self.cfg.slots, *k.shape[1:])), v.new_zeros((self.cfg.slots, *v.shape[1:])))
                       for k, v in new]
        for (k, v), (nk, nv) in zip(self.kv, new):
            keep = mask[:, None, :, None]  # padding keys/values are zeroed: masked, but never NaN
            k[idx, :, :left], v[idx, :, :left] = 0.0, 0.0
            k[idx, :, left:] = torch.where(keep, nk, 0.0)
            v[idx, :, left:] = torch.where(keep, nv, 0.0)
        self.valid[idx] = False
        self.valid[idx, left:] = mask
        self.fresh.clear()

    def _decode(self):
        """One forward of every row's last token against the cache; returns next-token logits [slots, V]."""
        import torch
        from transformers.cache_utils import DynamicCache

        last = torch.tensor([Vocab.PAD if r is None else r.last() for r in self.rows], dtype=torch.long)
        # an idle row feeds PAD as a real token so that no query row is fully masked; its output is ignored
        valid = torch.cat([self.valid, torch.ones((self.cfg.slots, 1), dtype=torch.bool)], dim=1)
        pos = self.valid.sum(dim=1, keepdim=True)
        name = _cache_name(type(self.model))
        out = self.model(input_ids=last[:, None], attention_mask=valid.long(), position_ids=pos,
                         use_cache=True, **{name: DynamicCache(ddp_cache_data=self.kv)})
        self.kv = [(layer.keys, layer.values) for layer in getattr(out, name).layers]
        self.valid = valid
        return out.logits[:, -1, :]

    def _widen(self, width: int) -> None:
        """Left-pad the cache with masked columns up to `width` columns."""
        import torch

        extra = width - self.valid.shape[1]
        if extra <= 0:
            return
        self.valid = torch.cat([torch.zeros((self.cfg.slots, extra), dtype=torch.bool), self.valid], dim=1)
        if self.kv is not None:
            pad = lambda t: torch.cat([t.new_zeros((*t.shape[:2], extra, t.shape[3])), t], dim=2)  # noqa: E731
            self.kv = [(pad(k), pad(v)) for k, v in self.kv]

    def _trim(self) -> None:
        """Drop leading columns no active row uses (free rows' leftovers included), so L tracks the longest row."""
        busy = [i for i, r in enumerate(self.rows) if r is not None and i not in self.fresh]
        if not busy:
            self.kv, self.valid = None, self.valid[:, :0]
            return
        used = self.valid[busy].any(dim=0)
        first = int(used.nonzero()[0]) if used.any() else self.valid.shape[1]
        if first:
            self.valid = self.valid[:, first:]
            self.kv = [(k[:, :, first:], v[:, :, first:]) for k, v in self.kv]


def positions(mask):
    """Each real token's index within its own row (padding gets 0; it is masked anyway)."""
    return (mask.long().cumsum(dim=1) - 1).clamp(min=0)
