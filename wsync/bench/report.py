"""Turn a saved `wsync bench codec --json` run into the README's results table.

    python -m wsync.bench.report benchmarks/results/RUN.json --readme README.md

The table sits between two markers in the README, so regenerating it never
touches the prose around it.
"""
from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"


def _by_name(run: dict) -> dict:
    return {r["name"]: r for r in run["schemes"] if "skipped" not in r}


def codec_table(doc: dict) -> str:
    lines = [
        "| snapshots | density | packed ratio | sparse ratio | XOR+zstd-1 | PULSE | zipnn | entropy bound | packed vs XOR+zstd | packed over bound | packed enc / apply GB/s | exact |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for run in doc["runs"]:
        s, by, bd = run["summary"], _by_name(run), run["bound"]
        ratio = lambda n: f"{by[n]['ratio_vs_raw']:.1f}x" if n in by else "n/a"
        p = by["wsync-packed"]
        lines.append(
            f"| {run['label']} | {s['density']:.2%} | **{s['packed_ratio']:.1f}x** | {s['sparse_ratio']:.1f}x "
            f"| {ratio('xor_zstd')} | {ratio('pulse')} | {ratio('zipnn')} | {bd['ratio_vs_raw']:.1f}x "
            f"| {s['packed_vs_xor_zstd']:.2f}x | {s['packed_over_bound']:+.1%} "
            f"| {p['encode_gbps']:.2f} / {p['decode_gbps']:.2f} | {'yes' if s['all_exact'] else 'NO'} |"
        )
    hw = doc["hardware"]
    lines.append("")
    lines.append(f"Measured {doc['date']} on {hw['cpu']}, {hw['cores']} cores, {hw['gpu'] or 'no GPU'}; "
                 f"backend {hw['wsync_backend'].split(' (')[0]}.")
    return "\n".join(lines)


def update_readme(readme: Path, table: str) -> None:
    text = readme.read_text()
    block = f"{BEGIN}\n{table}\n{END}"
    if BEGIN in text:
        text = re.sub(re.escape(BEGIN) + ".*?" + re.escape(END), lambda _: block, text, flags=re.S)
    else:
        raise ValueError(f"{readme} has no {BEGIN} marker")
    readme.write_text(text)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("json", type=Path)
    ap.add_argument("--readme", type=Path)
    a = ap.parse_args(argv)
    table = codec_table(json.loads(a.json.read_text()))
    if a.readme:
        update_readme(a.readme, table)
    print(table)


if __name__ == "__main__":
    main()
