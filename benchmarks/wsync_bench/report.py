"""Turn saved benchmark results into the results page's tables (and the run's own .md).

    wsync bench report benchmarks/results/RUN.json --readme docs/results.md

RUN.json is a `wsync bench all` run (every suite: codec, transport, sync with
the whole-checkpoint peers beside it, LoRA, and the hardware line) or a single
`wsync bench codec --json` run (the codec table only). The tables sit between
two markers in docs/results.md, so regenerating them never touches the prose
around them.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"


def _by_name(run: dict) -> dict:
    return {r["name"]: r for r in run["schemes"] if "skipped" not in r}


ZIPNN_MISSING = ("zipnn did not run here, so its column is left out: `pip install -e \"./benchmarks[all]\"` adds it "
                 "(PyPI has only its source, so it needs a C compiler).")
SMALL_NOTE = ("--size small runs tiny sizes (a 0.2M-parameter model, 4 MiB messages) to check that every suite "
              "works: fixed costs dominate there, so wsync can show below its baselines. They are a smoke test, "
              "not numbers to compare; run with --size bench for those.")


def run_size(doc: dict) -> str:
    """A `bench all` run's preset: its "size"; results that carry a "quick" flag instead are small when it is true."""
    return doc.get("size") or ("small" if doc.get("quick") else "bench")


def codec_table(doc: dict, hardware: bool = True) -> str:
    # a zipnn column of n/a only says it was not installed; that is said once below the table instead
    zipnn = any("zipnn" in _by_name(run) for run in doc["runs"])
    cols = ["XOR+zstd-1", "PULSE"] + ["zipnn"] * zipnn
    lines = [
        "| snapshots | density | packed ratio | sparse ratio | " + " | ".join(cols)
        + " | entropy bound | packed vs XOR+zstd | packed over bound | packed enc / apply GB/s | exact |",
        "|---|---:|---:|---:|" + "---:|" * len(cols) + "---:|---:|---:|---:|---|",
    ]
    for run in doc["runs"]:
        s, by, bd = run["summary"], _by_name(run), run["bound"]
        ratio = lambda n: f"{by[n]['ratio_vs_raw']:.1f}x" if n in by else "n/a"
        peers = " | ".join(ratio(n) for n in ["xor_zstd", "pulse"] + ["zipnn"] * zipnn)
        p = by["wsync-packed"]
        lines.append(
            f"| {run['label']} | {s['density']:.2%} | **{s['packed_ratio']:.1f}x** | {s['sparse_ratio']:.1f}x "
            f"| {peers} | {bd['ratio_vs_raw']:.1f}x "
            f"| {s['packed_vs_xor_zstd']:.2f}x | {s['packed_over_bound']:+.1%} "
            f"| {p['encode_gbps']:.2f} / {p['decode_gbps']:.2f} | {'yes' if s['all_exact'] else 'NO'} |"
        )
    if not zipnn:
        lines += ["", ZIPNN_MISSING]
    if not hardware:  # named once for a whole `bench all` run
        return "\n".join(lines)
    hw = doc["hardware"]
    lines.append("")
    lines.append(f"Measured {doc['date']} on {hw['cpu']}, {hw['cores']} cores, {hw['gpu'] or 'no GPU'}; "
                 f"backend {hw['wsync_backend'].split(' (')[0]}.")
    return "\n".join(lines)


BASELINES = {"tcp": "plain sockets (sendall / recv_into)", "gloo": "torch.distributed broadcast (gloo)",
             "local": "Unix socket (sendall / recv_into)", "ucx": "bare UCXX endpoint send / recv",
             "nccl": "torch.distributed broadcast (nccl)"}


def _skip(name: str, r: dict) -> str | None:
    """'skipped: why' / 'FAILED: error' for a suite or row that did not run, else None."""
    if "skipped" in r:
        return f"{name}: skipped, {r['skipped']}"
    if "error" in r:
        return f"{name}: FAILED, {r['error']}"
    return None


def transport_table(t: dict) -> str:
    lines = ["| transport | baseline (same processes) | message | baseline GB/s | wsync GB/s | wsync / baseline |",
             "|---|---|---:|---:|---:|---:|"]
    notes = []
    for name, r in t.items():
        why = _skip(name, r)
        if why:
            notes.append(why)
            continue
        lines.append(f"| {name} | {BASELINES.get(name, 'raw')} | {r['size'] / 2**20:,.0f} MiB "
                     f"| {r['runs']['raw']['gbps_median']:.2f} | {r['runs']['ours']['gbps_median']:.2f} "
                     f"| {r['ratio_median']:.2f}x |")
    return "\n".join(lines + [""] + [f"- {n}" for n in notes]).rstrip()


