"""What `wsync plan ...` prints: plain tables for people, the same rows as JSON for scripts."""
from __future__ import annotations

import dataclasses
import json

from . import measured
from . import published_tables as tables
from .codec_speeds import CodecSpeed, TensorCost
from .gpu_speeds import codec_speed
from .gpu_sync import NO_RUN, e2e_tensor_cost, newest_gpu_sync, stage_lines
from .loop import SimulatedLoop, decode_curve_table
from .lora import LoraConfig, lora_size
from .models import PlanError, get_model, model_names
from .params import active_params, checkpoint_bytes, checkpoint_parts, total_params
from .published import (LORA_TABLE, RDMA_GBIT, RESHARD_RANKS, RESHARD_TABLE, TCP_GBIT, TRANSFER_TABLE, USD_PER_GPU_S,
                        WAN_DELTA_SAVING, WAN_GBIT, WAN_TABLE, audit, exact, gpu_count, in_cluster_row, notes,
                        recomputed, reshard_lines, seconds, wan_row, wan_row_figures)
from .quant import layout_name, quantized_delta
from .reshard import plan_for
from .sandboxes import SandboxConfig, plan_sandboxes
from .sim import simulate
from .sweep import as_rows, plot, sweep
from .transfer import parse_codec, parse_link, reshard_cost, sync_cost
from .validate import TOLERANCE, validate, validate_runs

PUBLISHED_MODELS = ["qwen3-8b", "qwen3-30b-a3b", "glm-4.7", "kimi-k2.6"]


def _table(rows: list[dict], cols: list[tuple[str, str]]) -> str:
    """Left-aligned text columns; `cols` is (key, format) with format '' for str()."""
    cells = [[h for h, _ in cols]] + [[format(r[k], f) if f else str(r[k]) for k, f in cols] for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(cols))]
    left = [not f for _, f in cols]  # text columns read left-aligned, numbers right-aligned
    return "\n".join("  ".join(c[i].ljust(widths[i]) if left[i] else c[i].rjust(widths[i]) for i in range(len(cols)))
                     for c in cells)


def _json(obj) -> None:
    print(json.dumps(obj, indent=2, default=lambda o: dataclasses.asdict(o) if dataclasses.is_dataclass(o) else str(o)))


def cmd_models(a) -> None:
    rows = []
    for n in model_names():
        m = get_model(n)
        rows.append({"model": n, "params_b": total_params(m) / 1e9, "active_b": active_params(m) / 1e9,
                     "checkpoint_gb": checkpoint_bytes(m) / 1e9, "source": m.source})
    if a.json:
        return _json(rows)
    print(_table(rows, [("model", ""), ("params_b", ".2f"), ("active_b", ".2f"), ("checkpoint_gb", ".1f"), ("source", "")]))
    print("params/active in billions (active: embeddings + LM head + visited experts); GB = 1e9 bytes")


def _published_json() -> dict:
    figs = [{"table": x.table, "model": x.row, "column": x.column, "published": x.published.text,
             "published_value": exact(x.published.value),
             "recomputed": [{"how": how, "value": exact(v), "shown": x.published.show(v),
                             "rounds_to_published": x.published.rounds_to(v)} for how, v in x.ways]}
            for x in recomputed()]
    return {"source": tables.SOURCE,
            "tables": {"1": {"title": tables.IN_CLUSTER_TITLE, "inputs": tables.IN_CLUSTER_INPUTS,
                             "columns": tables.IN_CLUSTER_COLUMNS, "rows": [r.cells for r in tables.IN_CLUSTER]},
                       "2": {"title": tables.WAN_TITLE, "inputs": tables.WAN_INPUTS, "columns": tables.WAN_COLUMNS,
                             "rows": [r.cells for r in tables.WAN]}},
            "recomputed": figs, "notes": notes(),
            "checks": [dict(dataclasses.asdict(c), error_vs_model=c.error()) for c in audit()],
            "reshard": reshard_lines()}


def _mark(x, i: int) -> str:
    """A recomputation in the published figure's unit, with a '!' where it does not round to the figure."""
    v = x.ways[i][1]
    return x.published.show(v) + ("" if x.published.rounds_to(v) else " !")


