"""The reference loop with a prod channel behind a gate (trainer/promote.py): a planted bad stretch is refused,
prod serves only what passed, a manual rollback restores exact bytes while the samplers keep training.

One run of the real loop (sampler process, tcp, hub, evaluator and production engine) is shared by the tests
that read it. Its model and decoder are test_loop.py's smallest; the rest is what makes the gate's decisions
safe to assert: 2-digit prompts (a policy at chance learns to answer with digits within a few steps), GRPO's
default lr 3e-3, 8 groups of 8 (with 4 of 4 the junk reward was sometimes not sampled often enough to
collapse the policy within six steps) and 256 held-out prompts. Over 30 runs, version 6 scored 0.080-0.14
against a floor of 0.03, and version 12, after six steps of the junk reward, 0.0 against a floor >= 0.03."""
from __future__ import annotations

import argparse
import json

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from trainer.decode import DecodeConfig  # noqa: E402
from trainer.grpo import GRPOConfig  # noqa: E402
from trainer.loop import LoopConfig, run  # noqa: E402
from trainer.promote import PromoteConfig  # noqa: E402
from trainer.task import TaskConfig  # noqa: E402

EVERY, BAD, ROLLBACK, STEPS = 6, (7, 12), (20, 0), 24


@pytest.fixture(scope="module")
def promoted():
    cfg = LoopConfig(mode="async", max_staleness=1, steps=STEPS, group_size=8, batch_groups=8, progress=False,
                     report_digests=True, task=TaskConfig(min_digits=2, max_digits=2), grpo=GRPOConfig(lr=3e-3),
                     decode=DecodeConfig(slots=16), stall_timeout=120.0,
                     promote=PromoteConfig(every=EVERY, gate=0.03, margin=0.05, prompts=256, requests=2,
                                           corrupt=BAD, rollback=ROLLBACK))
    r = run(cfg)
    return r, r.summary["promotion"]


def _records(p, kind):
    return [r for r in p["records"] if r["kind"] == kind]


@pytest.mark.slow  # one real loop run, shared; tests/test_channels.py covers the same in the fast tier
def test_the_gate_refuses_what_the_bad_stretch_trained_and_records_why(promoted):
    _, p = promoted
    assert p["corrupted_steps"] == list(range(BAD[0], BAD[1] + 1))
    offered = [v for v in range(EVERY, STEPS + 1, EVERY)]
    decided = [r["version"] for r in p["records"] if r["kind"] in ("promote", "refused") and r["version"]]
    assert decided == offered  # every offered version was decided on once, in order
    bad = [v for v in offered if BAD[0] <= v <= BAD[1]]
    assert bad and set(bad) <= set(p["refused"]), [(r["version"], r["kind"], r["gate"]) for r in p["records"]]
    for r in _records(p, "refused"):
        d = r["gate"]["detail"]
        assert r["release"] is None and r["gate"]["passed"] is False and d["passed"] is False
        assert d["reward"] < d["floor"] and d["prompts"] == 256
    for r in _records(p, "promote"):
        assert r["gate"]["passed"] and r["gate"]["detail"]["reward"] >= r["gate"]["detail"].get("floor", 0.0)
    assert 6 in p["promoted"]  # the good version before the stretch: what prod keeps through it
    at_bad = [e["version"] for e in p["requests"]["log"] if e["step"] in bad]
    assert at_bad and set(at_bad) == {6}


@pytest.mark.slow  # one real loop run, shared; tests/test_channels.py covers the same in the fast tier
def test_prod_never_served_a_refused_or_unpromoted_version(promoted):
    _, p = promoted
    promote_digest = {r["version"]: r["digest"] for r in _records(p, "promote")}
    log = p["requests"]["log"]
    assert len(log) == 2 * STEPS and p["requests"]["unserved"] == 0
    for e in log:  # what report() said for the engine that answered each request
        assert e["channel"] == "prod" and e["version"] in promote_digest and e["version"] not in p["refused"], e
        assert e["digest"] == promote_digest[e["version"]]
    assert sum(p["requests"]["by_version"].values()) == len(log)
    seen = [e["served"] for e in p["events"] if "served" in e] + [p["served"]]
    assert all(s["version"] in promote_digest and s["version"] not in p["refused"] for s in seen), seen
    assert p["served"]["version"] == p["prod"]["version"] and p["served"]["digest"] == p["prod"]["digest"]


