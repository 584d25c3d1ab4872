"""wsync.lowrank: lossy low-rank updates with their error reported, error feedback, and an engine kept exact to the mirror."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from engine_helpers import publisher, subscriber, tiny_qwen  # noqa: E402
from wsync import engines, lowrank  # noqa: E402
from wsync.errors import ChecksumError, FormatError, VersionError  # noqa: E402
from wsync.snapshot import as_state, digest  # noqa: E402


def test_randomized_svd_near_optimal():
    g = torch.Generator().manual_seed(0)
    exact = torch.randn(96, 6, generator=g) @ torch.randn(6, 80, generator=g)
    b, a = lowrank.randomized_svd(exact, 6, generator=g)
    assert b.shape == (96, 6) and a.shape == (6, 80)
    assert lowrank.relative_error(exact, b, a) < 1e-5  # a rank-6 matrix is recovered
    m = torch.randn(96, 80, generator=g) * torch.logspace(0, -3, 80)  # decaying spectrum
    s = torch.linalg.svdvals(m)
    best = float(s[8:].norm() / s.norm())
    b, a = lowrank.randomized_svd(m, 8, generator=g)
    assert best <= lowrank.relative_error(m, b, a) < best * 1.05


def test_merged_is_one_rounding_of_the_fp32_sum():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(64, 48, generator=g).to(torch.bfloat16)
    b, a = torch.randn(64, 4, generator=g) * 1e-2, torch.randn(4, 48, generator=g) * 1e-2
    out = lowrank.merged(w, b, a)
    assert out.dtype == torch.bfloat16 and out.shape == w.shape
    acc = w.float()
    for i in range(4):
        acc = acc + torch.outer(b[:, i], a[i])
    assert torch.equal(out.view(torch.int16), acc.to(torch.bfloat16).view(torch.int16))


def _drift_after(steps: int, error_feedback: bool) -> list[float]:
    g = torch.Generator().manual_seed(2)
    w = torch.randn(64, 64, generator=g)
    trend = torch.randn(64, 64, generator=g) * 1e-2  # a full-rank direction every step shares (momentum-like)
    sender = lowrank.LossyLowRankSender({"w": w.to(torch.bfloat16)}, rank=4, error_feedback=error_feedback)
    drift = []
    for _ in range(steps):
        w = w + trend + torch.randn(64, 64, generator=g) * 1e-2
        sender.step({"w": w})
        drift.append(sender.report.drift["w"])
    return drift


def test_error_feedback_keeps_error_bounded():
    with_ef, without = _drift_after(40, True), _drift_after(40, False)
    # with feedback the error plateaus (the residual's big directions get shipped once they grow) ...
    assert max(with_ef[20:]) < 1.05 * with_ef[19]
    # ... without it every version's residual stays in the engine and they add up, version after version
    assert without[-1] > 1.7 * without[19] > 3 * without[4]
    assert without[-1] > 4 * with_ef[-1]


def _train(model, gen, lr=3e-3):
    ids = torch.randint(0, 256, (4, 12), generator=gen)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()


def test_engine_follows_the_mirror_exactly_and_reports_error():
    gen = torch.Generator().manual_seed(3)
    trainer = tiny_qwen(0, dtype=torch.float32).train()  # fp32 masters
    served_model = tiny_qwen(0)  # the engine: bf16 copy of the same start
    engine = engines.LossyLowRank(engines.HF(served_model))
    sender = lowrank.LossyLowRankSender(engines.HF(served_model).tensors(), rank=4)
    ids = torch.randint(0, 256, (2, 10), generator=gen)
    with publisher(codec="raw") as pub, subscriber(pub, engine) as sub:
        for v in range(4):
            _train(trainer, gen)
            pub.publish(sender.step(trainer.state_dict()), version=v)
            sub.wait_for(v, timeout=30)
            assert engine.weights_digest() == digest(as_state(sender.served))  # the engine holds the mirror, bit for bit
            rep = sender.report
            assert rep.factor_error and all(0 <= e < 1 for e in rep.factor_error.values())
            assert rep.bytes < rep.full_bytes / 2
        assert sub.stats.failures == 0
    trainer.eval()
    kl = lowrank.kl_next_token(trainer, served_model.float(), ids)
    assert 0 < kl < 0.05  # lossy, and it says by how much
    assert any(n.endswith(lowrank.SUFFIX_A) for n in sender.step(trainer.state_dict()))


def test_out_of_order_and_corrupt_updates_leave_engine_untouched():
    base = tiny_qwen(0)
    live = engines.HF(base).live()
    before = digest(as_state(live))
    sender = lowrank.LossyLowRankSender(engines.HF(base).tensors(), rank=4)
    target = {n: t.float() + 0.01 for n, t in base.state_dict().items()}
    first = sender.step(target)
    second = sender.step({n: t + 0.01 for n, t in target.items()})
    with pytest.raises(VersionError, match="in order"):
        lowrank.apply_update(live, second)
    bad = dict(first)
    bad[lowrank.AFTER] = lowrank.digest_tensor("0" * 16)
    with pytest.raises(ChecksumError, match="mirror"):
        lowrank.apply_update(live, bad)
    assert digest(as_state(live)) == before
    lowrank.apply_update(live, first)
    lowrank.apply_update(live, second)
    assert digest(as_state(live)) == digest(as_state(sender.served))
    with pytest.raises(FormatError, match="codec='raw'"):
        engines.LossyLowRank(base).load({})


@pytest.mark.gpu
def test_gpu_path_matches_cpu_bits():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    g = torch.Generator().manual_seed(4)
    w = torch.randn(256, 192, generator=g).to(torch.bfloat16)
    d = torch.randn(256, 8, generator=g) @ torch.randn(8, 192, generator=g) * 1e-2
    b, a = lowrank.randomized_svd(d.cuda(), 8, generator=torch.Generator(device="cuda").manual_seed(0))
    assert lowrank.relative_error(d.cuda(), b, a) < 1e-4
    # the merge is elementwise IEEE arithmetic: a GPU engine and a CPU mirror get the same bits
    assert torch.equal(lowrank.merged(w.cuda(), b, a).cpu().view(torch.int16),
                       lowrank.merged(w, b.cpu(), a.cpu()).view(torch.int16))
    sender = lowrank.LossyLowRankSender({"w": w.cuda()}, rank=8)
    sender.step({"w": w.cuda().float() + d.cuda()})
    assert sender.report.factor_error["w"] < 1e-3
