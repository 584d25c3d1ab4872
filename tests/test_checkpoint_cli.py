"""Real checkpoints on disk: safetensors files and sharded transformers folders, through the CLI."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import wsync
from wsync.cli import main as cli

from conftest import states_equal


def _tiny_qwen3():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False)
    return Qwen3ForCausalLM(cfg).to(torch.bfloat16)


def _train_step(model):
    """One real AdamW step on fp32 masters, exported as bf16 (what an RL trainer publishes)."""
    master = {k: v.float().clone().requires_grad_(True) for k, v in model.state_dict().items()}
    opt = torch.optim.AdamW(master.values(), lr=1e-3)
    loss = sum((p.float() ** 2).mean() for p in master.values())
    loss.backward()
    opt.step()
    model.load_state_dict({k: v.detach().to(torch.bfloat16) for k, v in master.items()})


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    model = _tiny_qwen3()
    model.save_pretrained(root / "base", max_shard_size="200KB")
    _train_step(model)
    model.save_pretrained(root / "new", max_shard_size="200KB")
    return root


def _load_folder(path: Path) -> dict:
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def test_sharded_folder_roundtrip_via_cli(folders, tmp_path, capsys):
    base, new = folders / "base", folders / "new"
    assert (base / "model.safetensors.index.json").exists()  # really sharded
    for tier in ("sparse", "packed"):
        delta = tmp_path / f"{tier}.wsd"
        assert cli(["delta", "encode", str(base), str(new), "-o", str(delta), "--tier", tier, "--version", "1", "--base-version", "0"]) == 0
        out = tmp_path / f"out-{tier}"
        assert cli(["delta", "apply", str(base), str(delta), "-o", str(out)]) == 0
        assert states_equal(_load_folder(out), _load_folder(new))
        assert json.loads((out / "model.safetensors.index.json").read_text())["weight_map"] == \
            json.loads((new / "model.safetensors.index.json").read_text())["weight_map"]
        assert (out / "config.json").exists()
        from transformers import Qwen3ForCausalLM

        reloaded = Qwen3ForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
        assert states_equal({k: v for k, v in reloaded.state_dict().items()}, _load_folder(new))
    capsys.readouterr()
    assert cli(["inspect", str(tmp_path / "packed.wsd"), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["codec"] == "delta" and info["tier"] == "packed" and info["version"] == 1
    assert 0 < info["density"] < 1 and info["ratio"] > 1
    assert cli(["inspect", str(tmp_path / "packed.wsd")]) == 0
    assert "bits per changed element" in capsys.readouterr().out


def test_single_files_roundtrip_and_safetensors_compat(tmp_path):
    base = {"a": torch.randn(64, 33).to(torch.bfloat16), "b": torch.arange(10, dtype=torch.int32)}
    new = {"a": (base["a"].float() * 1.001).to(torch.bfloat16), "b": base["b"] + 1}
    save_file(base, tmp_path / "base.safetensors", metadata={"format": "pt"})
    save_file(new, tmp_path / "new.safetensors", metadata={"format": "pt"})
    p = wsync.encode(tmp_path / "base.safetensors", tmp_path / "new.safetensors")
    p.write(tmp_path / "d.wsd")
    wsync.api.apply_to_checkpoint(tmp_path / "base.safetensors", tmp_path / "d.wsd", tmp_path / "out.safetensors")
    assert states_equal(load_file(tmp_path / "out.safetensors"), new)
    assert states_equal(wsync.apply(tmp_path / "base.safetensors", tmp_path / "d.wsd"), new)


def test_cli_refuses_bad_delta_and_writes_nothing(folders, tmp_path, capsys):
    base, new = folders / "base", folders / "new"
    delta = tmp_path / "d.wsd"
    assert cli(["delta", "encode", str(base), str(new), "-o", str(delta)]) == 0
    blob = bytearray(delta.read_bytes())
    blob[-3] ^= 0xFF
    bad = tmp_path / "bad.wsd"
    bad.write_bytes(bytes(blob))
    out = tmp_path / "out"
    assert cli(["delta", "apply", str(base), str(bad), "-o", str(out)]) == 2
    assert "checksum" in capsys.readouterr().err
    assert not out.exists()
    # applying to the wrong base (the new folder) is refused as well
    assert cli(["delta", "apply", str(new), str(delta), "-o", str(out)]) == 2
    assert "differs from the one this delta was made against" in capsys.readouterr().err
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp litter


def test_console_script_installed():
    r = subprocess.run([sys.executable, "-m", "wsync.cli", "backend"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip()