def _published(a) -> None:
    if a.json:
        return _json(_published_json())
    print(f"The published tables ({tables.SOURCE}), every figure beside wsync's recomputation from the inputs "
          "the table states.\n'!' marks a recomputation that does not round to the published figure; notes below.\n")
    i1 = tables.IN_CLUSTER_INPUTS
    print(f"Table 1: {tables.IN_CLUSTER_TITLE}. Inputs: {i1['tcp_gbit_per_s']} Gbit/s TCP, "
          f"{exact(RDMA_GBIT / 1000)} Tbit/s RDMA, ${i1['usd_per_gpu_s']} per GPU-second x the reference GPU count.")
    rows = []
    for r in tables.IN_CLUSTER:
        tcp, rdma, usd = in_cluster_row(r)
        rows.append({"model": r.cells[0], "size": r.cells[1], "tcp": tcp.published.text, "tcp_from_size": _mark(tcp, 0),
                     "rdma": rdma.published.text, "rdma_from_size": _mark(rdma, 0),
                     "gpus": f"{r.cells[4]} = {gpu_count(r.cells[4])}", "saving": usd.published.text,
                     "from_printed_times": _mark(usd, 0), "from_recomputed_times": _mark(usd, 1)})
    print(_table(rows, [(k, "") for k in rows[0]]))
    print(f"saving = (TCP s - RDMA s) x GPUs x ${i1['usd_per_gpu_s']}: from the printed times, and from the times "
          "recomputed from the size\n")
    i2 = tables.WAN_INPUTS
    print(f"Table 2: {tables.WAN_TITLE}. Inputs: {i2['wan_gbit_per_s']} Gbit/s WAN, delta compression saves "
          f"{exact(WAN_DELTA_SAVING * 100)}% of the weight update.")
    rows = []
    for r in tables.WAN:
        full, delta = wan_row_figures(r)
        rows.append({"model": r.cells[0], "size": r.cells[1], "full": full.published.text,
                     "full_from_size": _mark(full, 0), "delta": delta.published.text,
                     "delta_of_printed_full": _mark(delta, 0), "delta_of_recomputed_full": _mark(delta, 1)})
    print(_table(rows, [(k, "") for k in rows[0]]))
    print("\nNotes on figures that do not follow from their inputs, and on the sizes:")
    for note in notes():
        print(" -", note)

    print("\nThe same figures from the model configs (`wsync plan models`; GB = 1e9 bytes):\n")
    gb = {n: checkpoint_bytes(get_model(n)) / 1e9 for n, *_ in TRANSFER_TABLE}
    print(_table([{"model": n, "gb": gb[n], "tcp_50g_s": seconds(gb[n], float(TCP_GBIT)),
                   "rdma_3_2t_s": seconds(gb[n], float(RDMA_GBIT))} for n, *_ in TRANSFER_TABLE],
                 [("model", ""), ("gb", ".1f"), ("tcp_50g_s", ".2f"), ("rdma_3_2t_s", ".3f")]))
    print()
    print(_table([dict(zip(("model", "full_s", "delta_s", "usd_saved"), (n, *wan_row(n)))) for n, *_ in WAN_TABLE],
                 [("model", ""), ("full_s", ".2f"), ("delta_s", ".3f"), ("usd_saved", ".4f")]))
    print(f"WAN {exact(WAN_GBIT)} Gbit/s; delta saves {exact(WAN_DELTA_SAVING * 100)}% of bytes; usd_saved = idle "
          f"GPU-seconds saved per sync x ${exact(USD_PER_GPU_S)}, per GPU\n")
    print(_table([{"model": n, "layout": lay, "rank": r, "gb": lora_size(get_model(n), LoraConfig(rank=r, layout=lay)).bytes
                   / 1e9} for n, lay, r, _ in LORA_TABLE], [("model", ""), ("layout", ""), ("rank", "d"), ("gb", ".2f")]))
    print("\nEach figure against the published one:\n")
    checks = audit()
    rows = [{"figure": c.figure, "published": f"{c.published:.6g}",
             "own": "-" if c.from_own_numbers is None else f"{c.from_own_numbers:.6g}", "model": c.from_model,
             "err": f"{c.error():.2%}", "tol": f"{c.tolerance:.1%}", "ok": "yes" if c.error() <= c.tolerance else "NO"}
            for c in checks]
    print(_table(rows, [("figure", ""), ("published", ""), ("own", ""), ("model", ".4g"), ("err", ""), ("tol", ""),
                        ("ok", "")]))
    print("own = recomputed from the table's stated inputs; model = from the model config; tol = 1% (a LoRA row's "
          "figures 3%) plus the published figure's own rounding")
    print("\nSharded trainers into sharded engines (busiest link = total / min(M, N)):")
    print("\n".join(reshard_lines()))


