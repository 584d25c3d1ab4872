"""Consecutive bf16 weight snapshots made the way an RL trainer makes them.

The delta codec bets on a property of real training: with fp32 master weights
and RL learning rates (~1e-6), almost every bf16 value is bit-identical from
one step to the next, and a changed value moves by one or two representable
steps. Random perturbations of a tensor do not have that structure, so the
codec is benchmarked on snapshots of an actual (small) Qwen3 model trained
with AdamW on real gradients, exported as bf16 after every optimizer step.

Generation takes minutes on a CPU (the bench model: about 15 min for 17
snapshots on 2 busy cores) and writes about 2.2 GB per learning rate, so
`ensure_snapshots` keeps the files in a cache directory (WSYNC_BENCH_DATA, else
~/.cache/wsync/snapshots) and reuses them while `meta.json` matches the config;
`announce` says what will be written where, and how big, before the work starts.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from wsync import progress
from wsync.codecs import delta_ref
from wsync.errors import BackendUnavailable

# Bump when the generated data would differ for the same config (model shapes,
# data stream, training loop), so stale caches are regenerated, not reused.
GENERATOR_VERSION = 1

# Qwen3Config shapes per size. "bench" is the benchmark model, "small" a quick
# look, "tiny" the unit tests. Parameter counts are in the module tests/report.
SIZES: dict[str, dict] = {
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=192,
                 num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16),
    "small": dict(vocab_size=8192, hidden_size=256, intermediate_size=768,
                  num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=64),
    "bench": dict(vocab_size=32000, hidden_size=512, intermediate_size=1536,
                  num_hidden_layers=10, num_attention_heads=8,
                  num_key_value_heads=4, head_dim=64),
}


@dataclass(kw_only=True)
class SnapshotConfig:
    # Model shape preset, a key of SIZES.
    size: str = "bench"
    # AdamW learning rate; RL post-training uses ~1e-6, SFT-like runs ~1e-5.
    lr: float = 1e-6
    # Measured optimizer steps; snapshots are step_0000 .. step_{steps}.
    steps: int = 16
    # Seeds model init and the token stream; same seed, same snapshots.
    seed: int = 0
    # Sequences per step; enough tokens that most weights get a gradient.
    batch: int = 8
    # Tokens per sequence; kept short so a bench step stays ~1-2 s on 2 cores.
    seq_len: int = 64
    # RL trainers use 0.0-0.01; 0.0 keeps rows with no gradient bit-identical.
    weight_decay: float = 0.0
    # AdamW betas, the PyTorch / most-RL-recipes defaults.
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    # Unexported steps at the target lr before step_0000. Adam's first steps
    # are unusually uniform (step 1 moves every weight by exactly lr), so
    # snapshots taken from a fresh optimizer would overstate density and
    # understate step-size spread; warming up puts step_0000 mid-training.
    warmup_steps: int = 20
    # Successors per token in the synthetic Markov chain: the loss floor is
    # log(branch), so the model has something to learn for many steps.
    branch: int = 4

    def __post_init__(self) -> None:
        if self.size not in SIZES:
            raise ValueError(f"size must be one of {sorted(SIZES)}, got {self.size!r}")
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr!r}")
        if not 0 <= self.steps <= 9999:
            raise ValueError(f"steps must be in 0..9999 (4-digit file names), got {self.steps!r}")
        if self.batch < 1 or self.seq_len < 2:
            raise ValueError(f"need batch >= 1 and seq_len >= 2, got {self.batch}, {self.seq_len}")


def default_cache_dir(cfg: SnapshotConfig, root: str | Path | None = None) -> Path:
    """`<root>/<size>-lr<lr>-s<seed>`; root from WSYNC_BENCH_DATA or ~/.cache."""
    if root is None:
        root = os.environ.get("WSYNC_BENCH_DATA") or Path.home() / ".cache" / "wsync" / "snapshots"
    return Path(root) / f"{cfg.size}-lr{cfg.lr:g}-s{cfg.seed}"


def estimate_params(size: str) -> int:
    """Parameters of a SIZES preset, counted from its shapes (no model is built: this runs before the work)."""
    c = SIZES[size]
    h, hd = c["hidden_size"], c["head_dim"]
    attn = h * hd * (2 * c["num_attention_heads"] + 2 * c["num_key_value_heads"]) + 2 * hd  # q, k, v, o, q/k norms
    layer = attn + 3 * h * c["intermediate_size"] + 2 * h  # + gate/up/down + two RMSNorms
    return 2 * c["vocab_size"] * h + c["num_hidden_layers"] * layer + h  # untied embed/lm_head + final norm


def estimate_bytes(cfg: SnapshotConfig) -> int:
    """Disk the snapshots of cfg take: steps + 1 bf16 copies of the model (safetensors headers aside)."""
    return 2 * estimate_params(cfg.size) * (cfg.steps + 1)


_announced: set[Path] = set()  # folders already announced in this process: say it once, up front


def announce(cfgs: list[SnapshotConfig], root: str | Path | None = None) -> int:
    """Say on stderr, before generating, which snapshots will be written where and how big; returns the bytes.

    Callers that will generate several series (one per lr) call this first so the
    total is said once; ensure_snapshots calls it too, for callers that do not.
    Nothing is said for a series already cached or already announced.
    """
    return _announce([(c, default_cache_dir(c, root)) for c in cfgs])


def _announce(series: list[tuple[SnapshotConfig, Path]]) -> int:
    todo = {}  # one entry per folder: the codec and sync suites may name the same series twice
    for c, d in series:
        if Path(d) not in _announced and not _cache_valid(Path(d), c):
            todo.setdefault(Path(d), c)
    todo = [(c, d) for d, c in todo.items()]
    if not todo:
        return 0
    _announced.update(d for _, d in todo)
    total = sum(estimate_bytes(c) for c, _ in todo)
    size = todo[0][0].size
    _log(f"will generate {sum(c.steps + 1 for c, _ in todo)} snapshots of the {size} model "
         f"({estimate_params(size) / 1e6:.1f}M params): {progress.human_bytes(total)} in "
         + ", ".join(str(d) for _, d in todo))
    smaller = {"bench": "; --size small writes about 1/9 of that, --size tiny a few MB",
               "small": "; --size tiny writes a few MB"}.get(size, "")
    _log(f"later runs reuse them; set WSYNC_BENCH_DATA=DIR to put them elsewhere{smaller}")
    return total


def snapshot_path(out_dir: Path, step: int) -> Path:
    return Path(out_dir) / f"step_{step:04d}.safetensors"


def _log(msg: str) -> None:
    # stdout stays free for results (the CLI prints its table there).
    print(f"[snapshots] {msg}", file=sys.stderr, flush=True)


# --- model and data ---------------------------------------------------------

GENERATE_HINT = 'pip install -e "./benchmarks[all]"'  # the extra that brings transformers (and every peer of bench codec)


def require_generator(cfgs: list[SnapshotConfig], instead: str) -> None:
    """Raise BackendUnavailable, in one line, where a series of `cfgs` is not cached and transformers does
    not import: said before anything is announced or written. `instead`: how to run without generating."""
    if all(_cache_valid(default_cache_dir(c), c) for c in cfgs):
        return
    try:
        import transformers  # noqa: F401
    except ImportError as e:
        raise BackendUnavailable(f"generating benchmark snapshots needs transformers ({e}): {GENERATE_HINT}, "
                                 f"or {instead}") from None


def build_model(cfg: SnapshotConfig) -> torch.nn.Module:
    """Random-init Qwen3 in fp32: the trainer's master weights."""
    # transformers is heavy; only snapshot generation needs it.
    try:
        from transformers import Qwen3Config, Qwen3ForCausalLM
    except ImportError as e:
        raise BackendUnavailable(f"generating benchmark snapshots needs transformers >= 4.51 ({e}): "
                                 f"{GENERATE_HINT}") from None

    config = Qwen3Config(**SIZES[cfg.size], max_position_embeddings=max(256, cfg.seq_len),
                         tie_word_embeddings=False, use_cache=False)
    torch.manual_seed(cfg.seed)
    return Qwen3ForCausalLM(config).float().train()


