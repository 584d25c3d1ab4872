"""Do our integrations fit the frameworks' published code? Signatures read with ast, never imported.

verl, OpenRLHF, slime and prime-rl cannot be imported on a CPU machine (ray,
DeepSpeed, Megatron, SGLang, vLLM), so each integration lists the framework
names it overrides (``OVERRIDES``) and calls (``CALLS``: module, qualified name,
positional args, keywords, bound to an instance or not). ``refresh`` reads
those signatures from released wheels (``pip download --no-deps``) or source
checkouts into ``signatures.json`` with version and origin; ``check`` binds our
calls and compares our overrides against that snapshot::

    python -m wsync.integrations.signatures verl=verl-0.9.1-py3-none-any.whl@0.9.1 slime=path/to/slime@<commit> ...
"""
from __future__ import annotations

import ast
import importlib
import json
import sys
from pathlib import Path

from ..engines.signatures import bind_problems, read_tree, read_wheel

SNAPSHOT = Path(__file__).with_name("signatures.json")
MODULES = {"verl": "verl", "trl": "trl", "openrlhf": "openrlhf", "slime": "slime", "prime_rl": "prime_rl"}
SOURCE_ROOT = {"prime_rl": "src"}  # where the package sits inside a source checkout
# our implementation of each override: (our module file, class or None, function name)
OURS = {
    "verl": lambda qual: ("verl.py", "WsyncCheckpointEngineCore", qual.split(".")[-1]),
    "trl": lambda qual: ("trl.py", "WsyncVLLMClient", qual.split(".")[-1]),
    "openrlhf": lambda qual: ("openrlhf.py", None, {"_init_vllm_sync_group": "init_vllm_sync_group",
                                                   "broadcast_to_vllm": "broadcast_to_vllm",
                                                   "init_process_group": "worker_init_process_group",
                                                   "update_weight": "worker_update_weight"}[qual.split(".")[-1]]),
    "slime": lambda qual: ("slime.py", "WsyncUpdateWeight", qual.split(".")[-1]),
    "prime_rl": lambda qual: ("prime_rl.py", "WsyncWeightBroadcast", qual.split(".")[-1]),
}


def lists(pkg: str):
    mod = importlib.import_module(f"{__package__}.{pkg}")
    return mod.CALLS, mod.OVERRIDES


def refresh(sources: dict[str, str], versions: dict[str, str]) -> dict:
    """Read every listed signature from each package's wheel or source tree into the snapshot."""
    snap = json.loads(SNAPSHOT.read_text()) if SNAPSHOT.exists() else {}
    for pkg, src in sources.items():
        calls, overrides = lists(pkg)
        targets = [(m, q) for m, q, *_ in calls] + list(overrides)
        sigs = read_wheel(src, targets) if src.endswith(".whl") else \
            read_tree(Path(src) / SOURCE_ROOT.get(pkg, ""), targets)
        snap[pkg] = {"version": versions.get(pkg, "?"), "source": Path(src).name, "signatures": sigs}
    SNAPSHOT.write_text(json.dumps(snap, indent=1, sort_keys=True) + "\n")
    return snap


def _our_params(file: str, cls: str | None, name: str) -> list[dict] | None:
    from ..engines.signatures import param_list

    tree = ast.parse(Path(__file__).with_name(file).read_text())
    scopes = [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls] if cls else [tree]
    for scope in scopes:
        for node in (ast.walk(scope) if cls else scope.body):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
                return param_list(node)
    return None


def override_problems(base: list[dict] | None, ours: list[dict] | None) -> list[str]:
    """Ours must take the base's parameters, same names in order; extras need defaults."""
    if base is None or ours is None:
        return ["not found" + (" in the published source" if base is None else " in our module")]
    fixed = lambda ps: [p for p in ps if p["kind"] not in ("VAR_POSITIONAL", "VAR_KEYWORD")]  # noqa: E731
    b, o = fixed(base), fixed(ours)
    if [p["name"] for p in o[:len(b)]] != [p["name"] for p in b]:
        return [f"parameters {[p['name'] for p in o]}, the framework's are {[p['name'] for p in b]}"]
    extra = [p["name"] for p in o[len(b):] if not p["default"]]
    if extra and not any(p["kind"] == "VAR_KEYWORD" for p in base):
        return [f"extra required parameters {extra}"]
    return []


def check(snapshot: dict | None = None) -> list[str]:
    snap = snapshot or json.loads(SNAPSHOT.read_text())
    problems = []
    for pkg in MODULES:
        sigs = snap[pkg]["signatures"]
        calls, overrides = lists(pkg)
        for module, qual, n_pos, kws, bound in calls:
            problems += [f"{pkg} {module}:{qual}: {p}"
                         for p in bind_problems(sigs.get(f"{module}:{qual}"), n_pos, kws, bound_self=bound)]
        for module, qual in overrides:
            ours = _our_params(*OURS[pkg](qual))
            problems += [f"{pkg} override {qual}: {p}" for p in override_problems(sigs.get(f"{module}:{qual}"), ours)]
    return problems


if __name__ == "__main__":
    specs = dict(a.split("=", 1) for a in sys.argv[1:])  # pkg=path[@version]
    refresh({k: v.split("@")[0] for k, v in specs.items()},
            {k: v.split("@", 1)[1] for k, v in specs.items() if "@" in v})
    print("\n".join(check()) or "all integrations fit")