def _speed_label(speed) -> str:
    """A short name for the table: the backend measured, the GPU a bound is for, or 'given'."""
    return "given" if speed.basis == "given" else speed.backend or "?"


def cmd_transfer(a) -> None:
    if a.published:
        return _published(a)

    models = [get_model(n) for n in (a.model or PUBLISHED_MODELS)]
    links = [parse_link(s) for s in (a.link or ["tcp-50g", "rdma-3.2t", "wan-10g"])]
    lora = LoraConfig(rank=a.lora_rank, layout=a.lora_layout)
    codecs = [parse_codec(k, saving=a.delta_saving, lora=lora) for k in (a.codec or ["full", "delta", "lora"])]
    per_tensor = None
    if a.per_tensor_us is not None:
        per_tensor = TensorCost(encode_s=a.per_tensor_us * 1e-6, apply_s=a.per_tensor_us * 1e-6,
                                source=f"{a.per_tensor_us} us per tensor at each end, given on the command line")
    sharded = _sharded(a, models)
    e2e = _gpu_e2e(a.backend)
    rows, speeds = [], {}
    for c in codecs:
        c = dataclasses.replace(c, tier=a.tier)
        speed = codec_speed(c.kind, saving=c.saving, tier=c.tier, backend=a.backend)
        tensor_cost = per_tensor
        if tensor_cost is None and e2e and speed.source.startswith(e2e.where):
            tensor_cost = e2e_tensor_cost(c.kind, e2e)  # None without the moe stages: the default then
        if a.encode_gbps or a.apply_gbps:
            speed = CodecSpeed(encode_gbps=a.encode_gbps or speed.encode_gbps, apply_gbps=a.apply_gbps or
                               speed.apply_gbps, saving=speed.saving, basis="given", backend=speed.backend,
                               source=f"given on the command line (otherwise: {speed.source})")
        speeds[c.label] = speed
        for m in models:
            for link in links:
                kw = dict(speed=speed, dtype=a.dtype, buckets=a.buckets, usd_per_gpu_s=a.usd_per_gpu_s,
                          per_tensor=tensor_cost)
                if sharded:
                    s = reshard_cost(m, link, c, a.trainer_ranks, a.engine_ranks, **sharded[m.name], **kw)
                else:
                    s = sync_cost(m, link, c, encode_workers=a.encode_workers, apply_workers=a.apply_workers, **kw)
                rows.append(dict(dataclasses.asdict(s), gb=s.wire_bytes / 1e9, total_gb=s.total_bytes / 1e9, idle_usd=s.idle_usd_per_gpu * a.gpus,
                                 wire_usd=s.wire_s * a.usd_per_gpu_s * a.gpus, speeds=_speed_label(speed),
                                 speed_basis=speed.basis, encode_gbps=speed.encode_gbps, apply_gbps=speed.apply_gbps,
                                 **_e2e_field(a.backend, e2e), **_quant_fields(m, c, a.dtype)))
    rows.sort(key=lambda r: [m.name for m in models].index(r["model"]))  # one model's rows together
    if a.json:
        return _json(rows)
    if sharded:
        return _print_sharded(a, rows)
    print(_table(rows, [("model", ""), ("codec", ""), ("link", ""), ("gb", ".3f"), ("wire_s", ".3f"), ("encode_s", ".2f"),
                        ("apply_s", ".2f"), ("tensors", ","), ("tensor_s", ".3f"), ("pipelined_s", ".2f"),
                        ("dominant", ""), ("wire_usd", ".4f"), ("idle_usd", ".4f"), ("speeds", "")]))
    print(f"wire_s = bytes / line rate (what published tables print); encode/apply at the codec speeds below, "
          f"{a.encode_workers} encode and {a.apply_workers} apply worker(s), pipelined over {a.buckets} buckets.")
    print(f"wire_usd / idle_usd = wire / pipelined time x {a.gpus} GPU(s) x ${a.usd_per_gpu_s}/GPU-s, per step.")
    print("tensors = state_dict tensors with experts named one by one; tensor_s = the part of encode + apply "
          "that is a cost per tensor, not per byte (included in encode_s / apply_s).")
    print(f"codec speeds (GB/s of model bytes per worker, --backend {a.backend}):")
    for label, sp in speeds.items():
        kind = {"measured": "measured", "bound": "BOUND, not measured", "given": "given"}[sp.basis]
        print(f"  {label}: encode {sp.encode_gbps:.4g}, apply {sp.apply_gbps:.4g} GB/s, {kind}; {sp.source}")
    if all(sp.basis == "measured" and not sp.backend.startswith("cuda") for sp in speeds.values()):
        print("  these are CPU speeds; a GPU trainer encodes on the GPU: --backend cuda (a measured cuda run, else "
              "the H100 bandwidth bound) or --backend gpu-bound:h200")
    for src in dict.fromkeys(r["tensor_source"] for r in rows):
        print("per-tensor cost:", src)
    for m in models:
        for line in _quant_lines(m, codecs, a.dtype):
            print(line)
    print(f"measured inputs: {measured.WHERE}")
    _print_e2e(a.backend, e2e)


