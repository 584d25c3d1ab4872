"""Where benchmark results go by default, and how they are named after the machine (wsync.hardware).

`bench all` and `bench loop` name their files with the same `stem()`, so one machine's results sort
together. They write to `--out`, by default a cache folder and never the checkout: `benchmarks/results/`
holds only the runs someone chose to commit (pass `--out benchmarks/results` for those).
"""
from __future__ import annotations

import datetime as dt
import json
from pathlib import Path


def default_results_dir() -> Path:
    """~/.cache/wsync/results, beside the generated snapshots."""
    return Path.home() / ".cache" / "wsync" / "results"


def host_tag(hw: dict) -> str:
    """`<chip>-<cores>core-<gpu|nogpu>`, e.g. `xeon-2core-nogpu`, `amdepyc-2core-nogpu`."""
    cpu = hw["cpu"].lower()
    chip = "xeon" if "xeon" in cpu else "".join(c for c in cpu.split("(")[0] if c.isalnum())[:12] or "cpu"
    return f"{chip}-{hw['cores']}core-{'gpu' if hw['gpu'] else 'nogpu'}"


def stem(hw: dict, today: str | None = None) -> str:
    """`<date>-<host tag>`: how every saved result of this machine is named."""
    return f"{today or dt.date.today().isoformat()}-{host_tag(hw)}"


def save(out: Path | None, name: str, doc: dict, text: str) -> Path:
    """doc as <out>/<name>.json and text as <name>.md (out: default_results_dir() when None); the .json path."""
    out = out or default_results_dir()
    out.mkdir(parents=True, exist_ok=True)
    base = out / name
    base.with_suffix(".json").write_text(json.dumps(doc, indent=1, default=str) + "\n")
    base.with_suffix(".md").write_text(text + "\n")
    return base.with_suffix(".json")


def options(a) -> dict:
    """A suite's options as its results file records them: what the command line set, not wsync's own
    bookkeeping (the function it runs, the parser, the command's name)."""
    return {k: str(v) if isinstance(v, Path) else v for k, v in vars(a).items()
            if isinstance(v, (int, float, str, list, tuple, Path, type(None))) and k not in ("cmd", "suite")}


def one_line(info: dict) -> str:
    return f"{info['cpu']}, {info['cores']} cores, {info['gpu'] or 'no GPU'}, wsync backend {info['wsync_backend']}"
