"""What a new user meets on the command line straight after `pip install -e .`: a version, help on every
option, one-line refusals (exit 3) where an optional package is missing, no hints about backends nobody
asked for, and no library deprecation warnings from our own trainer. Missing packages are simulated (a
module set to None, or a shim on PYTHONPATH that raises ImportError): nothing is uninstalled."""
from __future__ import annotations

import logging
import re
import subprocess
import sys
import warnings

import pytest

from cli_helpers import HANG, environment, one_line_error, wsync_cli


def _wsync_without(blocked: list[str], *args, env: dict | None = None) -> subprocess.CompletedProcess:
    """`wsync ARGS` in a subprocess where each of `blocked` fails to import, as if it were not installed."""
    code = ("import sys\n"
            f"for m in {blocked!r}: sys.modules[m] = None\n"
            "from wsync.cli import main\n"
            f"sys.exit(main({[str(a) for a in args]!r}))\n")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=HANG,
                          env=environment(env))


# -- the trainer's calls into transformers -------------------------------------------------------------


def test_decoding_raises_no_transformers_deprecation(caplog):
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from trainer.decode import DecodeConfig, Decoder, Sequence
    from trainer.policy import PolicyConfig, build
    from trainer.task import prompt_ids

    dec = Decoder(build(PolicyConfig(seed=1)), DecodeConfig(slots=2, kv_cache="recompute"), seed=0)
    dec.add(Sequence(prompt=prompt_ids([1, 2, 3]), limit=4))
    dec.add(Sequence(prompt=prompt_ids([4, 5]), limit=4))
    with warnings.catch_warnings(), caplog.at_level(logging.WARNING):
        warnings.simplefilter("error")  # a FutureWarning from transformers fails the test here
        with torch.no_grad():
            dec.step(0)  # a prefill and a decode step
            dec.weights_changed()
            dec.step(1)  # a re-prefill of both rows after a weight update, then a decode step
    assert not [r for r in caplog.records if "deprecated" in r.getMessage()], caplog.text
    assert all(len(s.response) == 2 for s in dec.rows if s is not None)


def test_decoder_passes_the_cache_under_the_name_the_forward_takes():
    from trainer.decode import _cache_name

    class Renamed:
        def forward(self, input_ids=None, cache=None, use_cache=None, **kwargs): ...

    class Older:
        def forward(self, input_ids=None, past_key_values=None, use_cache=None, **kwargs): ...

    assert _cache_name(Renamed) == "cache"
    assert _cache_name(Older) == "past_key_values"  # `cache` would vanish into **kwargs there


# -- wsync --version -----------------------------------------------------------------------------------


def test_version_prints_the_installed_version():
    from importlib.metadata import version

    r = wsync_cli("--version")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"wsync {version('wsync')}"


def test_version_falls_back_to_the_package_where_wsync_is_not_installed(monkeypatch):
    import importlib.metadata

    import wsync
    from wsync import cli

    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", not_installed)
    assert cli.version() == wsync.__version__


def test_package_version_matches_pyproject():
    import tomllib
    from pathlib import Path

    import wsync

    project = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]
    assert wsync.__version__ == project["version"]


# -- plan loop / plan sweep options --------------------------------------------------------------------


@pytest.mark.parametrize("cmd", ["loop", "sweep"])
def test_plan_loop_and_sweep_options_say_what_they_are(cmd):
    import argparse

    from wsync.cli import parser

    plan = next(a for a in parser()._actions if isinstance(a, argparse._SubParsersAction)).choices["plan"]
    p = next(a for a in plan._actions if isinstance(a, argparse._SubParsersAction)).choices[cmd]
    bare = [a.option_strings[0] for a in p._actions
            if a.option_strings and (not a.help or a.help.startswith("(default"))]
    assert not bare, bare
    steps = 8 if cmd == "sweep" else 12  # the sweep simulates fewer steps per point: its help says its own
    assert re.search(rf"--steps STEPS\s+trainer steps to simulate \(default {steps}\)", p.format_help())