def _quant_fields(m, codec, dtype) -> dict:
    """A quantized checkpoint's rows: its layout in GB, and the measured delta its delta row is sized from."""
    if not m.quant or dtype is not None or codec.kind == "lora":
        return {}
    out = {"layout_gb": {k: v / 1e9 for k, v in checkpoint_parts(m).items()}}
    qd = quantized_delta(m) if codec.kind == "delta" and codec.quant_measured else None
    if qd is not None:
        out["quant_delta"] = {"source": qd.source, "parts": {k: dict(dataclasses.asdict(p), delta_gb=p.delta_bytes / 1e9)
                                                           for k, p in qd.parts.items()}}
    return out


def _quant_lines(m, codecs, dtype) -> list[str]:
    """What a quantized checkpoint's full and delta rows are made of, and where the delta's densities come from."""
    if not m.quant or dtype is not None:
        return []
    parts, out = checkpoint_parts(m), []
    names = {"codes": f"INT{m.quant.bits} codes", "scales": "scales", "shapes": "weight_shape", "rest": "BF16 rest"}
    if any(c.kind == "full" for c in codecs):
        out.append(f"{m.name} full {layout_name(m)}: the checkpoint as stored, "
                   + " + ".join(f"{names[k]} {v / 1e9:.3f} GB" for k, v in parts.items())
                   + f" = {sum(parts.values()) / 1e9:.3f} GB")
    delta = next((c for c in codecs if c.kind == "delta"), None)
    qd = quantized_delta(m) if delta is not None and delta.quant_measured else None
    if qd is not None:
        terms = " + ".join(f"{names[k]} {p.fraction_changed:.3%} changed x {p.bytes_per_changed:.2f} B = "
                           f"{p.delta_bytes / 1e9:.3f} GB" for k, p in qd.parts.items())
        out.append(f"{m.name} delta {qd.layout}, per version: {terms}; {qd.bytes / 1e9:.3f} GB. Measured: {qd.source} "
                   "(--delta-saving prices it as a fraction of the checkpoint instead)")
    elif delta is not None and delta.quant_measured:
        out.append(f"{m.name} delta: no measured run of its {layout_name(m)} format in the measured inputs "
                   f"(`wsync bench quant`), so it is {delta.saving:.0%} of the checkpoint, as for the other models")
    return out


def _is_cuda(backend: str) -> bool:
    return backend.lower().partition(":")[0] == "cuda"


def _gpu_e2e(backend: str):
    """--backend cuda[:GPU]: the newest whole sync measured on a GPU (None: none yet, or another backend)."""
    if not _is_cuda(backend):
        return None

    return newest_gpu_sync(gpu=backend.lower().partition(":")[2] or None)


def _e2e_field(backend: str, run) -> dict:
    """The rows' `gpu_e2e` (cuda backend only): the run priced from, or why there is none."""
    if not _is_cuda(backend):
        return {}

    return {"gpu_e2e": run.where if run else f"{NO_RUN}: priced as before"}


