"""The policy: a tiny Qwen3-architecture transformers model, randomly initialised.

Nothing is downloaded: the architecture comes from a ``Qwen3Config`` and the
vocabulary from ``task.Vocab``. The same code path (a transformers causal LM,
its ``state_dict`` published through wsync) is what a real run uses with a
real checkpoint.

Sampler and trainer score tokens with one function, ``token_logprobs``, so the
logprob a token was sampled with (after temperature and top-p) and the one the
trainer computes for the same weights agree to float rounding.
"""
from __future__ import annotations

from dataclasses import dataclass

from .task import Vocab


@dataclass(kw_only=True)
class PolicyConfig:
    layers: int = 2  # transformer blocks
    hidden: int = 64  # model width
    heads: int = 4  # query heads
    kv_heads: int = 2  # key/value heads (grouped-query attention, as in Qwen3)
    head_dim: int = 16  # per-head width
    mlp: int = 256  # SwiGLU inner width
    max_positions: int = 128  # longest sequence (prompt + response) the rotary table covers
    seed: int = 0  # random init; the trainer's weights are the truth, samplers get theirs through wsync


def build(cfg: PolicyConfig):
    """A fresh fp32 Qwen3ForCausalLM; fp32 so the trainer's fp32 weights reach samplers exactly."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    conf = Qwen3Config(
        vocab_size=Vocab.SIZE, hidden_size=cfg.hidden, intermediate_size=cfg.mlp, num_hidden_layers=cfg.layers,
        num_attention_heads=cfg.heads, num_key_value_heads=cfg.kv_heads, head_dim=cfg.head_dim,
        max_position_embeddings=cfg.max_positions, tie_word_embeddings=True,
        bos_token_id=Vocab.BOS, eos_token_id=Vocab.EOS, pad_token_id=Vocab.PAD,
    )
    # sdpa and eager differ in rounding; one implementation on both sides keeps logprobs comparable
    conf._attn_implementation = "sdpa"
    torch.manual_seed(cfg.seed)
    model = Qwen3ForCausalLM(conf).float()
    model.eval()  # no dropout in Qwen3, but be explicit: sampling and scoring are deterministic functions
    return model


def token_logprobs(logits, tokens, temperature: float = 1.0, top_p: float = 1.0):
    """log p(token) under softmax(logits / temperature) restricted to the top-p nucleus.

    logits: [..., V] float; tokens: [...] long. Returns [...] float.
    """
    import torch

    return torch.gather(sampling_logprobs(logits, temperature, top_p), -1, tokens.unsqueeze(-1)).squeeze(-1)


def sampling_logprobs(logits, temperature: float = 1.0, top_p: float = 1.0):
    """The full log-distribution tokens are drawn from: tempered, nucleus-truncated, renormalised."""
    import torch

    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 (use a small value for near-greedy), got {temperature}")
    z = logits.float() / temperature
    if top_p < 1.0:
        z = z.masked_fill(~nucleus(z, top_p), torch.finfo(z.dtype).min / 2)
    return torch.log_softmax(z, dim=-1)


def nucleus(z, top_p: float):
    """Mask of the smallest set of most likely tokens whose mass reaches top_p (ties kept by sort order)."""
    import torch

    probs, order = torch.softmax(z, dim=-1).sort(dim=-1, descending=True)
    before = probs.cumsum(dim=-1) - probs  # mass strictly above each token
    keep_sorted = before < top_p  # the most likely token always stays (before == 0)
    return torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)


def score(model, prompts: list[list[int]], responses: list[list[int]], temperature: float = 1.0, top_p: float = 1.0):
    """Per-token logprobs of each response given its prompt, with gradients.

    Sequences are right-padded into one [B, T] batch. Returns (logprobs [B, R],
    mask [B, R]) where R is the longest response and mask marks real tokens.
    """
    import torch

    seqs = [p + r for p, r in zip(prompts, responses)]
    T = max(len(s) for s in seqs)
    R = max(len(r) for r in responses)
    ids = torch.full((len(seqs), T), Vocab.PAD, dtype=torch.long)
    attn = torch.zeros((len(seqs), T), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
        attn[i, : len(s)] = 1
    logits = model(input_ids=ids, attention_mask=attn).logits  # [B, T, V]
    # response token j of row i sits at position P_i + j and is predicted by the logits at P_i + j - 1
    pos = torch.zeros((len(seqs), R), dtype=torch.long)
    mask = torch.zeros((len(seqs), R), dtype=torch.bool)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        pos[i, : len(r)] = torch.arange(len(p) - 1, len(p) - 1 + len(r))
        mask[i, : len(r)] = True
    picked = torch.gather(logits, 1, pos.unsqueeze(-1).expand(-1, -1, logits.shape[-1]))  # [B, R, V]
    tokens = torch.gather(ids, 1, (pos + 1).clamp(max=T - 1))
    return token_logprobs(picked, tokens, temperature, top_p), mask


def state_digest(model) -> str:
    """xxh3-128 over every parameter and buffer's bytes in name order: equal digest = bit-identical weights."""
    import torch
    import xxhash

    h = xxhash.xxh3_128()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