def _sync_rows(link: str, block: dict) -> tuple[list[str], float | None]:
    full = next((r for r in block["results"] if r["mode"] == "full"), None)
    base = full["mean_latency_s"] if full else None
    vs = lambda sec: f"{base / sec:.2f}x" if base else "n/a"  # noqa: E731
    rows = [f"| {link} | wsync {r['mode']} | {r['mean_latency_s']:.3f} | {r['mean_bytes'] / 1e6:.2f} "
            f"| {vs(r['mean_latency_s'])} | {'yes' if r['exact'] else 'NO'} |" for r in block["results"]]
    return rows, base


def sync_table(sync: dict, peers: dict | None) -> str:
    lines = [f"{sync['source']}, {sync['model_bytes'] / 1e6:.1f} MB per version; seconds from the trainer's tensors "
             "to the engine serving them (wsync: publish() to committed on a subscriber process; others: save to "
             "loaded), speed-up vs wsync full on the same link. wsync rows cross two processes (checksums, "
             "verify, atomic commit); safetensors runs in one process through the page cache of the temp folder, "
             "shardcast adds HTTP on loopback (wget) and a blake3 check.", "",
             "| link | path | seconds | MB moved | vs wsync full | exact |", "|---|---|---:|---:|---:|---|"]
    notes = []
    rows, base = _sync_rows("loopback", sync["loopback"])
    lines += rows
    for name, r in (peers or {}).items():
        if not isinstance(r, dict) or name in ("checkpoint", "suite_seconds"):
            continue
        why = _skip(name, r)
        if why:
            notes.append(why)
            continue
        vs = f"{base / r['seconds_median']:.2f}x" if base else "n/a"
        lines.append(f"| loopback | {r['name']} | {r['seconds_median']:.3f} | {r['bytes'] / 1e6:.2f} | {vs} "
                     f"| {'yes' if r['exact'] else 'NO'} |")
    if peers and _skip("disk/HTTP peers", peers):
        notes.append(_skip("disk/HTTP peers", peers))
    wan = sync.get("wan", {})
    if _skip("WAN", wan):
        notes.append(_skip("WAN", wan))
    else:
        k = wan["link"]
        lines += _sync_rows(f"WAN {k['rate_mbit']:g} Mbit/s, {k['rtt_ms']:g} ms, {k['loss']:.1%} loss", wan)[0]
    return "\n".join(lines + [""] + [f"- {n}" for n in notes]).rstrip()


def lora_table(res: dict) -> str:
    m = res["model"]
    lines = [f"{m['arch']}, {m['params'] / 1e6:.1f}M params, LoRA r={m['lora_rank']} on all linear layers "
             f"({m['lora_params'] / 1e3:.0f}K adapter params), {res['run']['steps']} AdamW steps; {res['transport']}; "
             "every version exact on the engine.", "",
             "| sync | bytes / version | vs full | publish -> live | vs full |", "|---|---:|---:|---:|---:|"]
    for name, r in res["lanes"].items():
        lines.append(f"| {name} | {r['bytes_per_version'] / 1e6:.3f} MB | {r['bytes_vs_full']:.4f}x "
                     f"| {r['seconds_per_version'] * 1e3:.1f} ms | {r['time_vs_full']:.3f}x |")
    return "\n".join(lines)


def _moe_table(res: dict) -> str:
    from .many import render

    return render(res)


def _reshard_table(res: dict) -> str:
    from .reshard import render

    return render(res)


def all_tables(doc: dict) -> str:
    """The results page's block for a `wsync bench all` run: one table per suite, the hardware named once."""
    su = doc["suites"]
    hw = doc["hardware"]
    parts = [f"Measured {doc['date']} with `{doc['command']}` on {hw['cpu']}, {hw['cores']} cores, "
             f"{hw['gpu'] or 'no GPU'}, wsync backend {str(hw['wsync_backend']).split(' (')[0]}.", ""]
    if run_size(doc) == "small":
        parts += [f"**Note:** {SMALL_NOTE}", ""]
    sections = [("Codec: delta of consecutive RL snapshots vs the peers", "codec",
                 lambda r: codec_table({**r, "hardware": doc["hardware"], "date": doc["date"]}, hardware=False)),
                ("Transports: one message, wsync vs a raw baseline in the same two processes", "transport",
                 transport_table),
                ("Weight update end to end, beside safetensors and shardcast", "sync",
                 lambda r: sync_table(r, su.get("peers"))),
                ("LoRA: full vs delta vs adapter-only", "lora", lora_table),
                ("Many tensors (MoE scale) vs one tensor of the same size, bound once, tcp loopback", "moe",
                 _moe_table),
                ("Sharded trainer ranks into TP engine ranks: point to point vs gather to rank 0", "reshard",
                 _reshard_table)]
    for title, key, render in sections:
        if key not in su:
            continue
        why = _skip(key, su[key])
        parts += [f"**{title}**", "", f"- {why}" if why else render(su[key]), ""]
    return "\n".join(parts).rstrip()


