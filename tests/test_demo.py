"""`wsync demo`, the README's first command: it runs for real (a trainer, two tcp publishers, a spawned
subscriber process), on a small model so it stays quick, and its "bit-exact" is earned, not printed."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from wsync import demo
from wsync.cli import main as cli

SMALL = ["demo", "--steps", "2", "--width", "32"]
ROOT = Path(__file__).resolve().parents[1]


def test_demo_syncs_every_version_bit_exact():
    r = subprocess.run([sys.executable, "-m", "wsync.cli", *SMALL], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr
    lines = r.stdout.strip().splitlines()
    assert lines[-1].endswith("bit-exact") and "NOT" not in r.stdout
    rows = {int(m[1]): m for line in lines if (m := re.match(
        r"\s*(\d+) .*\|\s*([\d.]+ k?B)\s+[\d.]+ \|\s*([\d.]+ k?B)\s+[\d.]+", line))}
    assert sorted(rows) == [0, 1, 2]
    assert rows[0][2] == rows[0][3]  # the first version goes whole either way
    for step in (1, 2):
        full, delta = (_bytes(rows[step][i]) for i in (2, 3))
        assert delta < full, rows[step][0]


def test_demo_reports_a_mismatch_and_fails(monkeypatch, capsys):
    """Change one bit of what the trainer expects: the subscriber's hash must no longer match."""
    raw = demo._raw

    def flipped(t):
        a = raw(t).copy()
        a.reshape(-1)[0] ^= 1
        return a

    monkeypatch.setattr(demo, "_raw", flipped)
    assert cli(SMALL) == 2
    err = capsys.readouterr().err
    assert "NOT bit-exact" in err and "Traceback" not in err


@pytest.mark.parametrize("arg", [["--steps", "0"], ["--width", "4"], ["--lr", "0"]])
def test_demo_refuses_bad_arguments(arg, capsys):
    assert cli(["demo", *arg]) == 2
    assert "wsync demo needs" in capsys.readouterr().err


def test_ci_runs_the_readme_commands():
    """The set-up a newcomer copies is the one CI proves: both commands, the first ending in the demo."""
    readme = (ROOT / "README.md").read_text()
    block = readme.split("## Install and first run", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    commands = block.strip().splitlines()
    assert len(commands) == 2 and commands[0].endswith("&& wsync demo")
    assert "torch==2.13.0" in commands[0] and "download.pytorch.org/whl/cpu" in commands[0]
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    for command in commands:  # as the README has it; "|| exit 1" because set -e lets a failure inside && pass
        assert f"{command} || exit 1" in ci


def _bytes(text: str) -> float:
    n, unit = text.split()
    return float(n) * {"B": 1, "kB": 1e3}[unit]