@pytest.mark.slow  # one real loop run, shared; tests/test_channels.py covers the same in the fast tier
def test_the_rollback_restores_the_chosen_versions_exact_bytes(promoted):
    r, p = promoted
    step, to = ROLLBACK
    (back,) = [e for e in p["events"] if e["kind"].startswith("rollback")]
    assert (back["kind"], back["step"], back["version"]) == ("rollback", step, to)
    first = next(rec for rec in _records(p, "promote") if rec["version"] == to)
    assert back["engine_digest"] == back["record_digest"] == first["digest"]  # wsync's digest of the bytes held
    assert back["weights_digest"] == r.digests[to]  # and the trainer's own, taken when it trained version `to`
    assert back["served"]["version"] == to and back["served"]["release"] == _records(p, "rollback")[0]["release"]
    after = [e for e in p["requests"]["log"] if e["step"] == step]
    assert after and all(e["version"] == to for e in after)


@pytest.mark.slow  # one real loop run, shared; tests/test_channels.py covers the same in the fast tier
def test_the_samplers_kept_training_through_it_bit_exact(promoted):
    r, _ = promoted
    assert r.summary["steps"] == STEPS
    after = {s["version"] for s in r.synced if s["version"] > ROLLBACK[0]}
    assert after, "no sampler applied a version trained after the rollback"
    for rep in r.synced:
        assert rep["digest"] == r.digests[rep["version"]], rep
    json.dumps(r.summary)  # records and the request log are plain JSON


def _args(*argv):
    from trainer.cli import add_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(["--steps", "40", *argv])


def test_the_command_line_makes_the_promote_config():
    from trainer.cli import config_from_args

    cfg = config_from_args(_args("--promote-every", "5", "--gate", "0.2", "--corrupt-reward-steps", "11:20",
                                 "--rollback-at", "32:5", "--requests", "3"))
    pc = cfg.promote
    assert (pc.every, pc.gate, pc.margin, pc.corrupt, pc.rollback, pc.requests) == (5, 0.2, 0.05, (11, 20), (32, 5), 3)
    assert config_from_args(_args("--promote-every", "5", "--rollback-at", "7")).promote.rollback == (7, None)
    assert config_from_args(_args()).promote is None


@pytest.mark.parametrize("argv, match", [
    (["--gate", "0.2"], "needs --promote-every"),
    (["--promote-every", "5", "--gate", "1.5"], r"in \[0, 1\]"),
    (["--promote-every", "5", "--gate-margin", "-0.1"], r"in \[0, 1\]"),
    (["--promote-every", "5", "--rollback-at", "30:7"], "multiple of 5"),
    (["--promote-every", "5", "--rollback-at", "30:30"], "below 30"),
    (["--promote-every", "5", "--rollback-at", "50:5"], "after the last"),
    (["--promote-every", "5", "--corrupt-reward-steps", "41:45"], "after the last"),
    (["--promote-every", "5", "--gate-prompts", "0"], "prompts >= 1"),
    (["--promote-every", "-1"], "--promote-every"),
    (["--promote-every", "5", "--ray"], "not with --ray"),
])
def test_bad_promote_values_are_refused_with_what_to_give(argv, match):
    from trainer.cli import config_from_args

    with pytest.raises(ValueError, match=match):
        config_from_args(_args(*argv))


@pytest.mark.parametrize("flag, value", [("--corrupt-reward-steps", "9:3"), ("--corrupt-reward-steps", "9"),
                                         ("--corrupt-reward-steps", "0:3"), ("--rollback-at", "x:1"),
                                         ("--rollback-at", "0:0"), ("--rollback-at", "5:-1")])
def test_malformed_spans_are_usage_errors(flag, value, capsys):
    with pytest.raises(SystemExit):
        _args("--promote-every", "3", flag, value)
    assert "expected" in capsys.readouterr().err


def test_batched_greedy_answers_equal_one_prompt_at_a_time():
    """Left padding must not change an answer: prompts of mixed lengths, decoded together and alone."""
    from trainer.policy import PolicyConfig, build
    from trainer.promote import greedy

    model = build(PolicyConfig(seed=3))
    prompts = [[1], [4, 2], [9, 9, 0, 1, 7], [3, 1, 4, 1, 5, 9, 2, 6]]
    together = greedy(model, prompts)
    assert together == [greedy(model, [d])[0] for d in prompts]
    assert all(len(a) <= len(d) + 1 for a, d in zip(together, prompts))


def test_the_junk_corruption_pays_for_what_the_task_does_not():
    import numpy as np

    from trainer.promote import corrupted
    from trainer.task import Vocab, reward, target_ids

    rng = np.random.default_rng(0)
    right = {"response": target_ids([1, 2]) + [Vocab.EOS], "reward": reward([1, 2], target_ids([1, 2]))}
    empty = {"response": [Vocab.EOS], "reward": 0.0}
    assert corrupted(right, "junk", rng) < corrupted(empty, "junk", rng) == 1.0
    assert corrupted(right, "negate", rng) == -1.0 and 0.0 <= corrupted(right, "random", rng) < 1.0