def full_report(doc: dict, plots: list[str] = ()) -> str:
    """The run's own .md: the same tables, a title, the plots and how long each suite took."""
    took = ", ".join(f"{k} {v.get('suite_seconds', 0):.0f}s" for k, v in doc["suites"].items() if "suite_seconds" in v)
    lines = [f"# wsync bench all (--size {run_size(doc)}), {doc['date']}", "", all_tables(doc), "",
             f"Suite times: {took}. Load average before {_load(doc['load_average_before'])}, "
             f"after {_load(doc.get('load_average_after', []))}."]
    lines += [f"\n![{p}]({p})" for p in plots]
    return "\n".join(lines)


def plot_all(doc: dict, base: Path) -> list[Path]:
    """One PNG of the run (transport GB/s, update seconds, codec ratios); [] without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    su = doc["suites"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    t = {k: r for k, r in su.get("transport", {}).items() if "runs" in r}
    x = range(len(t))
    axes[0].bar([i - 0.2 for i in x], [r["runs"]["raw"]["gbps_median"] for r in t.values()], 0.4, label="baseline")
    axes[0].bar([i + 0.2 for i in x], [r["runs"]["ours"]["gbps_median"] for r in t.values()], 0.4, label="wsync")
    axes[0].set_xticks(list(x), list(t))
    axes[0].set(title="transports: one message", ylabel="GB/s")
    axes[0].legend(fontsize=8)
    bars = {}
    sync = su.get("sync", {})
    for r in sync.get("loopback", {}).get("results", []):
        bars[f"wsync {r['mode']}"] = r["mean_latency_s"]
    for r in su.get("peers", {}).values():
        if isinstance(r, dict) and "seconds_median" in r:
            bars[r["name"].split(" ")[0]] = r["seconds_median"]
    axes[1].barh(list(bars), list(bars.values()))
    axes[1].set(title="weight update, loopback", xlabel="seconds (log)", xscale="log")
    for run in su.get("codec", {}).get("runs", [])[:6]:
        ok = [r for r in run["schemes"] if "skipped" not in r and r["name"] != "raw"]
        axes[2].plot([r["name"] for r in ok], [r["ratio_vs_raw"] for r in ok], "o-", label=run["label"])
    axes[2].set(title="codec: size ratio vs raw", yscale="log")
    axes[2].tick_params(axis="x", rotation=45, labelsize=8)
    if su.get("codec", {}).get("runs"):  # a run without the codec suite has nothing to label
        axes[2].legend(fontsize=6)
    hw = doc["hardware"]
    fig.suptitle(f"{hw['cpu']}, {hw['cores']} cores, {hw['gpu'] or 'no GPU'}, {doc['date']}", fontsize=8)
    fig.tight_layout()
    path = base.parent / f"{base.name}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]


def _load(la) -> str:
    return "/".join(f"{x:.1f}" for x in la)


def table_for(doc: dict) -> str:
    return all_tables(doc) if "suites" in doc else codec_table(doc)


def update_readme(readme: Path, table: str) -> None:
    text = readme.read_text()
    block = f"{BEGIN}\n{table}\n{END}"
    if BEGIN in text:
        text = re.sub(re.escape(BEGIN) + ".*?" + re.escape(END), lambda _: block, text, flags=re.S)
    else:
        raise ValueError(f"{readme} has no {BEGIN} marker")
    readme.write_text(text)


def add_parsers(bench) -> None:
    ap = bench.add_parser("report", help="a saved run's JSON as the results page's tables",
                          description=__doc__.splitlines()[0])
    ap.add_argument("json", type=Path, help="a `wsync bench all` or `wsync bench codec --json` results file")
    ap.add_argument("--readme", type=Path, help="also write the tables between the results markers of this file")
    ap.set_defaults(fn=main)


def main(a) -> None:
    table = table_for(json.loads(a.json.read_text()))
    if a.readme:
        update_readme(a.readme, table)
    print(table)

