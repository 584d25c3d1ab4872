"""Many small tensors vs one big one: what a version of a mixture-of-experts state costs per tensor.

    wsync bench codec --shape moe [--tensors 20000 --elems 1024 --density 0.01] [--json OUT]

Both states hold the same number of bf16 elements (20,000 x 1,024 = 20.48M by
default) with the same fraction changed by one or two representable steps;
only the number of tensors differs. Each is bound once (wsync.bind: the one
step that costs a Python call per tensor, reported apart as `bind`), then
every operation runs on both in the same process, interleaved, best of
`repeats` (and the quartiles of the per-round ratios): encode (packed), apply in place, payload bytes, and publish ->
live over a tcp loopback link (a Publisher and a Subscriber whose engine is
an nn.Module holding the tensors as parameters). The ratios many/one are
the result; the planner's per-tensor cost term comes from them.
"""
from __future__ import annotations

import datetime
import json
import time
from pathlib import Path

import numpy as np

from wsync.hardware import describe

from .results import one_line


def make_states(tensors: int, elems: int, density: float, seed: int = 0) -> dict:
    """{"one": (base, new), "many": (base, new)} as dicts of bf16 torch tensors, equal element for element."""
    rng = np.random.default_rng(seed)
    base = random_bf16(rng, tensors * elems)
    new = step(base, density, rng)
    width = len(str(tensors))
    names = [f"model.layers.{i // 384}.mlp.experts.{(i // 3) % 128}.{('gate', 'up', 'down')[i % 3]}_proj.{i:0{width}d}"
             for i in range(tensors)]
    return {"one": ({"w": _bf16(base)}, {"w": _bf16(new)}),
            "many": (cut(base, names, elems), cut(new, names, elems))}


def random_bf16(rng, n: int) -> np.ndarray:
    """n bf16 bit patterns of N(0, 0.02) values (weights at init scale), rounded from fp32."""
    x = (rng.standard_normal(n).astype(np.float32) * 0.02).view(np.uint32)
    return ((x + 0x8000) >> 16).astype(np.uint16)


def cut(flat: np.ndarray, names: list[str], elems: int) -> dict:
    """flat bf16 bits as len(names) separately allocated tensors of `elems` each."""
    return {nm: _bf16(flat[i * elems:(i + 1) * elems].copy()) for i, nm in enumerate(names)}


def step(bits: np.ndarray, density: float, rng) -> np.ndarray:
    """A copy of bf16 bit patterns with `density` of them moved by +-1 or +-2 representable values."""
    out = bits.copy()
    idx = np.flatnonzero(rng.random(len(bits)) < density)
    out[idx] = (out[idx].astype(np.int64) + rng.choice([-2, -1, 1, 2], size=len(idx))).astype(np.uint16)
    return out


def _bf16(bits: np.ndarray):
    import torch

    return torch.from_numpy(bits).view(torch.bfloat16)


class _Case:
    """One state pair bound once, with its encode and apply-in-place ready to time."""

    def __init__(self, base: dict, new: dict, backend: str | None):
        import wsync

        from wsync.layout import layout_of

        self.base, self.new, self.backend = base, new, backend
        self.b = wsync.bind(base)
        t0 = time.perf_counter()
        self.n = wsync.bind(new)  # the one step with a Python call per tensor, once per layout
        self.members = layout_of(self.n)
        self.bind_s = time.perf_counter() - t0
        self.target_src = {k: v.clone() for k, v in base.items()}
        # restoring the target between rounds: one call over the list (torch's multi-tensor copy), so neither
        # shape's next timed step follows a different kind of work (a 20,000-call Python loop vs one copy)
        self._restore = (list(self.target_src.values()), [base[k] for k in self.target_src])
        self.target = wsync.bind(self.target_src)
        # as the sync protocol's deltas do, the payload names its member table by hash (it went with a keyframe)
        self.payload = self.encode()
        self.times = {"encode_s": [], "apply_s": []}

    def encode(self):
        import wsync

        return wsync.encode(self.b, self.n, tier="packed", backend=self.backend, members=self.members, inline=False)

    def round(self) -> None:
        import torch

        import wsync

        t0 = time.perf_counter()
        self.encode()
        self.times["encode_s"].append(time.perf_counter() - t0)
        torch._foreach_copy_(*self._restore)
        t0 = time.perf_counter()
        wsync.apply(self.target, self.payload, inplace=True, backend=self.backend,
                    layouts={self.members.hash: self.members})
        self.times["apply_s"].append(time.perf_counter() - t0)

    def result(self) -> dict:
        import wsync

        info = wsync.inspect(self.payload)
        return {"bind_s": self.bind_s, **{k: min(v) for k, v in self.times.items()},
                "payload_bytes": info["payload_bytes"], "manifest_bytes": info["manifest_bytes"],
                "segments": info["segments"], "exact": _bytes(self.target_src) == _bytes(self.new)}