@pytest.mark.parametrize("args, said", [
    (["plan", "loop", "--mode", "asynch"], "invalid choice: 'asynch'"),
    (["plan", "loop", "--gpu", "v100"], "invalid choice: 'v100'"),
    (["plan", "loop", "--codec", "zip"], "invalid choice: 'zip'"),
    (["plan", "loop", "--link", "fast"], "unknown link 'fast'"),
    (["plan", "sweep", "--mode", "async"], "argument --mode: plan sweep sets it at every point, from --caps"),
    (["plan", "sweep", "--max-batch", "32"], "argument --max-batch: plan sweep sets it at every point, from --batches"),
    (["plan", "sweep", "--bogus"], "unrecognized arguments: --bogus"),
])
def test_a_wrong_plan_value_is_one_line_and_exit_2(args, said):
    r = wsync_cli(*args)
    assert r.returncode == 2 and r.stdout == "", (r.returncode, r.stdout)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and said in lines[0] and lines[0].startswith(f"wsync plan {args[1]}: error:"), r.stderr


def test_plan_loop_takes_a_gpu_in_capitals_and_a_link_rate(capsys):
    import json

    from wsync.cli import main

    assert main(["plan", "loop", "--gpu", "H200", "--link", "25g", "--mode", "sync", "--json"]) == 0
    cfg = json.loads(capsys.readouterr().out)["config"]
    assert (cfg["gpu"], cfg["link"], cfg["mode"]) == ("h200", "25g", "sync")


# -- an optional package missing: one line, exit 3, the extra to install ----------------------------------


@pytest.mark.parametrize("args, extra, instead", [
    (["bench", "codec", "--size", "tiny", "--gaps", "1", "--lr", "1e-6"], "./benchmarks[all]", "--base and --new"),
    (["bench", "sync", "--size", "tiny", "--versions", "1"], "./benchmarks[all]", "--src"),
])
def test_bench_without_transformers_says_which_extra_in_one_line(tmp_path, args, extra, instead):
    r = _wsync_without(["transformers"], *args, env={"WSYNC_BENCH_DATA": str(tmp_path)})
    line = one_line_error(r, code=3)
    assert "needs transformers" in line and f'pip install -e "{extra}"' in line and instead in line, line
    assert r.stdout == "" and len(r.stderr.strip().splitlines()) == 1, r.stderr  # nothing announced or begun
    assert not list(tmp_path.iterdir())  # and nothing written


@pytest.mark.parametrize("blocked, args", [
    ("transformers", ["bench", "all"]),
    ("safetensors", ["bench", "all", "--size", "bench"]),
    ("transformers", ["bench", "all", "--suites", "lora"]),
    ("peft", ["bench", "all", "--suites", "lora"]),
])
def test_bench_all_names_the_extra_before_it_runs_anything(tmp_path, blocked, args):
    r = _wsync_without([blocked], *args, "--out", tmp_path / "out")
    line = one_line_error(r, code=3)
    assert f"needs {blocked}" in line and 'pip install -e "./benchmarks[all]"' in line, line
    assert r.stdout == "" and not (tmp_path / "out").exists()


def test_bench_all_runs_suites_that_need_no_extra_without_them(tmp_path):
    from wsync_bench.all import check_needs

    check_needs(["transport", "moe", "reshard"])  # imports nothing optional
    r = _wsync_without(["transformers", "safetensors"], "bench", "all", "--suites", "moe", "--out", tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]


@pytest.mark.parametrize("args", [["bench"], ["bench", "codec", "--size", "tiny"], ["bench", "all", "--size", "small"],
                                  ["bench", "--size", "small"]])
def test_bench_without_wsync_bench_says_how_to_install_it_in_one_line(args):
    r = _wsync_without(["wsync_bench"], *args)
    line = one_line_error(r, code=3)
    assert "wsync-bench" in line and "pip install -e ./benchmarks" in line, line
    assert r.stdout == "" and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_bench_where_no_distribution_adds_suites_says_how_to_install_them(monkeypatch, capsys):
    import importlib.metadata

    from wsync.cli import main

    monkeypatch.setattr(importlib.metadata, "entry_points", lambda **kw: [])  # as where wsync-bench never was
    assert main(["bench", "codec"]) == 3
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pip install -e ./benchmarks" in err[0], err


