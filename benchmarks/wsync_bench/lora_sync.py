"""Full vs delta vs LoRA sync of the same LoRA training run: bytes and publish-to-live time, side by side.

    wsync bench lora-sync                                 # writes ~/.cache/wsync/results
    wsync bench lora-sync --steps 4 --hidden 256 --out /tmp/r

A transformers Qwen3 (random init, no download) with a peft LoRA on every
linear layer takes AdamW steps on CPU. After each step the same trainer state
is synced three ways, each into its own live engine over loopback tcp:

- full: the merged bf16 weights (base + scale * B @ A), raw every version, into a transformers model;
- delta: the same merged weights, wsync's lossless delta (packed) against the previous version;
- lora: only the bf16 adapter tensors (raw; Adam moves every adapter value, so a delta would not be smaller),
  into a running PeftModel (engines.PEFT).

Every version is checked exact (engine digest == trainer digest) before it counts. Time is publish() to the
engine serving the version (subscriber threads in this process); the first version (keyframe) is warm-up.
Ratios are against `full` in the same run.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import time
from pathlib import Path

from wsync.hardware import describe
from wsync.snapshot import unique_tensors
from wsync.subscriber import Subscriber
from wsync.sync import Publisher

from .results import default_results_dir, one_line, stem


TOKEN = b"bench-lora-token-16"


def build(args, seed: int, dtype):
    import torch
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.Qwen3Config(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                                   num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
                                   head_dim=args.hidden // 4, tie_word_embeddings=True, max_position_embeddings=256)
    return transformers.Qwen3ForCausalLM(cfg).to(dtype).eval()


def lora(model, rank: int):
    import peft
    import torch

    torch.manual_seed(1)
    cfg = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear")
    # keep the adapter in the model's dtype (peft would upcast a bf16 model's adapter to fp32)
    return peft.get_peft_model(model, cfg, autocast_adapter_dtype=False)


def merged_bf16(pm) -> dict:
    """The weights an engine without LoRA support serves: base + delta of every LoRA layer, in bf16."""
    import torch
    from peft.tuners.lora import LoraLayer

    out = {}
    base = pm.get_base_model()
    deltas = {n: m.get_delta_weight("default") for n, m in base.named_modules() if isinstance(m, LoraLayer)}
    for name, t in unique_tensors(base.state_dict()).items():  # tied embeddings once, as the engine holds them
        if ".lora_" in name:
            continue
        clean = name.replace(".base_layer.", ".")
        mod = clean.rsplit(".", 1)[0]
        w = t + deltas[mod] if clean.endswith(".weight") and mod in deltas else t
        out[clean] = w.detach().to(torch.bfloat16)
    return out


def train_step(pm, opt, gen, args) -> None:
    import torch

    pm.train()
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen)
    pm(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()
    pm.eval()


def bf16_adapter(pm) -> dict:
    import torch

    from wsync.engines.peft import adapter_state

    return {n: t.to(torch.bfloat16) for n, t in adapter_state(pm).items()}


class Lane:
    """One way of syncing: a Publisher, a live engine, and what each version cost."""

    def __init__(self, name: str, engine, want, **pub_kw):
        self.name, self.engine, self.want = name, engine, want  # want(state) -> the digest the engine must reach
        self.pub = Publisher("tcp://127.0.0.1:0", token=TOKEN, keyframe_every=0, **pub_kw)
        self.sub = Subscriber(self.pub.address, engine=engine, token=TOKEN)
        self.pub.wait_for_subscribers(1, timeout=60)
        self.rows: list[dict] = []

    def sync(self, version: int, state: dict) -> None:
        t0 = time.perf_counter()
        self.pub.publish(state, version=version)
        self.sub.wait_for(version, timeout=600)
        dt_s = time.perf_counter() - t0
        if self.engine.digest() != self.want(state):
            raise SystemExit(f"{self.name}: version {version} is not exact on the engine")
        # the subscriber can commit a version before the encoder thread records its bytes (packed pieces
        # stream while they are written): flush() returns once that record is made
        self.pub.flush(timeout=60)
        self.rows.append({"version": version, "bytes": self.pub.stats.bytes[version], "seconds": dt_s,
                          "keyframe": self.sub.stats.last.keyframe})

    def close(self) -> None:
        self.sub.close()
        self.pub.close()


def digest_of(state: dict) -> str:
    from wsync.snapshot import digest, owned_copy

    return digest(owned_copy(state))


def run(args) -> dict:
    import torch

    from wsync import engines
    from wsync.engines.peft import PEFT

    gen = torch.Generator().manual_seed(0)
    trainer = lora(build(args, 0, torch.float32), args.rank)
    opt = torch.optim.AdamW([p for p in trainer.parameters() if p.requires_grad], lr=args.lr)
    served_lora = lora(build(args, 0, torch.bfloat16), args.rank)
    lanes = [Lane("full", engines.HF(build(args, 7, torch.bfloat16)), digest_of, codec="raw"),
             Lane("delta", engines.HF(build(args, 8, torch.bfloat16)), digest_of, codec="delta", tier="packed"),
             Lane("lora", PEFT(served_lora), digest_of, codec="raw")]
    states = {"full": merged_bf16, "delta": merged_bf16, "lora": bf16_adapter}
    try:
        for v in range(args.steps + 1):  # version 0 is the untrained start (warm-up keyframe)
            if v:
                train_step(trainer, opt, gen, args)
            for lane in lanes:
                lane.sync(v, states[lane.name](trainer))
    finally:
        for lane in lanes:
            lane.close()
    return summarize(args, trainer, lanes)


def summarize(args, trainer, lanes) -> dict:
    from wsync.engines.peft import adapter_state

    n_params = sum(t.numel() for t in merged_bf16(trainer).values())
    out = {"hardware": describe(), "when": dt.datetime.now().isoformat(timespec="seconds"),
           "model": {"arch": "Qwen3 (transformers, random init)", "params": n_params, "hidden": args.hidden,
                     "layers": args.layers, "vocab": args.vocab, "lora_rank": args.rank,
                     "lora_params": sum(t.numel() for t in adapter_state(trainer).values())},
           "run": {k: getattr(args, k) for k in ("steps", "lr", "batch", "seq")},
           "transport": "tcp loopback, publisher and subscriber threads in one process", "exact": True, "lanes": {}}
    base = None
    for lane in lanes:
        timed = [r for r in lane.rows if r["version"] > 0]
        row = {"bytes_per_version": statistics.median(r["bytes"] for r in timed),
               "seconds_per_version": statistics.median(r["seconds"] for r in timed), "versions": lane.rows}
        base = base or row
        row["bytes_vs_full"] = row["bytes_per_version"] / base["bytes_per_version"]
        row["time_vs_full"] = row["seconds_per_version"] / base["seconds_per_version"]
        out["lanes"][lane.name] = row
    return out


def markdown(res: dict) -> str:
    m = res["model"]
    lines = [f"# LoRA sync: full vs delta vs LoRA ({res['when']})", "",
             f"{m['arch']}, {m['params'] / 1e6:.1f}M params, LoRA r={m['lora_rank']} on all linear layers "
             f"({m['lora_params'] / 1e3:.0f}K adapter params); {res['run']['steps']} AdamW steps (lr {res['run']['lr']}); "
             f"{res['transport']}; every version verified exact on the engine.", "",
             "| sync | bytes / version | vs full | publish -> live (median) | vs full |", "|---|---:|---:|---:|---:|"]
    for name, r in res["lanes"].items():
        lines.append(f"| {name} | {r['bytes_per_version'] / 1e6:.3f} MB | {r['bytes_vs_full']:.4f}x | "
                     f"{r['seconds_per_version'] * 1e3:.1f} ms | {r['time_vs_full']:.3f}x |")
    lines += ["", f"Hardware: {one_line(res['hardware'])}.", ""]
    return "\n".join(lines)


def add_parsers(bench) -> None:
    ap = bench.add_parser("lora-sync", help="full vs delta vs LoRA-adapter sync of one LoRA training run",
                          description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                          epilog="Default 5 steps of a 512-wide, 4-layer model: about 15 s here (2 cores); "
                                 "--steps 2 --hidden 64 --layers 2 --vocab 512 is what bench all --size small runs.")
    ap.add_argument("--steps", type=int, default=5, help="training steps, a version synced after each (default 5)")
    ap.add_argument("--hidden", type=int, default=512, help="hidden size of the model (default 512)")
    ap.add_argument("--layers", type=int, default=4, help="decoder layers (default 4)")
    ap.add_argument("--vocab", type=int, default=8192, help="vocabulary (default 8192)")
    ap.add_argument("--rank", type=int, default=16, help="LoRA rank (default 16)")
    ap.add_argument("--lr", type=float, default=1e-4, help="AdamW learning rate (default 1e-4)")
    ap.add_argument("--batch", type=int, default=4, help="sequences per training step (default 4)")
    ap.add_argument("--seq", type=int, default=64, help="tokens per sequence (default 64)")
    ap.add_argument("--out", default=None,
                    help="folder for the .json and .md (default ~/.cache/wsync/results; benchmarks/results for a "
                         "run to commit)")
    ap.set_defaults(fn=main)


def main(args) -> int:
    res = run(args)
    md = markdown(res)
    print(md)
    out = Path(args.out) if args.out else default_results_dir()
    out.mkdir(parents=True, exist_ok=True)
    name = f"{stem(res['hardware'])}-lora-sync"
    (out / f"{name}.json").write_text(json.dumps(res, indent=1) + "\n")
    (out / f"{name}.md").write_text(md)
    return 0