def codec_times(states: dict, repeats: int, backend: str | None = None) -> dict:
    """Encode / apply-in-place seconds (best of repeats) and payload bytes per shape, the shapes' rounds
    interleaved so both meet the same machine (these 2-core machines drift by tens of percent)."""
    cases = {shape: _Case(base, new, backend) for shape, (base, new) in states.items()}
    order = list(cases.values())
    for _ in range(repeats):
        for c in order:
            c.round()
        order.reverse()  # ABBA: each shape follows the other as often as it precedes it
    return {shape: c.result() for shape, c in cases.items()}, paired(cases["one"].times, cases["many"].times)


def paired(one: dict, many: dict) -> dict:
    """Quartiles of the per-round ratios many/one: each round's two shapes ran back to back, so a ratio of
    a pair is less moved by the machine's drift than a ratio of two minimums taken at different moments."""
    out = {}
    for k in one:
        r = np.asarray(many[k]) / np.asarray(one[k])
        q1, med, q3 = np.percentile(r, [25, 50, 75])
        out[k] = {"q1": float(q1), "median": float(med), "q3": float(q3), "rounds": len(r)}
    return out


def _bytes(state: dict) -> bytes:
    import torch

    return b"".join(t.view(torch.uint16).numpy().tobytes() for t in state.values())


def sync_times(base: dict, versions: list[dict], plain: bool = False) -> dict:
    """publish() -> committed on a Subscriber over tcp loopback, per delta version (after a keyframe).

    plain: publish a fresh dict of the same tensors every version, as publish(model.state_dict()) does,
    instead of the state bound once."""
    import torch

    import wsync

    model = torch.nn.Module()
    for i, (name, t) in enumerate(base.items()):
        model.register_parameter(f"p{i}", torch.nn.Parameter(t.clone(), requires_grad=False))
    rename = dict(zip((f"p{i}" for i in range(len(base))), base))
    trainer_src = {k: v.clone() for k, v in base.items()}
    trainer = wsync.bind(trainer_src)
    engine = wsync.engines.HF(model, rename=lambda n: rename[n])
    times = []
    with wsync.Publisher("tcp://127.0.0.1:0", codec="delta", keyframe_every=0) as pub:
        with wsync.Subscriber(pub.address, engine=engine) as sub:
            pub.publish(trainer, version=0)
            sub.wait_for(0, timeout=300)
            for v, state in enumerate(versions, start=1):
                for k, t in trainer_src.items():
                    t.copy_(state[k])
                state = {k: t.detach() for k, t in trainer_src.items()} if plain else trainer
                t0 = time.perf_counter()
                pub.publish(state, version=v)
                sub.wait_for(v, timeout=300)
                times.append(time.perf_counter() - t0)
            held = {rename[n]: p.detach() for n, p in model.named_parameters()}
            exact = _bytes({k: held[k] for k in base}) == _bytes(versions[-1])
            pub.flush(timeout=60)  # its bytes are recorded when the encoding ends, which may follow the commit
            nbytes = pub.stats.bytes.get(len(versions))
    key = "publish_live_plain_s" if plain else "publish_live_s"
    out = {key: min(times), f"{key[:-2]}_all_s": times, f"exact{'_plain' if plain else ''}": exact}
    return out if plain else {**out, "version_bytes": nbytes}


def dense_shapes(layers: int = 9, hidden: int = 384, inter: int = 1152, kv: int = 128, head: int = 64,
                 vocab: int = 8000) -> dict:
    """A small dense Qwen3-shaped state (102 tensors, ~21.6M params by default): names and shapes only."""
    out = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        out.update({p + "self_attn.q_proj.weight": (hidden, hidden), p + "self_attn.k_proj.weight": (kv, hidden),
                    p + "self_attn.v_proj.weight": (kv, hidden), p + "self_attn.o_proj.weight": (hidden, hidden),
                    p + "self_attn.q_norm.weight": (head,), p + "self_attn.k_norm.weight": (head,),
                    p + "mlp.gate_proj.weight": (inter, hidden), p + "mlp.up_proj.weight": (inter, hidden),
                    p + "mlp.down_proj.weight": (hidden, inter), p + "input_layernorm.weight": (hidden,),
                    p + "post_attention_layernorm.weight": (hidden,)})
    out.update({"model.norm.weight": (hidden,), "lm_head.weight": (vocab, hidden)})
    return out


def manifest_share(density: float = 0.004, seed: int = 0) -> dict:
    """Bytes of the manifest in a packed delta of a small dense model: inline layout (a file) vs by hash (sync)."""
    import wsync

    rng = np.random.default_rng(seed)
    base, new = {}, {}
    for name, shape in dense_shapes().items():
        b = random_bf16(rng, int(np.prod(shape)))
        base[name], new[name] = _bf16(b).reshape(shape), _bf16(step(b, density, rng)).reshape(shape)
    out = {"tensors": len(base), "params": sum(int(t.numel()) for t in base.values()), "density": density}
    for inline in (True, False):
        info = wsync.inspect(wsync.encode(base, new, tier="packed", inline=inline))
        out["inline" if inline else "by_hash"] = {"payload_bytes": info["payload_bytes"],
                                                 "manifest_bytes": info["manifest_bytes"],
                                                 "share": info["manifest_bytes"] / info["payload_bytes"]}
    return out


