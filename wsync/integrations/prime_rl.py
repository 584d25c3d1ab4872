"""prime-rl: a WeightBroadcast that publishes through wsync; inference hosts get their step folders from a sidecar.

prime-rl's trainer (PrimeIntellect-ai/prime-rl, checked at commit 559b447)
sends weights through a ``WeightBroadcast`` (``broadcast_weights(model, step)``)
built by ``setup_weight_broadcast`` from ``weight_broadcast.type``: filesystem,
nccl or nixl. With ``filesystem`` the trainer writes a full HF checkpoint to
``<output_dir>/broadcasts/step_{N}`` and marks it ``STABLE``; the orchestrator
watches for that marker and has vLLM reload the folder. ``WsyncWeightBroadcast``
gathers the same HF state dict (prime-rl's ``gather_weights_parallel`` +
``convert_state_dict_to_hf``) and publishes it from the master rank as version
``step``; a sidecar on each inference host (``sidecar`` below) writes
``broadcasts/step_{N}/model.safetensors`` and ``STABLE`` exactly where the
orchestrator looks, so orchestrator and vLLM run unchanged. The type is a
closed choice in prime-rl's config, so ``patch()`` replaces
``setup_weight_broadcast`` in the trainer modules: with ``type = "filesystem"``
it returns ``WsyncWeightBroadcast``. LoRA adapters are not routed (full weights only).

Where the patch runs: prime-rl's trainer is its own torchrun job
(``torchrun ... -m prime_rl.trainer.rl.train @ trainer.toml``, started by the
``rl`` launcher or by hand) and has no plugin or hook of its own: its
``vllm.general_plugins`` entry point serves the inference server only. So the
trainer is started through this module instead:
``torchrun ... -m wsync.integrations.prime_rl @ trainer.toml`` patches every
rank with the config in ``WSYNC_PRIME_RL`` (JSON of SyncConfig fields plus
``sidecars``), then runs prime-rl's own ``prime_rl.trainer.rl.train.main``.
The ``rl`` launcher names its trainer module in code, so a run through wsync
starts the trainer itself (prime-rl's multi-node layout does that anyway).
"""
from __future__ import annotations

import importlib
from pathlib import Path

from .common import SyncConfig, env_config

BASE = ("prime_rl.transports.weights.base", "WeightBroadcast")
TRAINERS = ("prime_rl.trainer.rl.train", "prime_rl.trainer.sft.train")  # modules that import setup_weight_broadcast
OVERRIDES = [("prime_rl.transports.weights.base", "WeightBroadcast.broadcast_weights")]
CALLS = [("prime_rl.transports.weights.__init__", "setup_weight_broadcast", 2, ("parallel_dims", "lora_config"), False),
         ("prime_rl.utils.weights", "gather_weights_parallel", 1, (), False),
         ("prime_rl.utils.weights", "convert_state_dict_to_hf", 2, (), False)]

CONFIG_ENV = "WSYNC_PRIME_RL"  # JSON: SyncConfig fields and "sidecars", in the trainer's environment
_CONFIG = SyncConfig()
_SIDECARS = 1  # inference hosts each step must reach before broadcast_weights returns


def step_dir(output_dir, step: int) -> Path:
    """prime-rl's get_step_path(get_broadcast_dir(output_dir), step)."""
    return Path(output_dir) / "broadcasts" / f"step_{step}"


class WsyncWeightBroadcast:
    """prime-rl's WeightBroadcast interface over a wsync Publisher on the master rank."""

    def __init__(self, output_dir: Path, lora_config=None, *, hf_state=None):
        self.output_dir, self.lora_config = output_dir, lora_config
        self._hf_state = hf_state  # tests / custom models: model -> {hf_name: tensor}, called on every rank
        self._pub = _CONFIG.publisher() if _master() else None

    def broadcast_weights(self, model, step: int) -> None:
        state = self._gather(model)  # collective (FSDP / DTensor): every rank takes part
        if self._pub is not None:
            from .common import host_state

            self._pub.wait_for_subscribers(_SIDECARS, timeout=_CONFIG.timeout_s)
            self._pub.publish(host_state(state.items()), version=step)
            self._pub.flush(_CONFIG.timeout_s)  # every sidecar has written step_{N} and STABLE

    def _gather(self, model) -> dict:
        if self._hf_state is not None:
            return self._hf_state(model)
        w = importlib.import_module("prime_rl.utils.weights")
        return w.convert_state_dict_to_hf(model, w.gather_weights_parallel(model))

    def maybe_clean(self, step: int, interval_to_keep: int | None) -> None:
        """Sidecars keep their own folders (``keep``); nothing is written on the trainer."""

    def close(self) -> None:
        if self._pub is not None:
            self._pub.close()


def _master() -> bool:
    import torch.distributed as dist

    return not dist.is_initialized() or dist.get_rank() == 0


def patch(sidecars: int = 1, **config) -> None:
    """In the trainer: weight_broadcast.type = "filesystem" goes through wsync (config: SyncConfig fields)."""
    global _CONFIG, _SIDECARS
    _CONFIG, _SIDECARS = SyncConfig(**config), sidecars
    for name in TRAINERS:
        mod = importlib.import_module(name)
        original = getattr(mod, "setup_weight_broadcast")

        def setup(output_dir, config, parallel_dims=None, lora_config=None, _original=original):
            if getattr(config, "type", None) == "filesystem" and lora_config is None:
                return WsyncWeightBroadcast(output_dir, lora_config)
            return _original(output_dir, config, parallel_dims, lora_config)

        mod.setup_weight_broadcast = setup


def sidecar(address: str, output_dir, *, token: str | None = None, keep: int = 2):
    """On each inference host: write every step to <output_dir>/broadcasts/step_{N} with STABLE."""
    from .disk import sidecar as start

    return start(address, lambda v: step_dir(output_dir, v), token=token, marker="STABLE", keep=keep)


def main() -> None:
    """torchrun ... -m wsync.integrations.prime_rl @ trainer.toml: prime-rl's RL trainer, patched on every rank."""
    from dataclasses import fields

    config, extra = env_config(CONFIG_ENV, ("sidecars",))
    patch(sidecars=int(extra.get("sidecars", 1)), **{f.name: getattr(config, f.name) for f in fields(config)})
    importlib.import_module(TRAINERS[0]).main()  # parses sys.argv[1:] as prime-rl's trainer does


if __name__ == "__main__":
    main()
