"""What a new user meets on the command line straight after `pip install -e .`: a version, help on every
option, one-line refusals (exit 3) where an optional package is missing, no hints about backends nobody
asked for, and no library deprecation warnings from our own trainer. Missing packages are simulated (a
module set to None, or a shim on PYTHONPATH that raises ImportError): nothing is uninstalled."""
from __future__ import annotations

import logging
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