def run(tensors: int = 20_000, elems: int = 1024, density: float = 0.01, repeats: int = 31, versions: int = 4,
        backend: str | None = None) -> dict:
    states = make_states(tensors, elems, density)
    rng = np.random.default_rng(1)
    out = {"tensors": tensors, "elems": elems, "density": density, "results": {}}
    out["results"], out["paired_ratios"] = codec_times(states, repeats, backend)
    # deltas of the same chain for both shapes: version k moves base k times
    import torch

    chain, cur = [], states["one"][0]["w"].view(torch.uint16).numpy()
    for _ in range(versions):
        cur = step(cur, density, rng)
        chain.append(cur)
    for shape, (base, _) in states.items():
        vs = [{"w": _bf16(c)} for c in chain] if shape == "one" else [cut(c, list(base), elems) for c in chain]
        out["results"][shape].update(sync_times(base, vs))
        out["results"][shape].update(sync_times(base, vs, plain=True))
    one, many = out["results"]["one"], out["results"]["many"]
    out["ratios"] = {k: many[k] / one[k] for k in ("encode_s", "apply_s", "payload_bytes", "publish_live_s",
                                                   "publish_live_plain_s")}
    # the default path against the bound one-tensor state: what a user who never calls bind pays per tensor
    out["ratios"]["plain_many_vs_bound_one"] = many["publish_live_plain_s"] / one["publish_live_s"]
    out["per_tensor_s"] = {k: (many[k] - one[k]) / (tensors - 1) for k in ("encode_s", "apply_s", "publish_live_s")}
    out["dense_manifest"] = manifest_share()
    return out


def render(res: dict) -> str:
    one, many = res["results"]["one"], res["results"]["many"]
    n = res["tensors"]
    rows = [("encode (packed)", "encode_s", "{:.4f} s"), ("apply in place", "apply_s", "{:.4f} s"),
            ("payload", "payload_bytes", "{:,.0f} B"), ("publish -> live, tcp loopback", "publish_live_s", "{:.4f} s"),
            ("publish(state_dict()) -> live, a fresh dict each version", "publish_live_plain_s", "{:.4f} s")]
    lines = [f"| state ({n * res['elems'] / 1e6:.2f}M bf16 elements, {res['density']:.0%} changed) | 1 tensor | "
             f"{n:,} tensors x {res['elems']:,} | many / one |", "|---|---:|---:|---:|"]
    pr = res.get("paired_ratios", {})
    for label, key, fmt in rows:
        p = f" (rounds: median {pr[key]['median']:.2f}x, quartiles {pr[key]['q1']:.2f}-{pr[key]['q3']:.2f})" if key in pr else ""
        lines.append(f"| {label} | {fmt.format(one[key])} | {fmt.format(many[key])} | {many[key] / one[key]:.2f}x{p} |")
    lines.append(f"| bind (once per layout) | {one['bind_s']:.4f} s | {many['bind_s']:.4f} s | |")
    lines.append(f"| manifest of the delta | {one['manifest_bytes']:,} B | {many['manifest_bytes']:,} B | |")
    lines.append(f"\nexact: one {one['exact']}, many {many['exact']} (fresh dicts: {many['exact_plain']}); "
                 f"{n:,} tensors as a fresh dict against 1 bound: {res['ratios']['plain_many_vs_bound_one']:.2f}x; "
                 "per extra tensor: "
                 + ", ".join(f"{k[:-2]} {v * 1e9:,.0f} ns" for k, v in res["per_tensor_s"].items()))
    d = res.get("dense_manifest")
    if d:
        lines.append(f"\nManifest of a packed delta of a dense model ({d['tensors']} tensors, {d['params'] / 1e6:.1f}M "
                     f"params, {d['density']:.1%} changed): {d['by_hash']['manifest_bytes']:,} B of "
                     f"{d['by_hash']['payload_bytes']:,} ({d['by_hash']['share']:.2%}) with the layout named by hash "
                     f"(sync deltas); {d['inline']['manifest_bytes']:,} B ({d['inline']['share']:.2%}) with it inline "
                     "(keyframes, files).")
    return "\n".join(lines)


def main(a) -> None:
    hw = describe()
    print(f"# wsync bench codec --shape moe on {one_line(hw)}\n", flush=True)
    res = run(a.tensors, a.elems, a.density, a.repeats)
    print(render(res))
    if a.json:
        doc = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "hardware": hw, **res}
        Path(a.json).write_text(json.dumps(doc, indent=2, default=str))
        print(f"wrote {a.json}")
