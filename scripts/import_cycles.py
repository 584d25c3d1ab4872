#!/usr/bin/env python3
"""Fail when our own modules (wsync/, trainer/, benchmarks/wsync_bench/) import each other in a circle.

Every import counts, at module level or inside a function: a deferred import still means the two modules
depend on each other, it only hides the circle from the interpreter. The graph is at module granularity;
`from pkg import name` is an edge to pkg.name when that is a module of ours, else to pkg.

Edges from a package's __init__.py to modules under it are left out: a package importing its children to
re-export them is how a package is built, and counting those edges would make every child that imports
anything from its package look circular. The cost: a child that imports names from its own package's
__init__ (which imports that child) is not reported; Python resolves those only when the __init__ binds
the names first.

Then the same at package granularity: every module inside a subpackage (wsync.engines.vllm_shard,
wsync.shard.stage) counts as that subpackage (wsync.engines, wsync.shard), a module directly under a root
counts as itself, and edges inside one subpackage drop out. Two subpackages that import each other are a
circle even when no two modules are: neither can be understood, tested or moved without the other.

Exit 1 and print each strongly connected component (size > 1), of modules or of packages, with its import
lines as file:line; exit 0 when there are none. An argument: the root to check instead of this checkout.
"""
from __future__ import annotations

import ast
import sys
from collections import defaultdict
from pathlib import Path

# Our top-level packages, each with the folder (relative to the checkout) that holds it: the benchmark harness
# is a distribution of its own under benchmarks/.
ROOTS = {"wsync": ".", "trainer": ".", "wsync_bench": "benchmarks"}


def module_name(path: Path, parent: Path) -> str:
    """The dotted name of a module file under `parent`, the folder that holds its top-level package."""
    parts = list(path.relative_to(parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def collect(repo: Path) -> tuple[dict[str, Path], dict[str, dict[str, list[tuple[Path, int]]]]]:
    files: dict[str, Path] = {}
    for root, parent in ROOTS.items():
        if not (repo / parent / root).is_dir():
            continue
        for p in sorted((repo / parent / root).rglob("*.py")):
            files[module_name(p, repo / parent)] = p
    edges: dict[str, dict[str, list[tuple[Path, int]]]] = defaultdict(lambda: defaultdict(list))
    for mod, path in files.items():
        is_pkg = path.name == "__init__.py"
        package = mod if is_pkg else mod.rpartition(".")[0]
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                for a in node.names:
                    targets.append(own(a.name, files))
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")
                    base = base[: len(base) - (node.level - 1)]
                    src = ".".join(base + ([node.module] if node.module else []))
                else:
                    src = node.module or ""
                for a in node.names:
                    sub = f"{src}.{a.name}"
                    targets.append(sub if sub in files else own(src, files))
            for t in targets:
                if not t or t == mod:
                    continue
                if is_pkg and t.startswith(mod + "."):
                    continue  # a package importing its own children (see the module docstring)
                if (path, node.lineno) not in edges[mod][t]:  # one line may name several things of one module
                    edges[mod][t].append((path, node.lineno))
    return files, edges


def own(name: str, files: dict[str, Path]) -> str:
    """The longest prefix of a dotted name that is one of our modules ('' if none)."""
    parts = name.split(".")
    while parts:
        if ".".join(parts) in files:
            return ".".join(parts)
        parts.pop()
    return ""


def package_of(mod: str, repo: Path) -> str:
    """The subpackage directly under a root that holds mod (root.sub), or mod itself when it is not in one."""
    parts = mod.split(".")
    if len(parts) >= 2 and (repo / ROOTS.get(parts[0], ".") / parts[0] / parts[1] / "__init__.py").is_file():
        return ".".join(parts[:2])
    return mod


def package_edges(edges, repo: Path):
    """edges aggregated to packages (package_of), with the import lines of each."""
    out: dict[str, dict[str, list[tuple[Path, int]]]] = defaultdict(lambda: defaultdict(list))
    for a, targets in edges.items():
        pa = package_of(a, repo)
        for b, sites in targets.items():
            pb = package_of(b, repo)
            if pa != pb:
                out[pa][pb] += [s for s in sites if s not in out[pa][pb]]
    return out


def report(found: list[list[str]], edges, repo: Path, what: str) -> None:
    for comp in found:
        members = set(comp)
        print(f"import cycle among {len(comp)} {what}: {', '.join(comp)}")
        for a in comp:
            for b, sites in sorted(edges.get(a, {}).items()):
                if b in members:
                    for path, line in sites:
                        print(f"  {a} -> {b}  {path.relative_to(repo)}:{line}")


def sccs(nodes: list[str], edges) -> list[list[str]]:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for start in nodes:
        if start in index:
            continue
        # iterative Tarjan: the graph is small, but recursion limits are not worth the risk
        work = [(start, iter(sorted(edges.get(start, {}))))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on.add(start)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(edges.get(w, {})))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # a root to check other than this checkout: how the tests give it a tree with a known circle
    repo = Path(argv[0]).resolve() if argv else Path(__file__).resolve().parent.parent
    files, edges = collect(repo)
    found = sccs(sorted(files), edges)
    report(found, edges, repo, "modules")
    pedges = package_edges(edges, repo)
    packages = sorted({package_of(m, repo) for m in files})
    found_packages = sccs(packages, pedges)
    report(found_packages, pedges, repo, "packages")
    if found or found_packages:
        print(f"{len(found) + len(found_packages)} import cycle(s)")
        return 1
    print(f"no import cycles among {len(files)} modules, nor among the {len(packages)} packages and top-level "
          "modules they form")
    return 0


if __name__ == "__main__":
    sys.exit(main())