def _print_e2e(backend: str, run) -> None:
    if not _is_cuda(backend):
        return

    if run is None:
        print(f"end to end: {NO_RUN}. Priced as before, from a measured cuda codec run or else the HBM bound, which "
              "time the kernels only, not the copies, checksums and transport around them in a real sync.")
        return
    print(f"end to end, measured: {run.where}; the codecs priced from it name it above:")
    for line in stage_lines(run):
        print("  " + line)


def _sharded(a, models) -> dict:
    """--trainer-ranks/--engine-ranks: per model, where the busiest link's bytes come from ({} when not sharded)."""
    if a.trainer_ranks is None and a.engine_ranks is None:
        return {}
    if not (a.trainer_ranks and a.engine_ranks) or a.trainer_ranks < 1 or a.engine_ranks < 1:
        raise PlanError("a sharded sync needs both --trainer-ranks and --engine-ranks, each >= 1")
    out = {m.name: {} for m in models}
    if a.from_plan:
        for m in models:
            trainer, engine = f"fsdp:{a.trainer_ranks}", f"vllm:tp={a.engine_ranks}"
            try:
                p = plan_for(m, trainer, engine)
            except PlanError as e:
                out[m.name] = {"basis": f"total / min(M, N) (no plan: {str(e).split(': ', 1)[-1][:80]})"}
                continue
            out[m.name] = {"busiest_full_bytes": max(p.bytes_by_trainer() + p.bytes_by_engine()),
                           "basis": f"plan {trainer} -> {engine} ({p.hash[:12]})"}
    return out


def _print_sharded(a, rows) -> None:
    print(_table(rows, [("model", ""), ("codec", ""), ("link", ""), ("total_gb", ".3f"), ("gb", ".3f"),
                        ("wire_s", ".3f"), ("encode_s", ".3f"), ("apply_s", ".3f"), ("pipelined_s", ".3f"),
                        ("dominant", ""), ("busiest_basis", "")]))
    print(f"{a.trainer_ranks} trainer ranks -> {a.engine_ranks} engine ranks, each rank over its own link: gb / wire_s "
          "= the busiest rank's bytes and their time; encode/apply on all ranks at once (per rank: total / M, "
          "total / N).")

    for name in dict.fromkeys(r["model"] for r in rows):
        if (a.trainer_ranks, a.engine_ranks) == RESHARD_RANKS and any(t[1] == name for t in RESHARD_TABLE):
            print("\n".join(reshard_lines(name)))


def cmd_lora(a) -> None:
    m = get_model(a.model)
    cfg = LoraConfig(rank=a.rank, layout=a.layout, targets=tuple(a.targets), dtype=a.dtype, include_mtp=not a.no_mtp)
    size = lora_size(m, cfg)
    out = {"model": m.name, "rank": a.rank, "layout": a.layout, "dtype": a.dtype, "targets": a.targets,
           "params": size.params, "bytes": size.bytes, "gb": size.bytes / 1e9, "by_module": size.by_module}
    if a.json:
        return _json(out)
    print(f"{m.name} LoRA r={a.rank} {a.layout} ({a.dtype}): {size.params / 1e6:,.1f}M params, {size.bytes / 1e9:.3f} GB")
    for k, v in sorted(size.by_module.items(), key=lambda kv: -kv[1]):
        print(f"  {k:<28} {v / 1e6:>12,.2f}M")


def _loop_config(a):
    fields = {f.name for f in dataclasses.fields(SimulatedLoop)} - {"decode_curve"}
    kw = {k: getattr(a, k) for k in fields if hasattr(a, k)}
    if getattr(a, "decode_curve", ""):
        try:
            kw["decode_curve"] = tuple((int(b), float(t)) for b, t in (p.split(":") for p in a.decode_curve.split(",")))
        except ValueError as e:
            raise PlanError(f"--decode-curve wants 'batch:seconds,...', got {a.decode_curve!r}") from e
    return SimulatedLoop(**kw)


