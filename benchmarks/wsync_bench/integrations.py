"""What an integration's sync costs: per-version time and wire bytes, delta vs raw through the same path.

Each path runs as the framework drives it (verl's send/receive pair, OpenRLHF's broadcast_to_vllm into
its WorkerWrap, prime-rl's broadcast_weights into a sidecar writing step folders; slime uses the same
sidecar path), trainer and engine in one process over tcp loopback, a Qwen3-architecture model in bf16,
RL-like steps (~1% of elements move by 1-2 ulp). Every version is checked byte for byte.

    wsync bench integrations --versions 5 --json benchmarks/results/<date>-<hw>-integrations.json

The model steps and byte checks are the tests' (tests/engine_helpers.py), so this suite runs from a checkout.
"""
from __future__ import annotations

import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

TESTS = Path(__file__).resolve().parents[2] / "tests"  # the checkout's: rl_step and same_bytes

TOKEN = "77" * 16


def model(seed: int, hidden: int, layers: int):
    import torch
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.Qwen3Config(vocab_size=8192, hidden_size=hidden, intermediate_size=hidden * 3,
                                   num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                   head_dim=hidden // 4, tie_word_embeddings=False)
    return transformers.Qwen3ForCausalLM(cfg).to(torch.bfloat16).eval()


def run_verl(trainer, served, codec, versions, gen):
    from wsync.integrations.verl import WsyncCheckpointEngineCore as CE

    a = CE(64 << 20, is_master=True, address="tcp://127.0.0.1:0", token=TOKEN, codec=codec)
    r = CE(64 << 20, token=TOKEN)
    ak, rk = CE.build_topology(1, 1, [a.prepare(), r.prepare()])
    a.init_process_group(**{k: v[0] for k, v in ak.items()})
    r.init_process_group(**{k: v[0] for k, v in rk.items()})
    params = dict(served.named_parameters())

    async def one(step):
        async def recv():
            async for n, t in r.receive_weights(global_steps=step):
                params[n].data.copy_(t)
        await asyncio.gather(a.send_weights(iter(list(trainer.named_parameters())), global_steps=step), recv())

    try:
        return _loop(lambda v: asyncio.run(one(v)), trainer, served, versions, gen, a.pub)
    finally:
        a.close(), r.close()


def run_openrlhf(trainer, served, codec, versions, gen):
    import importlib.util

    import torch

    import wsync.integrations.openrlhf as wo

    spec = importlib.util.find_spec("openrlhf")
    if spec is None:
        return None
    path = Path(spec.origin).parent / "trainer" / "ray" / "vllm_worker_wrap.py"
    ms = importlib.util.spec_from_file_location("openrlhf.trainer.ray.vllm_worker_wrap", path)
    mod = importlib.util.module_from_spec(ms)
    ms.loader.exec_module(mod)
    sys.modules[ms.name] = mod
    wo.patch_worker()

    class Served(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.inner = m

        def load_weights(self, weights):
            p = dict(self.inner.named_parameters())
            for n, t in weights:
                p[n].data.copy_(t)

    worker = mod.WorkerWrap()
    worker.model_runner = SimpleNamespace(model=Served(served))
    handle = SimpleNamespace(init_process_group=SimpleNamespace(remote=worker.init_process_group),
                             update_weight=SimpleNamespace(remote=worker.update_weight))
    args = SimpleNamespace(vllm=SimpleNamespace(sync_backend="wsync", tensor_parallel_size=1),
                           ds=SimpleNamespace(zero_stage=2, tensor_parallel_size=1))
    me = SimpleNamespace(strategy=SimpleNamespace(args=args), vllm_engines=[handle],
                         actor=SimpleNamespace(model=SimpleNamespace(module=trainer)))
    wo._CONFIG = wo.SyncConfig(address="tcp://127.0.0.1:0", token=TOKEN, codec=codec)
    wo.init_vllm_sync_group(me, "wsync")
    try:
        return _loop(lambda v: wo.broadcast_to_vllm(me), trainer, served, versions, gen, me._wsync_pub)
    finally:
        me._wsync_pub.close(), worker._wsync_sub.close(), wo.unpatch()


def run_prime_rl(trainer, served, codec, versions, gen):
    from safetensors.torch import load_file

    import wsync.integrations.prime_rl as wp

    with tempfile.TemporaryDirectory() as d:
        wp._CONFIG = wp.SyncConfig(address="tcp://127.0.0.1:0", token=TOKEN, codec=codec)
        bc = wp.WsyncWeightBroadcast(Path(d) / "run", hf_state=lambda m: m.state_dict())
        side = wp.sidecar(wp._CONFIG.dial_address(bc._pub), Path(d) / "infer", token=TOKEN)

        def step(v):
            bc.broadcast_weights(trainer, v)
            served.load_state_dict(load_file(wp.step_dir(Path(d) / "infer", v) / "model.safetensors"))
        try:
            return _loop(step, trainer, served, versions, gen, bc._pub)
        finally:
            side.close(), bc.close()


def _loop(sync, trainer, served, versions, gen, pub):
    from engine_helpers import rl_step, same_bytes

    times = []
    for v in range(versions + 1):
        rl_step(trainer, gen, density=0.01)
        t0 = time.perf_counter()
        sync(v)
        dt = time.perf_counter() - t0
        assert same_bytes(trainer.state_dict(), served.state_dict()), f"version {v} differs"
        if v > 0:  # version 0 is the first (raw) sync in both modes
            times.append(dt)
    full = sum(t.nbytes for t in trainer.state_dict().values())
    pub.flush(timeout=60)  # the last version's bytes are recorded when its encoding ends, maybe after its commit
    wire = [pub.stats.bytes.get(v) or full for v in range(1, versions + 1)]
    return {"s_per_version": sorted(times)[len(times) // 2], "wire_mb": sum(wire) / len(wire) / 1e6,
            "model_mb": full / 1e6}


def add_parsers(bench) -> None:
    ap = bench.add_parser("integrations", help="an integration's sync per version, delta vs raw (verl, OpenRLHF, "
                                               "prime-rl/slime)", description=__doc__.splitlines()[0],
                          epilog="Default 4 versions of a 512-wide, 4-layer model: about 15 s here (2 cores); a "
                                 "framework that is not installed is skipped.")
    ap.add_argument("--versions", type=int, default=4, help="versions synced per path and codec (default 4)")
    ap.add_argument("--hidden", type=int, default=512, help="hidden size of the model (default 512)")
    ap.add_argument("--layers", type=int, default=4, help="decoder layers of the model (default 4)")
    ap.add_argument("--json", help="also write the results here")
    ap.set_defaults(fn=main)


def main(a) -> None:
    import torch

    from wsync.hardware import describe

    if str(TESTS) not in sys.path:
        sys.path.insert(0, str(TESTS))

    rows = []
    for name, fn in (("verl", run_verl), ("openrlhf", run_openrlhf), ("prime_rl/slime sidecar", run_prime_rl)):
        res = {}
        for codec in ("raw", "delta"):
            gen = torch.Generator().manual_seed(1)
            res[codec] = fn(model(0, a.hidden, a.layers), model(1, a.hidden, a.layers), codec, a.versions, gen)
        if res["raw"] is None:
            print(f"{name}: framework not installed, skipped")
            continue
        row = {"integration": name, **{f"{c}_{k}": v for c in res for k, v in res[c].items()},
               "speedup": res["raw"]["s_per_version"] / res["delta"]["s_per_version"]}
        rows.append(row)
        print(f"{name:24s} model {row['raw_model_mb']:.1f} MB | raw {row['raw_s_per_version']:.3f} s "
              f"{row['raw_wire_mb']:.2f} MB | delta {row['delta_s_per_version']:.3f} s {row['delta_wire_mb']:.2f} MB "
              f"| delta vs raw {row['speedup']:.2f}x")
    args = {"versions": a.versions, "hidden": a.hidden, "layers": a.layers, "json": a.json}
    out = {"hardware": describe(), "backend": str(__import__("wsync").backend()), "args": args, "rows": rows,
           "when": time.strftime("%Y-%m-%dT%H:%M:%S")}
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))

