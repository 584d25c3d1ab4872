"""slime and prime-rl: the trainer-side classes publish over wsync tcp and a sidecar writes the folders
the framework reloads from (slime weight_v{N:06d}, prime-rl broadcasts/step_{N} + STABLE), byte for byte.

Neither framework installs on CPU (Megatron/SGLang, prime-rl is not on PyPI), so their HF converters
are replaced by the hf_chunks / hf_state hooks; signatures are checked against their source elsewhere.
"""
import torch
from safetensors.torch import load_file

from engine_helpers import rl_step, same_bytes, tiny_qwen
from helpers import TOKEN_HEX


def test_slime_update_weights_to_disk_dirs(tmp_path):
    import wsync.integrations.slime as ws

    trainer = tiny_qwen(0, tie=False)
    ws._CONFIG = ws.SyncConfig(address="tcp://127.0.0.1:0", token=TOKEN_HEX)
    up = ws.WsyncUpdateWeight(None, [trainer], dict, model_name="qwen3", quantization_config=None,
                              hf_chunks=lambda: [list(trainer.state_dict().items())])
    up.connect_rollout_engines([], None)
    side = ws.sidecar(up.address, tmp_path, token=TOKEN_HEX, keep=2)
    gen = torch.Generator().manual_seed(11)
    try:
        for _ in range(3):
            rl_step(trainer, gen)
            up.update_weights()  # returns once the sidecar wrote the folder
            folder = ws.version_dir(tmp_path, up.weight_version)
            assert same_bytes(trainer.state_dict(), load_file(folder / "model.safetensors"))
            assert up.pop_metrics()["wsync/wire_bytes"] >= 0
        assert sorted(p.name for p in tmp_path.iterdir()) == ["weight_v000002", "weight_v000003"]
    finally:
        side.close()
        up._pub.close()


def test_prime_rl_broadcast_to_step_dirs(tmp_path):
    import wsync.integrations.prime_rl as wp

    trainer = tiny_qwen(0, tie=False)
    wp._CONFIG = wp.SyncConfig(address="tcp://127.0.0.1:0", token=TOKEN_HEX, keyframe_every=2)
    bc = wp.WsyncWeightBroadcast(tmp_path / "run", hf_state=lambda m: m.state_dict())
    side = wp.sidecar(wp._CONFIG.dial_address(bc._pub), tmp_path / "infer", token=TOKEN_HEX, keep=3)
    gen = torch.Generator().manual_seed(12)
    try:
        for step in (1, 2, 5):
            rl_step(trainer, gen)
            bc.broadcast_weights(trainer, step)
            folder = wp.step_dir(tmp_path / "infer", step)
            assert (folder / "STABLE").exists()
            assert same_bytes(trainer.state_dict(), load_file(folder / "model.safetensors"))
    finally:
        side.close()
        bc.close()


def test_step_dirs_never_replace_or_remove_a_folder_wsync_did_not_write(tmp_path):
    """A folder already at a version's path that wsync did not write (a user's, another tool's) stays as it
    was and the write is refused; folders it wrote are replaced and aged out."""
    import pytest

    from wsync.errors import OutputError
    from wsync.integrations.disk import StepDirs
    from wsync.snapshot import as_state

    dirs = StepDirs(lambda v: tmp_path / f"step_{v}", marker="STABLE", keep=1)
    dirs.state = as_state({"w": torch.arange(6, dtype=torch.float32)})
    foreign = tmp_path / "step_2"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    dirs.version = 1
    assert (tmp_path / "step_1" / "STABLE").exists()
    with pytest.raises(OutputError):
        dirs.version = 2
    assert (foreign / "notes.txt").read_text() == "mine" and sorted(p.name for p in foreign.iterdir()) == ["notes.txt"]
    dirs.version = 3  # keep=1: step_1 (ours) is removed
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_2", "step_3"]