def param_count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def _zipf_weights(vocab: int) -> torch.Tensor:
    # Token frequencies in text are roughly Zipfian; a few tokens dominate.
    return 1.0 / torch.arange(1, vocab + 1, dtype=torch.float64)


def markov_table(vocab: int, branch: int, gen: torch.Generator) -> torch.Tensor:
    """[vocab, branch] successor table, successors drawn Zipf-distributed."""
    picks = torch.multinomial(_zipf_weights(vocab), vocab * branch, replacement=True, generator=gen)
    return picks.view(vocab, branch)


def sample_batch(table: torch.Tensor, batch: int, seq_len: int, gen: torch.Generator) -> torch.Tensor:
    """[batch, seq_len] token ids walked along the Markov chain."""
    vocab, branch = table.shape
    tokens = torch.empty(batch, seq_len, dtype=torch.long)
    tokens[:, 0] = torch.multinomial(_zipf_weights(vocab), batch, replacement=True, generator=gen)
    choice = torch.randint(0, branch, (batch, seq_len), generator=gen)
    for t in range(1, seq_len):
        tokens[:, t] = table[tokens[:, t - 1], choice[:, t]]
    return tokens


def train_step(model, opt, table, cfg: SnapshotConfig, gen: torch.Generator) -> float:
    """One AdamW step on the causal-LM loss of a fresh batch; returns the loss."""
    ids = sample_batch(table, cfg.batch, cfg.seq_len, gen)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item()


