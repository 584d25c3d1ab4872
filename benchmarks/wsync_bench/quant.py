"""`wsync bench quant`: quantized weights through the delta codec, on real consecutive RL snapshots.

    wsync bench quant [--size small] [--lr 1e-6 1e-5] [--versions 1] [--out DIR]

The generated snapshots (a Qwen3-architecture model trained with AdamW, bf16 after every optimizer step; see
snapshots.py) are cut into a MoE-shaped state: from layer --dense-layers on, each MLP becomes --experts
experts, slices of its intermediate dimension, so the state names its expert matrices one by one as an MoE
checkpoint does. Each version is then quantized as ``Publisher(quantize=...)`` would send it, three ways:

- kimi: Kimi K2.6's own quantization_config (the planner's catalog entry): INT4 group-32 routed experts; BF16
  attention, dense MLP, embeddings and lm_head;
- int8: compressed-tensors INT8 channels on every Linear but lm_head;
- fp8: vLLM's 128x128 block FP8 on every Linear but lm_head.

Per scheme and version: the fractions changed (BF16 values of the weights the scheme quantizes, their codes,
their scales, and the BF16 values it leaves alone) and the bytes of four payloads, BF16 full and delta,
quantized full and delta. Full is the raw codec (a keyframe); delta is the packed tier with the member table
named by hash, as the Publisher sends deltas by default, one payload for the whole state. Every delta is
applied to its base and compared byte for byte with the state it encodes. Each part of the quantized delta
(codes, scales, the BF16 rest) is also encoded on its own, so its bytes per changed element can be read off
(beyond what a delta that changes nothing costs, so they carry over to a model of another size).

Then, on the first pair: the Quantizer on the fastest host backend, and on the numpy reference, against the BF16
delta encode of the same state, rounds interleaved and the best of each kept (the machines this runs on are
shared), as ratios; the results name the CPU and the class whose quantize ran (a backend without its own
inherits the reference's).
"""
from __future__ import annotations

import datetime as dt
import os
import re
import time
from pathlib import Path

import numpy as np

# compressed-tensors / vLLM quantization_configs of the non-Kimi schemes, as a checkpoint's config.json holds them
INT8_CONFIG = {"quant_method": "compressed-tensors", "format": "int-quantized",
               "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                   "num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}}},
               "ignore": ["lm_head"]}
FP8_CONFIG = {"quant_method": "fp8", "weight_block_size": [128, 128], "ignored_layers": ["lm_head"]}
SCHEME_NAMES = ("kimi", "int8", "fp8")
PARTS = ("codes", "scales", "rest")  # what a quantized state holds: codes, their scales, and unquantized tensors

_MLP = re.compile(r"(.*\.layers\.(\d+)\.mlp)\.(gate|up|down)_proj\.weight$")


def scheme_config(name: str) -> dict:
    if name == "kimi":
        from wsync.plan.catalog import CATALOG

        return CATALOG["kimi-k2.6"]["config"]["quantization_config"]
    return {"int8": INT8_CONFIG, "fp8": FP8_CONFIG}[name]


def load(path) -> dict:
    """A checkpoint's state as TensorBits held in memory (no scheme pays for page faults another skips)."""
    from wsync.checkpoint import read_checkpoint
    from wsync.snapshot import TensorBits

    return {n: TensorBits(t.dtype, tuple(t.shape), np.array(t.bits)) for n, t in read_checkpoint(path).state.items()}


def moe_shaped(state: dict, experts: int, dense_layers: int) -> dict:
    """The state with each MLP of layer >= dense_layers split into `experts` experts along its intermediate
    dimension (gate/up rows, down columns): a dense SwiGLU is the sum of these experts' outputs."""
    from wsync.snapshot import TensorBits

    out = {}
    for name, tb in state.items():
        m = _MLP.match(name)
        if experts <= 1 or not m or int(m.group(2)) < dense_layers:
            out[name] = tb
            continue
        w = tb.bits.reshape(tb.shape)
        axis = 1 if m.group(3) == "down" else 0
        if w.shape[axis] % experts:
            raise ValueError(f"{name}: intermediate size {w.shape[axis]} does not split into {experts} experts")
        for e, part in enumerate(np.split(w, experts, axis=axis)):
            out[f"{m.group(1)}.experts.{e}.{m.group(3)}_proj.weight"] = TensorBits(
                tb.dtype, tuple(part.shape), np.ascontiguousarray(part).reshape(-1))
    return out