def test_the_other_commands_work_without_wsync_bench():
    r = _wsync_without(["wsync_bench"], "--help")
    assert r.returncode == 0 and "bench" in r.stdout and "pip install -e ./benchmarks" in r.stdout, r.stderr
    assert _wsync_without(["wsync_bench"], "plan", "transfer", "--model", "qwen3-8b").returncode == 0


def test_bench_lists_the_suites_of_wsync_bench_where_it_is_installed():
    pytest.importorskip("wsync_bench")
    r = wsync_cli("bench", "--help")
    assert r.returncode == 0, r.stderr
    listed = set(re.findall(r"^    (\S+)", r.stdout, flags=re.M))
    assert {"codec", "transport", "sync", "reshard", "all", "loop"} <= listed, r.stdout


def test_loop_without_transformers_says_which_extra_in_one_line():
    line = one_line_error(_wsync_without(["transformers"], "loop", "--steps", "1"), code=3)
    assert "wsync loop needs transformers" in line and 'pip install -e ".[hf]"' in line, line


def test_bench_loop_without_transformers_says_which_extra_before_any_run():
    r = _wsync_without(["transformers"], "bench", "loop", "--steps", "1")
    line = one_line_error(r, code=3)
    assert "needs transformers" in line and 'pip install -e "./benchmarks[all]"' in line, line
    assert r.stdout == "" and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_loop_on_ray_without_ray_says_which_extra_in_one_line():
    line = one_line_error(_wsync_without(["ray"], "loop", "--ray", "--steps", "1"), code=3)
    assert "wsync loop needs ray" in line and 'pip install -e ".[ray]"' in line, line


def test_a_missing_module_that_is_not_an_optional_package_still_shows_its_traceback(monkeypatch):
    from wsync import cli

    def broken(a):
        import wsync_no_such_module  # noqa: F401

    monkeypatch.setattr(cli, "_backend", broken)
    with pytest.raises(ModuleNotFoundError):
        cli.main(["backend"])


def test_bench_transport_ucx_without_ucxx_is_one_line_and_exit_3():
    r = _wsync_without(["ucxx"], "bench", "transport", "--transport", "ucx", "--size", "1M", "--repeats", "1")
    line = one_line_error(r, code=3)
    assert "ucxx does not import" in line and 'pip install -e ".[ucx]"' in line, line
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr  # no worker was started to fail on its own


def test_bench_all_skips_ucx_with_the_same_line(monkeypatch):
    from wsync_bench import all as bench_all
    from wsync_bench import transport

    monkeypatch.setitem(sys.modules, "ucxx", None)
    why = transport.ucx_unavailable()
    assert why and "ucxx does not import" in why
    monkeypatch.setattr(transport, "run", lambda *a, **k: {})  # the other rows are not what this checks
    assert bench_all.transport_suite(bench_all.Sizes.small())["ucx"] == {"skipped": why}


# -- the GPU backend's install hint: only where it was asked for -------------------------------------------


def test_bench_output_names_no_gpu_backend_nobody_asked_for():
    r = _wsync_without(["cupy"], "bench", "transport", "--transport", "local", "--size", "1M", "--repeats", "1",
                       env={"WSYNC_BACKEND": ""})
    assert r.returncode == 0, r.stderr
    assert "cupy" not in r.stdout + r.stderr and "wsync[cuda]" not in r.stdout + r.stderr, r.stdout + r.stderr


def test_the_gpu_backend_asked_for_and_missing_says_what_to_install_once(tmp_path):
    r = _wsync_without(["cupy"], "bench", "codec", "--base", tmp_path / "a", "--new", tmp_path / "b",
                       env={"WSYNC_BACKEND": "cuda"})
    line = one_line_error(r, code=3)
    assert "cupy" in line and "wsync[cuda]" in line and r.stdout == "", (line, r.stdout)