def export_bf16(model: torch.nn.Module, path: Path, step: int) -> None:
    """What the trainer ships: the bf16 cast of every fp32 master weight."""
    from safetensors.torch import save_file

    tensors = {name: p.detach().to(torch.bfloat16).contiguous() for name, p in model.named_parameters()}
    save_file(tensors, str(path), metadata={"step": str(step)})


# --- generation and cache ---------------------------------------------------

def _clear(out_dir: Path) -> None:
    # meta.json goes first: a run interrupted after this point leaves no
    # meta.json, so the directory is never mistaken for a complete cache.
    (out_dir / "meta.json").unlink(missing_ok=True)
    for old in out_dir.glob("step_*.safetensors"):
        old.unlink()


def _environment() -> dict:
    # Wall times mean nothing without the hardware that produced them.
    return {"machine": platform.machine(), "processor": platform.processor(),
            "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__, "python": platform.python_version()}


def make_snapshots(out_dir: str | Path, cfg: SnapshotConfig) -> list[Path]:
    """Train and write step_0000..step_{steps} plus meta.json; returns the paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    _clear(out_dir)
    model = build_model(cfg)
    n_params = param_count(model)
    gen = torch.Generator().manual_seed(cfg.seed)
    table = markov_table(model.config.vocab_size, cfg.branch, gen)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                            eps=cfg.eps, weight_decay=cfg.weight_decay)
    _log(f"{cfg.size}: {n_params:,} params, lr {cfg.lr:g}, {cfg.warmup_steps} warm-up + {cfg.steps} steps -> {out_dir}")

    # one bar over warm-up and measured steps: both cost the same, and the ETA is for the whole job
    with progress.bar(cfg.warmup_steps + cfg.steps, f"snapshots {cfg.size} lr {cfg.lr:g}", unit="step") as bar:
        warmup_loss = []
        for _ in range(cfg.warmup_steps):
            warmup_loss.append(train_step(model, opt, table, cfg, gen))
            bar.set_postfix_str(f"warm-up loss {warmup_loss[-1]:.3f}")
            bar.update()
        if warmup_loss and not progress.enabled():
            _log(f"warm-up done, loss {warmup_loss[0]:.4f} -> {warmup_loss[-1]:.4f}")
        paths = [snapshot_path(out_dir, 0)]
        export_bf16(model, paths[0], 0)

        loss, step_s = [], []
        for k in range(1, cfg.steps + 1):
            t0 = time.perf_counter()
            loss.append(train_step(model, opt, table, cfg, gen))
            step_s.append(time.perf_counter() - t0)
            paths.append(snapshot_path(out_dir, k))
            export_bf16(model, paths[-1], k)
            bar.set_postfix_str(f"loss {loss[-1]:.3f}")
            bar.update()
            if not progress.enabled():  # a log file gets a line per step instead of a bar
                _log(f"step {k}/{cfg.steps} loss {loss[-1]:.4f} {step_s[-1]:.2f}s")

    meta = {"generator_version": GENERATOR_VERSION, "config": asdict(cfg),
            "model": SIZES[cfg.size], "param_count": n_params,
            "warmup_loss": warmup_loss, "loss": loss, "step_seconds": step_s,
            "files": [p.name for p in paths], "environment": _environment()}
    (out_dir / "meta.json").write_text(json.dumps(meta, indent=1))
    return paths


def load_meta(out_dir: str | Path) -> dict | None:
    try:
        return json.loads((Path(out_dir) / "meta.json").read_text())
    except (OSError, ValueError):
        return None


def _cache_valid(out_dir: Path, cfg: SnapshotConfig) -> bool:
    meta = load_meta(out_dir)
    return (meta is not None
            and meta.get("generator_version") == GENERATOR_VERSION
            and meta.get("config") == asdict(cfg)
            and all(snapshot_path(out_dir, k).is_file() for k in range(cfg.steps + 1)))


def ensure_snapshots(cache_dir: str | Path | None, cfg: SnapshotConfig) -> list[Path]:
    """Snapshots for cfg from cache_dir, generated only if missing or stale."""
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir(cfg)
    if _cache_valid(cache_dir, cfg):
        _log(f"reusing {cache_dir}")
        return [snapshot_path(cache_dir, k) for k in range(cfg.steps + 1)]
    _announce([(cfg, cache_dir)])
    return make_snapshots(cache_dir, cfg)


def snapshot_pairs(paths: list[Path], gaps=(1, 4, 16)) -> list[tuple[int, Path, Path]]:
    """(gap, step_0000, step_gap) for each gap the snapshots reach."""
    return [(g, paths[0], paths[g]) for g in gaps if 0 < g < len(paths)]


# --- what the delta codec sees ----------------------------------------------

def monotone_key(bits: np.ndarray) -> np.ndarray:
    """uint16 bf16 patterns -> uint16 keys ordered like the float values.

    Adjacent representable values have adjacent keys, so key(new) - key(old)
    counts representable steps, across zero and exponent boundaries alike.
    """
    return delta_ref.monotone_key(bits.astype(np.uint16, copy=False), "float")


def _bf16_bits(t: torch.Tensor) -> np.ndarray:
    if t.dtype != torch.bfloat16:
        raise TypeError(f"expected a bfloat16 tensor, got {t.dtype}")
    # numpy has no bf16; the int16 view carries the same 16-bit patterns.
    return t.contiguous().view(torch.int16).numpy().view(np.uint16).ravel()


def change_counts(old: torch.Tensor, new: torch.Tensor) -> dict[str, int]:
    """Element counts: total, changed, and changed by |step| 1, 2, <= 127."""
    a, b = _bf16_bits(old), _bf16_bits(new)
    if a.shape != b.shape:
        raise ValueError(f"shape mismatch: {tuple(old.shape)} vs {tuple(new.shape)}")
    step = monotone_key(b).astype(np.int32) - monotone_key(a).astype(np.int32)
    mag = np.abs(step[step != 0])
    return {"n": int(a.size), "changed": int(mag.size), "step1": int((mag == 1).sum()),
            "step2": int((mag == 2).sum()), "le127": int((mag <= 127).sum())}


def snapshot_change_stats(old_path: Path, new_path: Path) -> dict:
    """Density and step distribution between two snapshot files.

    Step fractions are of the changed elements, not of all elements.
    """
    from safetensors.torch import load_file

    old, new = load_file(str(old_path)), load_file(str(new_path))
    if old.keys() != new.keys():
        raise ValueError(f"tensor names differ: {sorted(old.keys() ^ new.keys())[:5]}")
    total = dict.fromkeys(["n", "changed", "step1", "step2", "le127"], 0)
    for name in old:
        for key, value in change_counts(old[name], new[name]).items():
            total[key] += value
    changed = max(total["changed"], 1)
    return {**total, "density": total["changed"] / total["n"],
            "frac_step1": total["step1"] / changed, "frac_step2": total["step2"] / changed,
            "frac_le127": total["le127"] / changed}
