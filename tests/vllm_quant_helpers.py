"""What the quantized-vLLM tests share: compressed-tensors checkpoints written from a trainer's BF16 state by
wsync.quant, and a worker extension that reads back what vLLM's workers hold.

vLLM's workers import this module by name (``worker_extension_cls``), so it imports neither vLLM nor pytest
at the top: the workers find it through PYTHONPATH, which the tests point at this folder.
"""
from __future__ import annotations

import hashlib
import json
import os

from wsync.engines.vllm import WsyncWorkerExtension, onednn_scales_kept

PROBE = "vllm_quant_helpers.QuantProbe"
# vLLM's packed_modules_mapping for Qwen3: the checkpoint modules each of its fused linear layers holds, in order
FUSED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}

# compressed-tensors W8A8 INT8: channel weights, dynamic per-token activations (what vLLM's CPU build serves
# with oneDNN); lm_head stays BF16, as quantized checkpoints leave it
INT8_W8A8 = {
    "quant_method": "compressed-tensors", "format": "int-quantized", "quantization_status": "compressed",
    "ignore": ["lm_head"],
    "config_groups": {"group_0": {
        "targets": ["Linear"], "format": "int-quantized",
        "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel", "dynamic": False},
        "input_activations": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token",
                              "dynamic": True}}},
}


# compressed-tensors W4A16: symmetric INT4 in groups of 32, "pack-quantized" (Kimi K2's format for its routed
# experts; here on every Linear of a dense model, which vLLM's CPU build serves without AMX)
INT4_W4A16 = {
    "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
    "ignore": ["lm_head"],
    "config_groups": {"group_0": {
        "targets": ["Linear"], "format": "pack-quantized",
        "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32,
                    "dynamic": False}}},
}


def write_checkpoint(path: str, config: dict, quantization_config: dict, state: dict) -> None:
    """A quantized checkpoint folder as vLLM reads one: config.json (the model's config with its
    quantization_config) and model.safetensors holding `state` (the quantizer's output, checkpoint names)."""
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({**config, "quantization_config": quantization_config}, f)
    save_file({n: t.contiguous() for n, t in state.items()}, os.path.join(path, "model.safetensors"))


def dequantized(model, quantized: dict):
    """A float32 copy of `model` holding the weights `quantized` stands for (INT8 channel or INT4 group: code x
    scale, exact in float32), for transformers' tokens to hold a quantized engine's to."""
    import copy

    import torch

    from wsync.quant.ref import unpack_int4

    out = copy.deepcopy(model).float()
    state = {}
    for name in out.state_dict():
        scale = quantized.get(f"{name}_scale")
        packed = quantized.get(f"{name}_packed")
        if packed is not None:  # INT4 groups: code x its group's scale
            codes = torch.from_numpy(unpack_int4(packed.numpy())).float()
            groups = codes.reshape(*scale.shape, -1) * scale.float()[..., None]
            state[name] = groups.reshape(codes.shape)
        else:
            state[name] = quantized[name].float() if scale is None else quantized[name].float() * scale.float()
    out.load_state_dict(state)
    return out


def quantized_layers(quantized: dict, fused: dict[str, list[str]]) -> dict[str, list[str]]:
    """vLLM module name -> the checkpoint modules it holds, in order, for every quantized module in
    `quantized` (a module whose ``weight_scale`` is there); fused: vLLM's packed_modules_mapping."""
    modules = [n[: -len(".weight_scale")] for n in quantized if n.endswith(".weight_scale")]
    out: dict[str, list[str]] = {}
    for m in modules:
        parent, _, leaf = m.rpartition(".")
        into = next((f for f, parts in fused.items() if leaf in parts), leaf)
        out.setdefault(f"{parent}.{into}", []).append(m)
    for name, parts in out.items():
        leaf = name.rpartition(".")[2]
        if leaf in fused:
            order = fused[leaf]
            parts.sort(key=lambda m: order.index(m.rpartition(".")[2]))
    return out


class QuantProbe(WsyncWorkerExtension):
    """wsync's worker extension, plus what the tests read from a worker: its tensors and a reload from disk."""

    def probe_held(self) -> dict:
        """{name: sha256 of dtype, shape and bytes} of every parameter and buffer the model holds."""
        import torch

        out = {}
        model = self.get_model()
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if t is None or t.device.type == "meta":
                continue
            raw = t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()
            out[name] = hashlib.sha256(f"{t.dtype}{tuple(t.shape)}".encode() + raw).hexdigest()
        return out

    def probe_tensor(self, name: str) -> list:
        """[dtype, shape, bytes as hex] of one parameter or buffer (by its name in the model)."""
        import torch

        t = dict([*self.get_model().named_parameters(), *self.get_model().named_buffers()])[name]
        raw = t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()
        return [str(t.dtype), list(t.shape), raw.hex()]

    def probe_committed(self) -> dict:
        """The newest version this worker's Subscriber committed: version, wire bytes, whether a keyframe."""
        last = self.wsync_sub.stats.last
        return {"version": last.version, "bytes": last.bytes, "keyframe": last.keyframe}

    def probe_reload(self, path: str) -> None:
        """Load the checkpoint folder `path` with vLLM's own reload (its loader reading the files), kept
        correct on the CPU backend's INT8 layers as wsync's own layerwise reload is."""
        with onednn_scales_kept():
            self.reload_weights(weights_path=path)