def parts_of(q, state: dict) -> tuple[dict, dict]:
    """({quantized name: part}, {bf16 name: scheme or None}) for this state: which output is a code, a scale or
    a weight's shape (left out of every count), and which source weights the scheme quantizes."""
    from wsync.quant.schemes import SUFFIX

    part, source = {}, {}
    for name, tb in state.items():
        scheme = q.scheme_for(name, tb.shape, tb.dtype.name)
        source[name] = scheme
        if scheme is None:
            part[name] = "rest"
            continue
        for o in scheme.outputs(tuple(tb.shape), tb.dtype.name):
            kind = "scales" if "scale" in o.suffix else "codes" if o.suffix in (SUFFIX, "weight_packed") else "shape"
            part[o.name(name)] = kind
    return part, source


def changed(a, b) -> tuple[int, int]:
    """(elements that differ, elements) of two TensorBits."""
    return int(np.count_nonzero(a.bits != b.bits)), int(a.bits.size)


def changed_nibbles(a, b) -> tuple[int, int]:
    """changed() of packed INT4 codes: each int32 word holds eight, counted apiece."""
    x = (a.bits.view(np.uint32) ^ b.bits.view(np.uint32))
    n = sum(int(np.count_nonzero((x >> np.uint32(4 * k)) & np.uint32(0xF))) for k in range(8))
    return n, 8 * int(x.size)


def _copy(state: dict) -> dict:
    from wsync.snapshot import TensorBits

    return {n: TensorBits(t.dtype, t.shape, t.bits.copy()) for n, t in state.items()}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[n].bits.tobytes() == b[n].bits.tobytes() for n in a)


def delta_bytes(base: dict, new: dict, backend: str | None = None) -> tuple[int, bool]:
    """(bytes of the packed delta as the Publisher sends it, whether applying it gives `new` bit for bit)."""
    from wsync import api

    wire = api.encode(base, new, tier="packed", inline=False, backend=backend).nbytes
    out = api.apply_state(base, api.encode(base, new, tier="packed", backend=backend), backend=backend)
    return wire, _same(out, new)


def full_bytes(state: dict) -> int:
    from wsync import api

    return api.encode(None, state, codec="raw").nbytes


def measure_pair(q, base: dict, new: dict) -> dict:
    """One version of one scheme: what changed and the four payloads' bytes."""
    part, source = parts_of(q, new)
    qb, qn = _copy(q(base)), _copy(q(new))
    counts = {k: [0, 0] for k in ("bf16_quantized", "bf16_rest", *PARTS)}
    for name, scheme in source.items():
        c = changed(base[name], new[name])
        key = "bf16_rest" if scheme is None else "bf16_quantized"
        counts[key][0] += c[0]
        counts[key][1] += c[1]
    for name, kind in part.items():
        if kind == "shape":
            continue
        c = changed_nibbles(qb[name], qn[name]) if name.endswith("weight_packed") else changed(qb[name], qn[name])
        counts[kind][0] += c[0]
        counts[kind][1] += c[1]
    bf16_delta, bf16_exact = delta_bytes(base, new)
    quant_delta, quant_exact = delta_bytes(qb, qn)
    row = {"changed": {k: c for k, (c, n) in counts.items()}, "elements": {k: n for k, (c, n) in counts.items()},
           "fraction_changed": {k: (c / n if n else 0.0) for k, (c, n) in counts.items()},
           "bytes": {"bf16_full": full_bytes(new), "bf16_delta": bf16_delta, "quant_full": full_bytes(qn),
                     "quant_delta": quant_delta},
           "exact": bf16_exact and quant_exact, "parts": {}}
    for kind in PARTS:  # each part's own delta: its bytes per changed element
        names = [n for n, k in part.items() if k == kind]
        if not names:
            continue
        sub_b, sub_n = {n: qb[n] for n in names}, {n: qn[n] for n in names}
        wire, exact = delta_bytes(sub_b, sub_n)
        empty = empty_delta_bytes(sub_b)
        row["parts"][kind] = {"raw_bytes": sum(qn[n].nbytes for n in names), "delta_bytes": wire,
                              "empty_delta_bytes": empty, "bytes_per_changed": (wire - empty) / max(counts[kind][0], 1)}
        row["exact"] = row["exact"] and exact
    return row


