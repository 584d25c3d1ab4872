"""First-principles costs of an RL loop: decode step latency, trainer step time, sync time.

Decode is a roofline: one step of an engine with `b` active sequences reads the
weights it touches (all of a dense model; for MoE, the experts `b` tokens hit)
plus every sequence's KV cache, and does `b` tokens' FLOPs; it takes the longer
of the two at the GPU's HBM bandwidth and peak FLOP/s, plus a fixed launch
overhead. A measured curve (batch -> seconds per step) replaces it when given.
The trainer does 6 FLOPs per active weight per token (forward and backward)
plus 2 for recomputing logprobs. `sim.py` runs these costs through time.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .models import ModelConfig, PlanError, get_model
from .params import breakdown, checkpoint_bytes, dtype_bytes, flops_per_token, kv_bytes_per_token, weight_bytes


@dataclass(frozen=True, kw_only=True)
class GPU:
    name: str
    peak_tflops: float  # dense bf16 tensor-core peak
    hbm_tbps: float  # HBM bandwidth, TB/s
    hbm_gb: float  # memory capacity, GB


GPUS = {
    "h100": GPU(name="H100 SXM", peak_tflops=989.0, hbm_tbps=3.35, hbm_gb=80),
    "h200": GPU(name="H200", peak_tflops=989.0, hbm_tbps=4.8, hbm_gb=141),
    "b200": GPU(name="B200", peak_tflops=2250.0, hbm_tbps=8.0, hbm_gb=180),
    "a100": GPU(name="A100 80GB", peak_tflops=312.0, hbm_tbps=2.039, hbm_gb=80),
}


def get_gpu(name: str) -> GPU:
    try:
        return GPUS[name.lower()]
    except KeyError:
        raise PlanError(f"unknown GPU {name!r}; use one of {', '.join(GPUS)}") from None


@dataclass(frozen=True, kw_only=True)
class SimulatedLoop:
    """One RL loop layout and workload; every field has a default a user can override."""

    model: str = "qwen3-8b"  # catalog name or config.json path
    gpu: str = "h100"  # GPUS key
    train_gpus: int = 8  # GPUs in the trainer pool
    infer_gpus: int = 8  # GPUs in the sampler pool
    tp: int = 1  # GPUs per inference engine (tensor parallel)
    max_batch: int = 64  # concurrent sequences per engine
    prompt_tokens: int = 512  # prompt length of every sample
    response_mean: float = 2048.0  # mean response length, tokens
    response_sigma: float = 1.0  # lognormal sigma: the long tail (0 = all equal)
    response_max: int = 16384  # generation cap
    samples_per_step: int = 256  # samples per trainer step
    mode: str = "async"  # "sync" (generate, train, sync in turn) or "async" (overlapped)
    max_staleness: int = 1  # async: a sample may be at most this many versions old when trained on
    steps: int = 12  # trainer steps to simulate
    warmup_steps: int = 2  # steps left out of the steady-state figures
    sync_s: float | None = None  # weight-sync time; None: wire time of `codec` over `link`
    engine_pause_s: float | None = None  # engines stop decoding this long per update; None: sync_s
    link: str = "rdma-3.2t"  # transfer.LINKS key or a rate like 25g
    codec: str = "full"  # full | delta | lora
    infer_mfu: float = 0.5  # share of peak FLOP/s a decode step reaches when compute bound
    mem_efficiency: float = 0.8  # share of HBM bandwidth a decode step reaches when memory bound
    step_overhead_s: float = 0.003  # launch / scheduling cost of each decode step
    train_mfu: float = 0.4  # share of peak FLOP/s the trainer reaches
    train_flops_per_param: float = 8.0  # 6 (fwd+bwd) + 2 (logprob recompute) per active weight per token
    decode_curve: tuple[tuple[int, float], ...] = field(default=())  # measured (batch, s/step); overrides roofline
    train_step_s: float | None = None  # measured trainer compute seconds per step; None: the FLOP model
    group_size: int = 1  # samples per prompt (a GRPO group): started together, handed to the trainer together
    length_table: tuple[tuple[int, float], ...] = field(default=())  # (response cap, probability) per prompt;
    # replaces the lognormal when given: every sample of a group shares its prompt's cap
    early_stop: float = 0.0  # with length_table: chance per token that a sample ends (EOS) before its cap
    abort_stale: bool = True  # async: abort in-flight samples too old to train on (False: finish, then drop)
    seed: int = 0  # RNG seed for response lengths

    def validate(self) -> None:
        if self.mode not in ("sync", "async"):
            raise PlanError(f"mode must be sync or async, got {self.mode!r}")
        for k in ("train_gpus", "infer_gpus", "tp", "max_batch", "samples_per_step", "steps", "response_max",
                  "group_size"):
            if getattr(self, k) < 1:
                raise PlanError(f"{k} must be >= 1, got {getattr(self, k)}")
        if self.infer_gpus < self.tp:
            raise PlanError(f"infer_gpus ({self.infer_gpus}) must hold at least one engine of tp={self.tp}")
        if self.max_staleness < 0 or not 0 <= self.warmup_steps < self.steps:
            raise PlanError("max_staleness must be >= 0 and 0 <= warmup_steps < steps")
        if self.max_batch < self.group_size or self.samples_per_step % self.group_size:
            raise PlanError(f"group_size {self.group_size} must fit max_batch ({self.max_batch}) and divide "
                            f"samples_per_step ({self.samples_per_step})")
        if any(n < 1 or p < 0 for n, p in self.length_table) or (self.length_table and
                                                                 sum(p for _, p in self.length_table) <= 0):
            raise PlanError("length_table wants (cap >= 1, probability >= 0) pairs with a positive total")
        if not 0.0 <= self.early_stop < 1.0:
            raise PlanError(f"early_stop must be in [0, 1), got {self.early_stop}")
        if self.train_step_s is not None and self.train_step_s < 0:
            raise PlanError(f"train_step_s must be >= 0, got {self.train_step_s}")


def _routed_bytes(m: ModelConfig) -> float:
    """Bytes of the routed experts as served (quantized when the checkpoint is)."""
    routed = breakdown(m)["routed_experts"]
    if m.quant and "routed_experts" in m.quant.targets:
        return routed * (m.quant.bits / 8 + m.quant.scale_bytes / m.quant.group_size)
    return routed * dtype_bytes(m.dtype)


def weight_bytes_touched(m: ModelConfig, batch: int) -> float:
    """Weight bytes one decode step reads: MoE layers read only the experts the batch hits."""
    main = checkpoint_bytes(m) - breakdown(m)["vision"] * dtype_bytes(m.dtype) - breakdown(m)["mtp"] * dtype_bytes(m.dtype)
    if not m.moe:
        return main
    routed = _routed_bytes(m)
    e, k = m.moe.num_experts, m.moe.experts_per_token
    hit = 1.0 - (1.0 - k / e) ** batch  # expected share of experts at least one of `batch` tokens visits
    return main - routed + routed * hit


class DecodeCost:
    """Decode step latency of one engine as a function of (batch, mean context), constants precomputed."""

    def __init__(self, cfg: SimulatedLoop, m: ModelConfig):
        g = get_gpu(cfg.gpu)
        self.curve = tuple(cfg.decode_curve)
        self.routed = _routed_bytes(m) if m.moe else 0.0
        self.static = weight_bytes_touched(m, 0) if m.moe else weight_bytes_touched(m, 1)
        self.experts = (m.moe.num_experts, m.moe.experts_per_token) if m.moe else None
        self.kv = kv_bytes_per_token(m)
        self.f0 = flops_per_token(m, 0)
        self.f_ctx = flops_per_token(m, 1) - self.f0
        self.bandwidth = cfg.tp * g.hbm_tbps * 1e12 * cfg.mem_efficiency
        self.flops = cfg.tp * g.peak_tflops * 1e12 * cfg.infer_mfu
        self.overhead = cfg.step_overhead_s

    def __call__(self, batch: int, context: float) -> float:
        if batch <= 0:
            return 0.0
        if self.curve:
            return _interpolate(self.curve, batch)
        weights = self.static
        if self.experts:
            e, k = self.experts
            weights += self.routed * (1.0 - (1.0 - k / e) ** batch)
        t_mem = (weights + batch * context * self.kv) / self.bandwidth
        t_flop = batch * (self.f0 + self.f_ctx * context) / self.flops
        return max(t_mem, t_flop) + self.overhead


def decode_step_s(cfg: SimulatedLoop, m: ModelConfig, batch: int, context: float) -> float:
    """Seconds for one decode step of an engine with `batch` active sequences at mean `context`."""
    return DecodeCost(cfg, m)(batch, context)


def _interpolate(curve: tuple[tuple[int, float], ...], batch: int) -> float:
    """Piecewise-linear in batch, extended past the ends along the first and last segments."""
    pts = sorted(curve)
    if len(pts) == 1:
        return pts[0][1]
    i = next((j for j in range(1, len(pts)) if batch <= pts[j][0]), len(pts) - 1)
    (b0, t0), (b1, t1) = pts[i - 1], pts[i]
    return max(t0 + (t1 - t0) * (batch - b0) / (b1 - b0), 1e-9)


def train_step_s(cfg: SimulatedLoop, m: ModelConfig, tokens: int) -> float:
    """Seconds for one trainer step over `tokens` tokens (prompts and responses); a measured time wins."""
    if cfg.train_step_s is not None:
        return cfg.train_step_s
    g = get_gpu(cfg.gpu)
    matmul = flops_per_token(m, 0) / 2.0  # active matmul weights
    return tokens * cfg.train_flops_per_param * matmul / (cfg.train_gpus * g.peak_tflops * 1e12 * cfg.train_mfu)


def sync_seconds(cfg: SimulatedLoop, m: ModelConfig) -> tuple[float, float]:
    """(trainer-side sync time, engine pause) per weight update."""
    from .transfer import parse_codec, parse_link, wire_seconds

    s = cfg.sync_s if cfg.sync_s is not None else wire_seconds(m, parse_link(cfg.link), parse_codec(cfg.codec))
    pause = cfg.engine_pause_s if cfg.engine_pause_s is not None else s
    return s, pause


def decode_curve_table(cfg: SimulatedLoop, batches=(1, 8, 32, 64, 128, 256)) -> list[dict]:
    """Decode step latency and tokens/s per engine vs batch: where memory-bound turns compute-bound."""
    m = get_model(cfg.model)
    ctx = cfg.prompt_tokens + cfg.response_mean / 2
    rows = []
    for b in batches:
        t = decode_step_s(cfg, m, b, ctx)
        rows.append({"batch": b, "step_ms": t * 1e3, "tokens_per_s": b / t})
    return rows


def weights_fit(cfg: SimulatedLoop, m: ModelConfig) -> bool:
    """Whether one engine's GPUs hold the weights (with 20% left for KV cache and activations)."""
    return weight_bytes(m) <= 0.8 * cfg.tp * get_gpu(cfg.gpu).hbm_gb * 1e9
