"""Do our vLLM / SGLang calls fit the frameworks' published signatures? Read from source, never imported.

Neither framework installs on a CPU machine, so the adapters list every call
they make (``CALLS`` in vllm.py and sglang.py: module, qualified name, how many
positional arguments, which keywords) and the methods they override. This
module reads signatures out of a released package's source with ``ast`` (from
a wheel, without installing it or its dependencies), keeps a small snapshot of
just those signatures in ``signatures.json`` (with the version and where it
came from), and checks each call binds. ``scripts/check_engine_signatures.py``
refreshes the snapshot from new wheels.
"""
from __future__ import annotations

import ast
import json
import zipfile
from pathlib import Path

SNAPSHOT = Path(__file__).with_name("signatures.json")


def param_list(fn: ast.FunctionDef) -> list[dict]:
    """[{name, kind, default}] of a def, kinds as inspect names them."""
    a = fn.args
    pos = [*a.posonlyargs, *a.args]
    n_def = len(a.defaults)
    out = [{"name": p.arg, "kind": "POSITIONAL_ONLY" if i < len(a.posonlyargs) else "POSITIONAL_OR_KEYWORD",
            "default": i >= len(pos) - n_def} for i, p in enumerate(pos)]
    if a.vararg:
        out.append({"name": a.vararg.arg, "kind": "VAR_POSITIONAL", "default": True})
    out += [{"name": p.arg, "kind": "KEYWORD_ONLY", "default": d is not None} for p, d in zip(a.kwonlyargs, a.kw_defaults)]
    if a.kwarg:
        out.append({"name": a.kwarg.arg, "kind": "VAR_KEYWORD", "default": True})
    return out


def _fields(cls: ast.ClassDef) -> list[dict]:
    """A dataclass / msgspec Struct's constructor, from its annotated class attributes."""
    out = []
    for node in cls.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            ann = ast.unparse(node.annotation)
            if "ClassVar" in ann:
                continue
            out.append({"name": node.target.id, "kind": "POSITIONAL_OR_KEYWORD", "default": node.value is not None})
    return out


def find(tree: ast.Module, qualname: str) -> list[dict] | None:
    """Signature of `Class.method`, `function` or `Class` (its fields) in a parsed module, or None."""
    scope, parts = tree.body, qualname.split(".")
    for i, part in enumerate(parts):
        node = next((n for n in scope if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                     and n.name == part), None)
        if node is None:
            return None
        if i == len(parts) - 1:
            if isinstance(node, ast.ClassDef):
                init = next((n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"), None)
                return param_list(init) if init else [{"name": "self", "kind": "POSITIONAL_OR_KEYWORD",
                                                       "default": False}] + _fields(node)
            return param_list(node)
        scope = node.body if isinstance(node, ast.ClassDef) else []
    return None


def module_path(module: str) -> str:
    return module.replace(".", "/") + ".py"


def read_wheel(wheel: str, targets: list[tuple[str, str]]) -> dict[str, list[dict] | None]:
    """{"module:qualname": signature or None} for each target, parsed from a wheel's source."""
    out = {}
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        for module, qual in targets:
            path = module_path(module)
            src = z.read(path).decode() if path in names else None
            out[f"{module}:{qual}"] = find(ast.parse(src), qual) if src else None
    return out


def read_tree(root: str | Path, targets: list[tuple[str, str]]) -> dict[str, list[dict] | None]:
    """The same, from a source tree (a checkout or an unpacked package)."""
    out = {}
    for module, qual in targets:
        p = Path(root) / module_path(module)
        out[f"{module}:{qual}"] = find(ast.parse(p.read_text()), qual) if p.exists() else None
    return out


def bind_problems(params: list[dict] | None, n_pos: int, keywords, *, bound_self: bool = True) -> list[str]:
    """Why a call with n_pos positional args and these keywords would not bind (empty: it binds)."""
    if params is None:
        return ["not found in the published source"]
    ps = params[1:] if bound_self and params and params[0]["name"] in ("self", "cls") else params
    positional = [p for p in ps if p["kind"] in ("POSITIONAL_ONLY", "POSITIONAL_OR_KEYWORD")]
    varargs = any(p["kind"] == "VAR_POSITIONAL" for p in ps)
    varkw = any(p["kind"] == "VAR_KEYWORD" for p in ps)
    problems = []
    if n_pos > len(positional) and not varargs:
        problems.append(f"{n_pos} positional arguments, the signature takes {len(positional)}")
    filled = {p["name"] for p in positional[:n_pos]}
    by_kw = {p["name"] for p in ps if p["kind"] in ("POSITIONAL_OR_KEYWORD", "KEYWORD_ONLY")}
    for k in keywords:
        if k in filled:
            problems.append(f"{k!r} given twice")
        elif k not in by_kw and not varkw:
            problems.append(f"no parameter {k!r}")
    for p in ps:
        if not p["default"] and p["kind"] in ("POSITIONAL_ONLY", "POSITIONAL_OR_KEYWORD", "KEYWORD_ONLY") \
                and p["name"] not in filled and p["name"] not in keywords:
            problems.append(f"required parameter {p['name']!r} not given")
    return problems


def override_problems(base: list[dict] | None, ours: list[dict] | None) -> list[str]:
    """An override must accept what the base is called with: the same parameter names, in order."""
    if base is None or ours is None:
        return ["not found" + (" in the published source" if base is None else " in our backend")]
    names = lambda ps: [p["name"] for p in ps if p["kind"] not in ("VAR_POSITIONAL", "VAR_KEYWORD")]  # noqa: E731
    return [] if names(base) == names(ours) else [f"parameters {names(ours)}, the base has {names(base)}"]


def load_snapshot() -> dict:
    return json.loads(SNAPSHOT.read_text())


def calls() -> dict[str, list]:
    """{package: CALLS} of our adapters (importing them imports neither framework)."""
    from . import sglang, vllm

    return {"vllm": vllm.CALLS, "sglang": sglang.CALLS}


def targets() -> dict[str, list[tuple[str, str]]]:
    from . import vllm

    out = {pkg: [(m, q) for m, q, *_ in cs] for pkg, cs in calls().items()}
    out["vllm"] += list(vllm.OVERRIDES)
    return out


def check(snapshot: dict | None = None) -> list[str]:
    """Every problem with our calls and overrides against the snapshot (empty: all fit)."""
    from . import vllm

    snap = snapshot or load_snapshot()
    problems = []
    for pkg, cs in calls().items():
        sigs = snap[pkg]["signatures"]
        for module, qual, n_pos, kws in cs:
            problems += [f"{pkg} {module}:{qual}: {p}" for p in bind_problems(sigs.get(f"{module}:{qual}"), n_pos, kws)]
    ours = ast.parse(Path(__file__).with_name("vllm_backend.py").read_text())
    for module, qual in vllm.OVERRIDES:
        mine = find(ours, "WsyncWeightTransferEngine." + qual.split(".")[-1])
        base = snap["vllm"]["signatures"].get(f"{module}:{qual}")
        problems += [f"vllm override {qual}: {p}" for p in override_problems(base, mine)]
    return problems
