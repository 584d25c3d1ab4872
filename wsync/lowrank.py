"""LOSSY, opt-in: ship a full-weight update as low-rank factors (randomized SVD), and say how wrong it is.

Every other sync path in wsync is bit-exact with the trainer. This one is not:
each 2-D weight's update D is replaced by rank-r factors B [out, r], A [r, in]
(D ~ B @ A) from a randomized SVD, far fewer bytes than the weights when r is
small. What it does keep exact is the *engine*: the trainer holds a mirror of
what every engine serves, merges the same factors with the same IEEE
operations (fp32 multiply then add, one rank at a time, then one rounding to the
weight dtype: correctly rounded on any CPU or GPU, so the mirror and the engine
agree bit for bit), and each update names the digest of the weights it applies
to and of the weights it produces. The engine side checks both.

Error feedback: the update is computed against the mirror (trainer weights
minus served weights), not against the trainer's previous weights, so whatever
one update missed (its SVD residual and its rounding) is part of the next
update's target and the error stays bounded instead of adding up across versions.
``error_feedback=False`` ships the trainer's own step delta instead, to show the
difference.

Nothing here pretends to be exact: classes and tensor names say ``lossy``, the
first update logs a warning, ``report`` gives each matrix's relative Frobenius
error, and ``kl_next_token`` measures what it does to the model's next-token
distribution on a probe batch. Torch only; the same code runs on CUDA tensors.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

from .snapshot import as_state, digest

log = logging.getLogger("wsync.lowrank")
SUFFIX_A, SUFFIX_B = ".lossy_lowrank_A", ".lossy_lowrank_B"  # factor names: the weight's name + suffix
BEFORE, AFTER = "__wsync__.lossy_lowrank.before", "__wsync__.lossy_lowrank.after"  # served digests (uint8 ascii)


@dataclass(kw_only=True)
class LowRankConfig:
    rank: int = 16  # factor rank per matrix
    oversample: int = 8  # extra random directions in the range finder (Halko et al.: 5-10 is plenty)
    power_iters: int = 2  # subspace iterations; more = closer to the true truncated SVD on flat spectra
    error_feedback: bool = True  # aim each update at (trainer - served), so residuals are carried, not lost
    factor_dtype: str = "float32"  # dtype the factors travel in ("bfloat16" halves bytes; the mirror uses the same)
    seed: int = 0  # the range finder's random matrices are reproducible
    # "auto": bf16 weights get Y = (W_new - W_old) @ Omega from the kernel of their device's backend (cuda on a
    # GPU, the C++ cpu backend on the host), which reads both once without forming the difference
    # (csrc/ws_lora.cuh); "torch": always a matmul
    range_finder: str = "auto"


def randomized_svd(m, rank: int, *, oversample: int = 8, power_iters: int = 2, generator=None, range_finder=None):
    """B [out, rank], A [rank, in] with B @ A close to the best rank-`rank` approximation of m (fp32).

    range_finder(omega) -> m @ omega, when something computes it better than a matmul of m (the
    cuda backend's kernel reads the two weights m is the difference of, see LowRankConfig)."""
    import torch

    m = m.float()
    k = min(rank + oversample, *m.shape)
    omega = torch.randn(m.shape[1], k, generator=generator, device=m.device, dtype=m.dtype)
    q = torch.linalg.qr(range_finder(omega) if range_finder is not None else m @ omega).Q
    for _ in range(power_iters):  # re-orthonormalise each half step so small singular values survive in fp32
        q = torch.linalg.qr(m @ torch.linalg.qr(m.t() @ q).Q).Q
    u, s, vh = torch.linalg.svd(q.t() @ m, full_matrices=False)
    r = min(rank, s.numel())
    root = s[:r].sqrt()  # split the singular values so both factors have the same scale (safer in bf16)
    return (q @ u[:, :r]) * root, root[:, None] * vh[:r]


def merged(w, b, a):
    """w + b @ a, rounded once to w's dtype, computed so every IEEE machine gets the same bits.

    A matmul's summation order depends on the library and the device; one rank-1
    term at a time, each a correctly rounded multiply then a correctly rounded add
    in fp32, does not.
    """
    acc = w.float()
    b, a = b.float(), a.float()
    for i in range(b.shape[1]):
        acc = acc + b[:, i:i + 1] * a[i:i + 1, :]
    return acc.to(w.dtype)


def relative_error(d, b, a) -> float:
    """||d - b @ a||_F / ||d||_F (0 when d is 0 and so is the approximation)."""
    d = d.float()
    n = float(d.norm())
    err = float((d - b.float() @ a.float()).norm())
    return err / n if n > 0 else err


def compressible(shape, rank: int) -> bool:
    """Low-rank factors only pay for 2-D matrices where rank*(in+out) < in*out."""
    return len(shape) == 2 and rank * (shape[0] + shape[1]) < shape[0] * shape[1]


def digest_tensor(d: str):
    import torch

    return torch.tensor(list(d.encode()), dtype=torch.uint8)


def digest_of(t) -> str:
    return bytes(t.tolist()).decode()


@dataclass
class Report:
    """What the last update cost in accuracy (all relative Frobenius norms)."""

    version: int = 0
    factor_error: dict = field(default_factory=dict)  # matrix -> ||D - BA|| / ||D|| of this update
    drift: dict = field(default_factory=dict)  # matrix -> ||trainer - served|| / ||trainer|| after this update
    bytes: int = 0  # bytes of the update (factors + exact tensors + digests)
    full_bytes: int = 0  # bytes of the same weights sent whole

    @property
    def max_drift(self) -> float:
        return max(self.drift.values(), default=0.0)


class LossyLowRankSender:
    """Trainer side: turns successive trainer states into lossy low-rank updates, keeping the residual.

    served: the weights every engine holds now (same names and dtypes as the
    engine's tensors, e.g. the keyframe it was synced with exactly).
    """

    def __init__(self, served: dict, config: LowRankConfig | None = None, **kw):
        import torch

        self.config = config or LowRankConfig(**kw)
        self.served = {n: t.detach().clone() for n, t in served.items()}  # the engines' exact bits, mirrored
        self._prev = {n: t.detach().float().clone() for n, t in served.items()}  # previous trainer weights
        self._gen: dict = {}
        self._dtype = getattr(torch, self.config.factor_dtype)
        self.report = Report()
        self._warned = False
        self.range_kernels = None  # anything with lowrank_range(w_new, w_old, omega); None: the backend's, if any
        self._backends: dict = {}  # "cuda" / "cpu" -> kernels, or None where unavailable

    def _generator(self, device):
        import torch

        if device not in self._gen:
            self._gen[device] = torch.Generator(device=device).manual_seed(self.config.seed)
        return self._gen[device]

    def step(self, state: dict) -> dict:
        """The update that moves every engine from the mirror toward `state`; the mirror moves with it."""
        if not self._warned:
            log.warning("lossy low-rank sync (rank %d): engines will NOT hold the trainer's exact weights; "
                        "see LossyLowRankSender.report and kl_next_token for how far off they are", self.config.rank)
            self._warned = True
        missing = sorted(set(self.served) - set(state))
        if missing:
            from .errors import MismatchError

            raise MismatchError(f"state lacks {len(missing)} served tensors, e.g. {missing[:3]}")
        before = digest(as_state(self.served))
        rep = Report(version=self.report.version + 1)
        update = {}
        for name, cur in self.served.items():
            update.update(self._one(name, cur, state[name].detach(), rep))
        update[BEFORE], update[AFTER] = digest_tensor(before), digest_tensor(digest(as_state(self.served)))
        rep.bytes = sum(t.numel() * t.element_size() for t in update.values())
        rep.full_bytes = sum(t.numel() * t.element_size() for t in self.served.values())
        self.report = rep
        return update

    def _one(self, name: str, cur, target, rep: Report) -> dict:
        cfg = self.config
        t32 = target.to(cur.device).float()
        if not (cur.is_floating_point() and compressible(cur.shape, cfg.rank)):
            self.served[name] = target.to(cur.device, cur.dtype).clone()
            self._prev[name] = t32
            return {name: self.served[name]}  # small or non-float tensors travel whole and exact
        d = t32 - cur.float() if cfg.error_feedback else t32 - self._prev[name]
        b, a = randomized_svd(d, cfg.rank, oversample=cfg.oversample, power_iters=cfg.power_iters,
                              generator=self._generator(cur.device), range_finder=self._range_finder(cur, target))
        b, a = b.to(self._dtype), a.to(self._dtype)
        rep.factor_error[name] = relative_error(d, b, a)
        self.served[name] = merged(cur, b, a)
        self._prev[name] = t32
        n = float(t32.norm())
        rep.drift[name] = float((t32 - self.served[name].float()).norm()) / (n if n > 0 else 1.0)
        return {name + SUFFIX_A: a, name + SUFFIX_B: b}


    def _range_finder(self, cur, target):
        """omega -> (target - cur) @ omega by the kernel, where it applies: bf16 matrices, error feedback on."""
        import torch

        cfg = self.config
        if cfg.range_finder != "auto" or not cfg.error_feedback or cur.dim() != 2:
            return None
        if cur.dtype != torch.bfloat16 or target.dtype != torch.bfloat16:
            return None
        k = self.range_kernels if self.range_kernels is not None else self._backend_kernels("cuda" if cur.is_cuda else "cpu")
        if k is None or not hasattr(k, "lowrank_range"):
            return None
        tgt = target.to(cur.device)
        return lambda omega: k.lowrank_range(tgt, cur, omega)

    def _backend_kernels(self, name: str):
        """The named backend's kernels (cuda for GPU weights, the C++ cpu backend for host ones), or None."""
        if name not in self._backends:
            from .backends import kernels
            from .errors import BackendUnavailable

            try:
                self._backends[name] = kernels(name)
            except BackendUnavailable:
                self._backends[name] = None
        return self._backends[name]


def apply_update(live: dict, update: dict) -> None:
    """Write a lossy low-rank update into live tensors (publisher names -> tensors), checking both digests.

    On any failure every tensor is put back and the error says why.
    """
    import torch

    from .errors import ChecksumError, MismatchError, VersionError

    if BEFORE not in update or AFTER not in update:
        raise MismatchError("not a lossy low-rank update (no digest markers); was it made by LossyLowRankSender?")
    have = digest(as_state(live))
    if have != digest_of(update[BEFORE]):
        raise VersionError(f"this low-rank update applies to weights with digest {digest_of(update[BEFORE])}, the "
                           f"engine holds {have}: low-rank updates must arrive in order; resync exactly first")
    saved = {}
    try:
        with torch.no_grad():
            for name, t in update.items():
                if name in (BEFORE, AFTER) or name.endswith(SUFFIX_B):
                    continue
                base = name[: -len(SUFFIX_A)] if name.endswith(SUFFIX_A) else name
                if base not in live:
                    raise MismatchError(f"update names {base!r}, which the engine does not hold")
                dst = live[base]
                saved[base] = dst.clone()
                if name.endswith(SUFFIX_A):
                    dst.copy_(merged(dst, update[base + SUFFIX_B].to(dst.device), t.to(dst.device)))
                else:
                    dst.copy_(t)
        got = digest(as_state(live))
        if got != digest_of(update[AFTER]):
            raise ChecksumError(f"after merging, the engine digests to {got}, the trainer's mirror to "
                                f"{digest_of(update[AFTER])}")
    except BaseException:
        with torch.no_grad():
            for base, old in saved.items():
                live[base].copy_(old)
        raise


def kl_next_token(exact_model, approx_model, ids) -> float:
    """Mean KL(p_exact || p_approx) over every position's next-token distribution in a probe batch (nats)."""
    import torch

    with torch.no_grad():
        p = torch.log_softmax(exact_model(ids).logits.float(), -1)
        q = torch.log_softmax(approx_model(ids).logits.float(), -1)
    return float((p.exp() * (p - q)).sum(-1).mean())
