"""The reference loop's parts, in one process: task, policy scoring, continuous-batching decode, GRPO loss."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from trainer.decode import DecodeConfig, Decoder, Sequence  # noqa: E402
from trainer.grpo import GRPOConfig, Learner, advantages, surrogate  # noqa: E402
from trainer.policy import PolicyConfig, build, score, state_digest  # noqa: E402
from trainer.task import TaskConfig, Vocab, prompt_ids, response_limit, reward, sample_digits, target_ids  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model():
    return build(PolicyConfig(seed=3))


def _decode_all(model, digit_lists, cfg: DecodeConfig, seed=0, on_step=None):
    """Decode every prompt with continuous batching; on_step(step, decoder) may change weights between steps."""
    dec = Decoder(model, cfg, seed=seed)
    todo = [dict(digits=d, i=i) for i, d in enumerate(digit_lists)]
    out, version = [], 0
    while todo or dec.active:
        while todo and dec.free and dec.refilling:
            t = todo.pop(0)
            dec.add(Sequence(prompt=prompt_ids(t["digits"]), limit=response_limit(t["digits"]), tag=t))
        if on_step is not None:
            version = on_step(dec.steps, dec, version)
        out += dec.step(version)
    return sorted(out, key=lambda s: s.tag["i"]), dec


def _behaviour(seqs, like):
    b = torch.zeros_like(like)
    for i, s in enumerate(seqs):
        b[i, : len(s.logprobs)] = torch.tensor(s.logprobs)
    return b


# -- task -------------------------------------------------------------------------------------


def test_reward_is_fraction_of_positions_right():
    d = [1, 2, 3, 4]
    assert reward(d, target_ids(d) + [Vocab.EOS]) == 1.0
    assert reward(d, Vocab.encode_digits([4, 3, 0, 0]) + [Vocab.EOS]) == 0.5
    assert reward(d, [Vocab.EOS] + target_ids(d)) == 0.0  # nothing counts after EOS
    assert reward(d, Vocab.encode_digits([4])) == 0.25  # a short answer loses the missing positions


def test_long_tail_lengths():
    rng = np.random.default_rng(0)
    fixed = [len(sample_digits(TaskConfig(min_digits=5, max_digits=5), rng)) for _ in range(200)]
    assert set(fixed) == {5}
    cfg = TaskConfig(min_digits=3, max_digits=24, tail_prob=0.2)
    n = np.array([len(sample_digits(cfg, rng)) for _ in range(4000)])
    assert n.min() == 3 and n.max() <= 24
    assert 0.12 < (n > 3).mean() < 0.28  # the tail is drawn with probability tail_prob
    assert (n >= 12).sum() > 20  # and it is long: some prompts need 4x the decode steps
    with pytest.raises(ValueError, match="min_digits"):
        TaskConfig(min_digits=5, max_digits=4)


# -- policy and decode ----------------------------------------------------------------------------


@pytest.mark.parametrize("kv_cache,refill_at", [("keep", 0.0), ("recompute", 0.0), ("keep", 0.5)])
@pytest.mark.parametrize("top_p", [1.0, 0.8])
def test_behaviour_logprobs_match_trainer_scoring(model, kv_cache, refill_at, top_p):
    """Zero staleness: the logprob a token was sampled with equals the trainer's, after temperature/top-p.

    Refills put short prompts into a cache made wide by long rows (their prefill is only as wide as they are)."""
    rng = np.random.default_rng(1)
    digits = [sample_digits(TaskConfig(min_digits=2, max_digits=9, tail_prob=0.5), rng) for _ in range(24)]
    cfg = DecodeConfig(slots=8, kv_cache=kv_cache, top_p=top_p, temperature=0.9, refill_at=refill_at)
    seqs, _ = _decode_all(model, digits, cfg)
    with torch.no_grad():
        lp, mask = score(model, [s.prompt for s in seqs], [s.response for s in seqs], 0.9, top_p)
    diff = (lp - _behaviour(seqs, lp))[mask].abs().max().item()
    assert diff < 1e-4, diff
    assert all(len(s.response) <= s.limit for s in seqs)
    assert all(s.versions == [0] * len(s.response) for s in seqs)


def test_continuous_batching_refills_slots_and_bounds_the_cache(model):
    rng = np.random.default_rng(2)
    digits = [sample_digits(TaskConfig(min_digits=2, max_digits=12, tail_prob=0.3), rng) for _ in range(40)]
    widths = []
    seqs, dec = _decode_all(model, digits, DecodeConfig(slots=6),
                            on_step=lambda step, d, v: widths.append(d.valid.shape[1]) or v)
    assert len(seqs) == 40 and dec.free == 6 and dec.kv is None
    longest = max(len(prompt_ids(d)) + response_limit(d) for d in digits)
    assert max(widths) <= longest  # trimming keeps the cache as wide as the longest row, not the whole run
    # fewer decode steps than running the 40 prompts in waves of 6, each as long as its longest member
    waves = sum(max(response_limit(d) for d in digits[i : i + 6]) for i in range(0, 40, 6))
    assert dec.steps < waves

    # refill_at=0.5: freed slots wait until three are free, then fill up in one prefill
    free_at_refill = []
    seqs, dec = _decode_all(model, digits, DecodeConfig(slots=6, refill_at=0.5),
                            on_step=lambda step, d, v: free_at_refill.append(len(d.fresh)) or v)
    assert len(seqs) == 40 and dec.free == 6
    refills = [n for n in free_at_refill[1:] if n]  # after the first; the last may be the few prompts left
    assert len(refills) > 3 and all(n >= 3 for n in refills[:-1])


def _perturb(model, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)  # in place, as the wsync HF engine writes


@pytest.mark.parametrize("kv_cache", ["keep", "recompute"])
def test_in_flight_update_versions_and_logprobs(kv_cache):
    """Weights change between decode steps: tokens carry the new version; with recompute their logprobs are exact."""
    model = build(PolicyConfig(seed=4))
    before = {k: v.clone() for k, v in model.state_dict().items()}

    def update(step, dec, version):
        if step == 3 and version == 0:
            _perturb(model, 1)
            dec.weights_changed()
            return 1
        return version

    digits = [[1, 2, 3, 4, 5, 6]] * 8 + [[7, 8]] * 8
    seqs, _ = _decode_all(model, digits, DecodeConfig(slots=8, kv_cache=kv_cache), on_step=update)
    assert all(s.versions == sorted(s.versions) for s in seqs)  # versions never decrease along a sequence
    spanning = [s for s in seqs if len(set(s.versions)) == 2]
    assert spanning, "the update landed mid-sequence, so some sequences must span two versions"
    old = build(PolicyConfig(seed=4))
    old.load_state_dict(before)
    # every token's recorded logprob is the one of the weights it was sampled with, given the cache policy
    with torch.no_grad():
        lp_new, mask = score(model, [s.prompt for s in seqs], [s.response for s in seqs])
        lp_old, _ = score(old, [s.prompt for s in seqs], [s.response for s in seqs])
    beh = _behaviour(seqs, lp_new)
    ver = torch.zeros_like(beh, dtype=torch.long)
    for i, s in enumerate(seqs):
        ver[i, : len(s.versions)] = torch.tensor(s.versions)
    at0 = mask & (ver == 0)
    assert (lp_old - beh)[at0].abs().max() < 1e-4
    at1 = mask & (ver == 1)
    err_new = (lp_new - beh)[at1].abs().max().item()
    if kv_cache == "recompute":
        assert err_new < 1e-4, err_new
    else:  # kept keys/values were computed by the old weights: the spanning sequences' logprobs differ
        assert err_new > 1e-3, err_new


# -- GRPO ---------------------------------------------------------------------------------------------


def test_group_normalised_advantages():
    a = advantages([0.0, 1.0, 0.5, 0.5, 0.2, 0.2, 0.2, 0.2], 4)
    g = a.reshape(2, 4)
    assert np.allclose(g[0].mean(), 0) and np.allclose(g[0].std(), 1, atol=1e-4)
    assert np.array_equal(g[1], np.zeros(4))  # one reward for all: no signal, not 0/0
    with pytest.raises(ValueError, match="groups of 3"):
        advantages([1, 2, 3, 4], 3)


def _grad(logp0, behaviour, adv, cfg):
    logp = torch.tensor(logp0, requires_grad=True)
    mask = torch.ones_like(logp, dtype=torch.bool)
    loss, stats = surrogate(logp, torch.tensor(behaviour), torch.tensor(adv), mask, cfg)
    loss.backward()
    return logp.grad, loss, stats


def test_surrogate_clips_and_truncates():
    cfg = GRPOConfig(clip_low=0.2, clip_high=0.2, is_cap=3.0)
    lr = np.log
    # rows: on-policy, A>0 beyond the clip, A<0 below the clip, A<0 beyond the cap C, A<0 between clip and C
    logp = [[0.0], [lr(1.5)], [lr(0.5)], [lr(5.0)], [lr(2.0)]]
    behaviour = [[0.0]] * 5
    adv = [1.0, 1.0, -1.0, -1.0, -1.0]
    g, loss, st = _grad(torch.tensor(logp, dtype=torch.float32).tolist(), behaviour, adv, cfg)
    g = g[:, 0]
    assert g[0] == pytest.approx(-1 / 5)  # plain policy gradient: -A * rho / N tokens
    assert g[1] == 0 and g[2] == 0 and g[3] == 0  # clipped, clipped, truncated at C: no push
    assert g[4] == pytest.approx(2.0 / 5, rel=1e-5)  # A<0 with rho in (1+eps, C): weight rho, not clipped
    # the truncated token contributes C*|A|, not rho*|A|
    expected = (-1.0 - 1.2 + 0.8 + 3.0 + 2.0) / 5
    assert float(loss.detach()) == pytest.approx(expected, rel=1e-5)
    assert st["clip_frac"] == pytest.approx(3 / 5)
    assert st["ratio_max"] == pytest.approx(5.0, rel=1e-5)
    with pytest.raises(ValueError, match="is_cap"):
        GRPOConfig(is_cap=1.1, clip_high=0.2)


def test_learner_step_moves_towards_rewarded_tokens(model):
    """One GRPO step raises the logprob of the better response in a group and lowers the worse one."""
    m = build(PolicyConfig(seed=5))
    d = [1, 2, 3]
    good, bad = target_ids(d) + [Vocab.EOS], Vocab.encode_digits([9, 9, 9]) + [Vocab.EOS]
    with torch.no_grad():
        lp, _ = score(m, [prompt_ids(d)] * 2, [good, bad])
    samples = [{"prompt": prompt_ids(d), "response": r, "logprobs": lp[i].tolist(), "reward": reward(d, r)}
               for i, r in enumerate([good, bad])]
    digest = state_digest(m)
    stats = Learner(m, GRPOConfig(lr=1e-2)).step([samples])
    assert state_digest(m) != digest
    assert stats["ratio_max"] == pytest.approx(1.0, abs=1e-5) and stats["clip_frac"] == 0.0
    with torch.no_grad():
        after, _ = score(m, [prompt_ids(d)] * 2, [good, bad])
    assert after[0].sum() > lp[0].sum() and after[1].sum() < lp[1].sum()