def empty_delta_bytes(state: dict) -> int:
    """Bytes of a delta that changes nothing: what a payload costs whatever changed (header, manifest, checksums),
    left out of the bytes per changed element so they carry over to a model of another size."""
    from wsync import api

    return api.encode(state, state, tier="packed", inline=False).nbytes


def quantize_kernel(backend: str | None = None) -> str:
    """The class whose quantize the host backend runs: the backend's own, or the inherited reference."""
    from wsync import backends

    owner = next(c for c in type(backends.kernels(backend)).__mro__ if "quantize" in vars(c))
    return f"{owner.__module__}.{owner.__qualname__}"


def timing(q, ref, base: dict, new: dict, rounds: int) -> dict:
    """Best seconds of the Quantizer q (the fastest host backend), of the same on the numpy reference (ref), and of
    the BF16 packed delta encode base -> new on the fastest backend, interleaved."""
    from wsync import api

    fns = {"quantize_s": lambda: q(new), "quantize_reference_s": lambda: ref(new),
           "bf16_delta_encode_s": lambda: api.encode(base, new, tier="packed", inline=False)}
    for fn in fns.values():  # warm: the Quantizer's buffers and plan, the codec's first allocations
        fn()
    best = {k: float("inf") for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            t = time.perf_counter()
            fn()
            best[k] = min(best[k], time.perf_counter() - t)
    best["ratio"] = best["quantize_s"] / best["bf16_delta_encode_s"]
    best["reference_ratio"] = best["quantize_reference_s"] / best["bf16_delta_encode_s"]
    return best


def _mean(rows: list[dict], key: str) -> dict:
    return {k: sum(r[key][k] for r in rows) / len(rows) for k in rows[0][key]}


def _per_changed(rows: list[dict]) -> dict:
    """Each part's delta bytes per changed element over these versions, beyond a delta that changes nothing (what a
    planner multiplies densities by)."""
    return {k: sum(r["parts"][k]["delta_bytes"] - r["parts"][k]["empty_delta_bytes"] for r in rows)
            / max(sum(r["changed"][k] for r in rows), 1) for k in rows[0]["parts"]}


def run(pairs: list[tuple[str, float, Path, Path]], *, experts: int, dense_layers: int, rounds: int,
        schemes=SCHEME_NAMES) -> dict:
    """Every scheme on every (label, lr, base, new) pair, averaged per lr; timing on the first pair."""
    from wsync import backends, progress
    from wsync.quant import from_config

    out = {}
    states = [(label, lr, moe_shaped(load(b), experts, dense_layers), moe_shaped(load(n), experts, dense_layers))
              for label, lr, b, n in pairs]
    first = states[0][3]
    with progress.bar(len(schemes) * (len(states) + 1), "bench quant", unit="step", leave=False) as bar:
        for name in schemes:
            cfg = scheme_config(name)
            rows = []
            for label, lr, base, new in states:
                bar.set_postfix_str(f"{name} {label}")
                rows.append({"label": label, "lr": lr, **measure_pair(from_config(cfg), base, new)})
                bar.update()
            bar.set_postfix_str(f"{name} timing")
            t = timing(from_config(cfg), from_config(cfg, backend="ref"), states[0][2], first, rounds)
            bar.update()
            part, source = parts_of(from_config(cfg), first)
            out[name] = {"config": cfg, "quantized_weights": sum(s is not None for s in source.values()),
                         "tensors_in": len(first), "tensors_out": len(part), "versions": rows,
                         "per_version": {f"{lr:g}": {"bytes": _mean(sel, "bytes"),
                                                     "fraction_changed": _mean(sel, "fraction_changed"),
                                                     "bytes_per_changed": _per_changed(sel),
                                                     "versions": len(sel)}
                                         for lr in dict.fromkeys(r["lr"] for r in rows)
                                         for sel in [[r for r in rows if r["lr"] == lr]]},
                         "exact": all(r["exact"] for r in rows),
                         "timing": {**t, "rounds": rounds, "backend": str(backends.backend()),
                                    "quantize_kernel": quantize_kernel()}}
    return {"state": {"tensors": len(first), "elements": sum(t.numel for t in first.values()),
                      "bf16_bytes": sum(t.nbytes for t in first.values()), "experts": experts,
                      "dense_layers": dense_layers},
            "schemes": out}


def render(doc: dict) -> str:
    lines = [f"# wsync bench quant on {doc['hardware_line']}", "",
             f"{doc['source']}; {doc['state']['tensors']:,} tensors, {doc['state']['elements']:,} elements "
             f"({doc['state']['experts']} experts per MLP from layer {doc['state']['dense_layers']})", "",
             "Fractions changed per version (quantized weights' BF16 values, their codes, their scales; the BF16 "
             "values left unquantized) and bytes per version (full: raw; delta: packed tier):", "",
             "| scheme | bf16 (quantized) | codes | scales | bf16 (rest) | BF16 full | BF16 delta | quant full | "
             "quant delta | exact |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for name, s in doc["schemes"].items():
        for lr, per in s["per_version"].items():
            f, b = per["fraction_changed"], per["bytes"]
            lines.append(f"| {name}, lr {lr} | {f['bf16_quantized']:.3%} | {f['codes']:.3%} | {f['scales']:.3%} | "
                         f"{f['bf16_rest']:.3%} | {b['bf16_full']:,.0f} | {b['bf16_delta']:,.0f} | "
                         f"{b['quant_full']:,.0f} | {b['quant_delta']:,.0f} | {'yes' if s['exact'] else 'NO'} |")
    lines += ["", "Quantize (the Quantizer on the fastest host backend, and on the numpy reference) vs the BF16 delta "
                  "encode of the same state, best of interleaved rounds:", "",
              "| scheme | quantize s | BF16 delta encode s | ratio | quantize kernel | reference s | reference ratio |",
              "|---|---:|---:|---:|---|---:|---:|"]
    for name, s in doc["schemes"].items():
        t = s["timing"]
        lines.append(f"| {name} | {t['quantize_s']:.4f} | {t['bf16_delta_encode_s']:.4f} | {t['ratio']:.2f}x | "
                     f"{t['quantize_kernel']} | {t['quantize_reference_s']:.4f} | {t['reference_ratio']:.2f}x |")
    return "\n".join(lines)


def _pairs(a) -> list[tuple[str, float, Path, Path]]:
    from .snapshots import (SnapshotConfig, _cache_valid, announce, default_cache_dir, ensure_snapshots,
                            require_generator)

    cfgs = [_series(SnapshotConfig(size=a.size, lr=lr, steps=a.versions)) for lr in a.lr]
    missing = [c for c in cfgs if not _cache_valid(default_cache_dir(c), c)]
    if missing:
        require_generator(missing, instead="run it where transformers installs")
        announce(missing)
    out = []
    for cfg in cfgs:
        paths = ensure_snapshots(default_cache_dir(cfg), cfg)
        out += [(f"lr {cfg.lr:g}, step {k} -> {k + 1}", cfg.lr, paths[k], paths[k + 1]) for k in range(a.versions)]
    return out


def _series(cfg):
    """cfg, or the longer series of the same run already cached in its folder: its first steps are the same
    snapshots, and a shorter series would replace it there."""
    from dataclasses import asdict, replace

    from .snapshots import default_cache_dir, load_meta

    kept = (load_meta(default_cache_dir(cfg)) or {}).get("config") or {}
    if kept.get("steps", -1) > cfg.steps and kept == {**asdict(cfg), "steps": kept["steps"]}:
        return replace(cfg, steps=kept["steps"])
    return cfg


def command(a) -> str:
    """The command line that repeats this run."""
    return (f"wsync bench quant --size {a.size} --lr {' '.join(f'{x:g}' for x in a.lr)} --versions {a.versions} "
            f"--experts {a.experts} --dense-layers {a.dense_layers} --schemes {' '.join(a.schemes)} "
            f"--rounds {a.rounds}")


def main(a) -> None:
    from wsync.hardware import describe

    from .results import one_line, options, save, stem

    if a.versions < 1 or a.rounds < 1 or a.experts < 1 or a.dense_layers < 0:
        raise ValueError("--versions, --rounds and --experts must be >= 1, --dense-layers >= 0")
    hw = describe()
    pairs = _pairs(a)
    doc = {"kind": "wsync bench quant", "date": dt.datetime.now().isoformat(timespec="seconds"),
           "command": command(a), "options": options(a), "hardware": hw, "hardware_line": one_line(hw),
           "source": f"generated {a.size} snapshots, lr {', '.join(f'{x:g}' for x in a.lr)}, "
                     f"{a.versions} consecutive step(s) each", "size": a.size, "load_average_before": os.getloadavg()}
    doc.update(run(pairs, experts=a.experts, dense_layers=a.dense_layers, rounds=a.rounds,
                   schemes=tuple(a.schemes)))
    doc["load_average_after"] = os.getloadavg()
    text = render(doc)
    print(text)
    path = save(a.out, f"{stem(hw, doc['date'][:10])}-quant", doc, text)
    print(f"wrote {path} and .md")


def add_parsers(bench) -> None:
    p = bench.add_parser("quant", help="quantized weights (INT4 / INT8 / FP8) through the delta codec on real "
                                       "RL snapshots, and quantize time vs the BF16 delta encode",
                         description=__doc__.splitlines()[0],
                         epilog="Default small (7M params, one step at each lr, the series the benchmark tests "
                                "cache): seconds here (2 cores) once the snapshots are cached; --size bench "
                                "--versions 2 (the committed run): under a minute. Snapshots missing from the "
                                "cache are generated first (bench: about 15 min for both lrs), which needs "
                                "transformers (pip install -e \"./benchmarks[all]\").")
    p.add_argument("--size", default="small", choices=["tiny", "small", "bench"],
                   help="generated model size: tiny (0.2M params), small (7M), bench (64M); default small")
    p.add_argument("--lr", type=float, nargs="+", default=[1e-6, 1e-5],
                   help="learning rates of the snapshot series (default 1e-6 1e-5)")
    p.add_argument("--versions", type=int, default=1,
                   help="consecutive steps measured per series (default 1; the series is made this long)")
    p.add_argument("--experts", type=int, default=8, help="experts each MLP is cut into (default 8)")
    p.add_argument("--dense-layers", type=int, default=1,
                   help="leading layers whose MLP stays dense, as Kimi K2's first layer (default 1)")
    p.add_argument("--schemes", nargs="+", choices=SCHEME_NAMES, default=list(SCHEME_NAMES),
                   help="which quantizations (default all: kimi int8 fp8)")
    p.add_argument("--rounds", type=int, default=5, help="timed rounds of quantize and encode (default 5)")
    p.add_argument("--out", type=Path, default=None,
                   help="folder for <date>-<host>-quant.json/.md (default ~/.cache/wsync/results; "
                        "benchmarks/results for a run to commit)")
    p.add_argument("--quiet", action="store_true", help="no progress bars (they show only on a terminal anyway)")
    p.set_defaults(fn=main)
