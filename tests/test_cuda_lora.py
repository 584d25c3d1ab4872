"""The lowrank range finder kernel (csrc/ws_lora.cuh): Y = (W_new - W_old) @ Omega from two bf16 matrices.

Run on the CPU harness through the real launcher (_Launcher.lora_range), under
three schedules, against torch on CPU. The kernel sums in fp32 in a fixed
tree (each thread's columns in order, then 5 shuffle levels, then the 8
warps), torch in its own order; both are within the stated bound of the exact
(float64) product:

    |Y - Y_exact| <= (n / 256 + 16) * 2**-23 * (|D| @ |Omega|)   elementwise

(fp32 rounding error of a sum of n products, with the depth of the kernel's
tree). wsync.lowrank takes the kernel as its range finder for bf16 weights.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from wsync.backends import cuda

cudasim = pytest.importorskip("cudasim")

SCHEDULES = ("forward", "reverse", "random")
EPS32 = 2.0**-23


def bf16_pair(m: int, n: int, density: float, seed: int):
    """Old weights ~ N(0, 0.02) and new ones moved by an RL-sized step at `density` of the elements."""
    g = torch.Generator().manual_seed(seed)
    old = (torch.randn(m, n, generator=g) * 0.02).to(torch.bfloat16)
    step = torch.randn(m, n, generator=g) * 1e-3 * (torch.rand(m, n, generator=g) < density)
    new = (old.float() + step).to(torch.bfloat16)
    return new, old


def u16(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.int16).numpy().view(np.uint16)


def check_bound(y: np.ndarray, new, old, omega) -> None:
    d = new.double() - old.double()
    exact = (d @ omega.double()).numpy()
    bound = (d.shape[1] / 256 + 16) * EPS32 * (d.abs() @ omega.double().abs()).numpy()
    assert np.all(np.abs(y - exact) <= bound), float(np.max(np.abs(y - exact) - bound))


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("m,n,k,density", [(37, 1000, 24, 0.3), (5, 300, 1, 1.0), (9, 257, 40, 0.05),
                                            (3, 1, 33, 1.0), (4, 700, 24, 0.0)])
def test_range_matches_torch_within_the_bound(sim, schedule, m, n, k, density):
    launcher = cuda._Launcher(cudasim.SimRuntime(sim, schedule, seed=m))
    new, old = bf16_pair(m, n, density, seed=m * n + k)
    omega = torch.randn(n, k, generator=torch.Generator().manual_seed(k))
    y = launcher.lora_range(u16(new), u16(old), omega.numpy())
    assert y.shape == (m, k) and y.dtype == np.float32
    check_bound(y, new, old, omega)
    check_bound(((new.float() - old.float()) @ omega).numpy(), new, old, omega)  # torch meets it too
    if density == 0.0:
        assert not y.any()


def test_the_same_bits_under_every_schedule(sim):
    new, old = bf16_pair(16, 2000, 0.2, seed=1)
    omega = torch.randn(2000, 24, generator=torch.Generator().manual_seed(2)).numpy()
    ys = [cuda._Launcher(cudasim.SimRuntime(sim, s, seed=3)).lora_range(u16(new), u16(old), omega) for s in SCHEDULES]
    assert all(y.tobytes() == ys[0].tobytes() for y in ys)


def test_inf_and_nan_propagate_like_torch(sim):
    new, old = bf16_pair(4, 300, 0.5, seed=4)
    new[1, 7] = float("inf")
    new[2, 9] = float("nan")
    omega = torch.randn(300, 3, generator=torch.Generator().manual_seed(5))
    y = cuda._Launcher(cudasim.SimRuntime(sim)).lora_range(u16(new), u16(old), omega.numpy())
    ref = ((new.float() - old.float()) @ omega).numpy()
    assert np.array_equal(np.isnan(y), np.isnan(ref)) and np.array_equal(np.isinf(y), np.isinf(ref))


def test_empty_and_mismatched_inputs(sim):
    launcher = cuda._Launcher(cudasim.SimRuntime(sim))
    assert launcher.lora_range(np.zeros((0, 5), np.uint16), np.zeros((0, 5), np.uint16),
                             np.zeros((5, 3), np.float32)).shape == (0, 3)
    with pytest.raises(ValueError, match="omega"):
        launcher.lora_range(np.zeros((2, 5), np.uint16), np.zeros((2, 5), np.uint16), np.zeros((4, 3), np.float32))
    with pytest.raises(TypeError, match="fp32 omega"):
        launcher.lora_range(np.zeros((2, 5), np.uint16), np.zeros((2, 5), np.uint16), np.zeros((5, 3), np.float64))


class SimRange:
    """What lowrank asks of a backend (lowrank_range on torch tensors), served by the kernel on the harness."""

    def __init__(self, sim):
        self.launcher = cuda._Launcher(cudasim.SimRuntime(sim, "random", seed=9))
        self.calls = 0

    def lowrank_range(self, w_new, w_old, omega):
        self.calls += 1
        return torch.from_numpy(self.launcher.lora_range(u16(w_new), u16(w_old), omega.numpy()))


def test_lowrank_uses_the_kernel_for_bf16_weights(sim):
    from wsync.lowrank import LossyLowRankSender

    g = torch.Generator().manual_seed(6)
    served = {"w": (torch.randn(64, 96, generator=g) * 0.02).to(torch.bfloat16)}
    target = {"w": (served["w"].float() + torch.randn(64, 8, generator=g) @ torch.randn(8, 96, generator=g) * 1e-3
                    ).to(torch.bfloat16)}
    with_kernel = LossyLowRankSender(served, rank=8, power_iters=0)
    with_kernel.range_kernels = rng = SimRange(sim)
    plain = LossyLowRankSender(served, rank=8, power_iters=0, range_finder="torch")
    a, b = with_kernel.step(target), plain.step(target)
    assert rng.calls == 1
    for name in a:
        if a[name].is_floating_point():
            assert torch.allclose(a[name].float(), b[name].float(), rtol=1e-3, atol=1e-6), name
    assert with_kernel.report.factor_error["w"] < 0.05
    assert abs(with_kernel.report.factor_error["w"] - plain.report.factor_error["w"]) < 1e-4


def test_lowrank_keeps_torch_where_the_kernel_does_not_apply(sim):
    from wsync.lowrank import LossyLowRankSender

    served = {"w": torch.randn(32, 40) * 0.02}  # fp32 weights: no bf16 kernel
    s = LossyLowRankSender(served, rank=4)
    s.range_kernels = rng = SimRange(sim)
    s.step({"w": served["w"] + 1e-3})
    assert rng.calls == 0


# ---- the C++ twin (wsync._cpu.lora_range) -------------------------------------------------------------


@pytest.mark.parametrize("m,n,k,density", [(37, 1000, 24, 0.3), (5, 300, 1, 1.0), (9, 257, 40, 0.05), (0, 5, 3, 1.0)])
def test_cpp_twin_within_the_bound(cpu_kernels, m, n, k, density):
    new, old = bf16_pair(m, n, density, seed=m + n + k)
    omega = torch.randn(n, k, generator=torch.Generator().manual_seed(k))
    y = cpu_kernels.lowrank_range(new, old, omega)
    assert y.shape == (m, k) and y.dtype == torch.float32
    check_bound(y.numpy(), new, old, omega)


def test_cpp_twin_and_kernel_agree(sim, cpu_kernels):
    new, old = bf16_pair(16, 3000, 0.2, seed=8)
    omega = torch.randn(3000, 24, generator=torch.Generator().manual_seed(8))
    gpu = cuda._Launcher(cudasim.SimRuntime(sim, "random", seed=8)).lora_range(u16(new), u16(old), omega.numpy())
    cpp = cpu_kernels.lowrank_range(new, old, omega).numpy()
    check_bound(gpu, new, old, omega)
    check_bound(cpp, new, old, omega)


def test_cpp_twin_refuses_wrong_inputs(cpu_kernels):
    with pytest.raises(TypeError, match="bf16"):
        cpu_kernels.lowrank_range(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(3, 4))


def test_lowrank_takes_the_cpu_backend_for_host_bf16_weights(cpu_kernels, monkeypatch):
    from wsync.lowrank import LossyLowRankSender

    calls = []
    real = type(cpu_kernels).lowrank_range
    monkeypatch.setattr(type(cpu_kernels), "lowrank_range", lambda self, *a: calls.append(1) or real(self, *a))
    served = {"w": (torch.randn(48, 64, generator=torch.Generator().manual_seed(9)) * 0.02).to(torch.bfloat16)}
    s = LossyLowRankSender(served, rank=4, power_iters=0)
    s.step({"w": (served["w"].float() + 1e-3).to(torch.bfloat16)})
    assert calls == [1]
