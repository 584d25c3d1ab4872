"""Our vLLM / SGLang calls against the frameworks' published signatures (read from released source with ast)."""
from __future__ import annotations

import ast
import glob
import os

import pytest

from wsync.engines import signatures as S


def test_snapshot_names_its_source_and_version():
    snap = S.load_snapshot()
    for pkg in ("vllm", "sglang"):
        assert snap[pkg]["version"] and "wheel" in snap[pkg]["source"] and "sha256" in snap[pkg]["source"]
        assert set(snap[pkg]["signatures"]) == {f"{m}:{q}" for m, q in S.targets()[pkg]}  # nothing missing, no extras


def test_every_call_and_override_fits_the_published_signatures():
    assert S.check() == []


def test_the_checker_catches_wrong_calls():
    params = S.find(ast.parse("class E:\n    def f(self, a, b=1, *, c):\n        pass\n"), "E.f")
    assert S.bind_problems(params, 1, ("c",)) == []
    assert "no parameter 'd'" in S.bind_problems(params, 1, ("c", "d"))
    assert "required parameter 'c' not given" in S.bind_problems(params, 2, ())
    assert "3 positional arguments, the signature takes 2" in S.bind_problems(params, 3, ("c",))
    assert "'a' given twice" in S.bind_problems(params, 1, ("a", "c"))
    assert S.bind_problems(None, 0, ()) == ["not found in the published source"]
    snap = S.load_snapshot()
    key = "sglang.srt.entrypoints.engine:Engine.update_weights_from_tensor"
    snap["sglang"]["signatures"][key] = [p for p in snap["sglang"]["signatures"][key] if p["name"] != "flush_cache"]
    assert any("no parameter 'flush_cache'" in p for p in S.check(snap))
    snap = S.load_snapshot()
    key = "vllm.distributed.weight_transfer.base:WeightTransferEngine.receive_weights"
    snap["vllm"]["signatures"][key][1]["name"] = "info"
    assert any("override" in p for p in S.check(snap))


def test_dataclass_and_struct_fields_read_as_a_constructor():
    tree = ast.parse("class R(Struct):\n    kind: ClassVar[str] = 'x'\n    a: str\n    b: int = 0\n")
    assert [(p["name"], p["default"]) for p in S.find(tree, "R")[1:]] == [("a", False), ("b", True)]


def _wheels():
    where = os.environ.get("WSYNC_ENGINE_WHEELS", "")
    return sorted(glob.glob(os.path.join(where, "*.whl"))) if where else []


@pytest.mark.skipif(not _wheels(), reason="set WSYNC_ENGINE_WHEELS to a folder with vllm/sglang wheels "
                                          "(pip download vllm sglang --no-deps -d DIR)")
def test_snapshot_matches_the_wheels_at_hand():
    snap = S.load_snapshot()
    for wheel in _wheels():
        pkg = next((p for p in ("vllm", "sglang") if os.path.basename(wheel).startswith(p + "-")), None)
        if pkg is None:
            continue
        fresh = S.read_wheel(wheel, S.targets()[pkg])
        same = fresh == snap[pkg]["signatures"]
        assert same or S.check({**snap, pkg: {**snap[pkg], "signatures": fresh}}) == [], wheel


@pytest.mark.gpu
def test_live_frameworks_accept_our_calls():
    """Where vLLM or SGLang is installed (a GPU machine), check against the imported code too."""
    import importlib
    import inspect

    found = 0
    for pkg, calls in S.calls().items():
        try:
            importlib.import_module(pkg)
        except ImportError:
            continue
        for module, qual, n_pos, kws in calls:
            obj = importlib.import_module(module)
            for part in qual.split("."):
                obj = getattr(obj, part)
            sig = inspect.signature(obj)
            unbound = next(iter(sig.parameters), None) in ("self", "cls")  # a plain function looked up on a class
            args = (None,) * (n_pos + (1 if unbound else 0))
            sig.bind(*args, **{k: None for k in kws})
            found += 1
    if not found:
        pytest.skip("neither vllm nor sglang is installed")