def cmd_loop(a) -> None:
    cfg = _loop_config(a)
    curve = decode_curve_table(cfg)
    results = {mode: simulate(dataclasses.replace(cfg, mode=mode)) for mode in ("sync", "async")}
    if a.json:
        return _json({"config": cfg, "decode_curve": curve, "results": results})
    print(f"decode roofline, {cfg.model} on {cfg.gpu} x tp{cfg.tp}:")
    print(_table(curve, [("batch", "d"), ("step_ms", ".2f"), ("tokens_per_s", ".0f")]))
    rows = [dict(dataclasses.asdict(r)) for r in results.values()]
    print(f"\nsimulated loop ({cfg.train_gpus} trainer / {cfg.infer_gpus} sampler GPUs, {cfg.samples_per_step} samples/step, "
          f"responses lognormal mean {cfg.response_mean:.0f} sigma {cfg.response_sigma}, cap {cfg.max_staleness}):")
    print(_table(rows, [("mode", ""), ("tokens_per_s", ".0f"), ("step_s", ".2f"), ("staleness_mean", ".2f"),
                        ("staleness_p99", ".1f"), ("dropped_fraction", ".1%"), ("trainer_idle", ".1%"),
                        ("sampler_idle", ".1%"), ("sync_s", ".3f")]))
    s, x = results["sync"], results["async"]
    print(f"async/sync throughput: {x.tokens_per_s / s.tokens_per_s:.2f}x")


def cmd_sweep(a) -> None:
    pts = sweep(_loop_config(a), total_gpus=a.total_gpus, train_gpus=a.train_splits, batches=a.batches, caps=a.caps)
    rows = as_rows(pts)
    png = plot(pts, a.png) if a.png else None
    if a.json:
        return _json({"points": rows, "png": png})
    print(_table(rows, [("train_gpus", "d"), ("infer_gpus", "d"), ("max_batch", "d"), ("max_staleness", "d"),
                        ("tokens_per_s", ".0f"), ("staleness_mean", ".2f"), ("staleness_p99", ".1f"),
                        ("dropped_fraction", ".1%"), ("pareto", "")]))
    if a.png:
        print(f"plot: {png}" if png else "plot skipped: matplotlib is not installed (pip install matplotlib)")


def cmd_sandboxes(a) -> None:
    cfg = SandboxConfig(rollouts_per_s=a.rate, actions_per_rollout=a.actions, action_latency_s=a.action_latency,
                        think_s=a.think, startup_s=a.startup, failure_rate=a.failure_rate, quantile=a.quantile)
    p = plan_sandboxes(cfg)
    if a.json:
        return _json({"config": cfg, "plan": p})
    print(f"mean sandboxes in use (Little's law): {p.mean_in_use:,.1f}")
    print(f"pool for the {cfg.quantile:.1%} quantile (Poisson): {p.pool_size:,}  -> Erlang-B blocking {p.blocking:.3%}")
    print(f"hold per attempt {p.hold_s:.1f} s, {p.attempts_per_rollout:.3f} attempts per rollout, "
          f"{p.sandbox_s_per_rollout:.1f} sandbox-s per rollout, rollout latency {p.rollout_latency_s:.1f} s")


def cmd_validate(a) -> None:
    if a.results:
        name, rows = str(a.results), validate(a.results, seeds=a.seeds)
    else:
        loop = measured.inputs().get("loop")
        if loop is None:
            raise PlanError(f"no reference-loop run in {measured.WHERE}; run `wsync bench loop` or name a file")
        name, rows = f"{loop['file']} (from {measured.WHERE})", validate_runs(loop, seeds=a.seeds)
    if a.json:
        return _json({"results": name, "tolerance": TOLERANCE, "runs": rows})
    print(f"reference loop {name}: measured component costs -> simulated samples/s")
    print(_table(rows, [("run", ""), ("measured_samples_per_s", ".1f"), ("predicted_samples_per_s", ".1f"),
                        ("error", "+.1%"), ("decode_step_ms", ".1f"), ("train_step_s", ".3f"), ("sync_s", ".3f"),
                        ("trainer_idle_measured", ".1%"), ("trainer_idle_predicted", ".1%"),
                        ("dropped_measured", ".1%"), ("dropped_predicted", ".1%")]))
    bad = [r["run"] for r in rows if not r["within_tolerance"]]
    print(f"all runs within {TOLERANCE:.0%}" if not bad else f"outside {TOLERANCE:.0%}: {', '.join(bad)}")
