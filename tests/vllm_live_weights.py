"""A vLLM worker extension that reads back the weights a worker computes with, byte for byte (tests only).

vLLM's own ``/weight_checker`` route hashes ``model.named_parameters()``. On
vLLM's CPU backend that misses every linear layer: after loading, each one's
weight is packed for oneDNN (or the AMX kernels) inside ``layer.cpu_linear``
and the parameter is replaced by an empty one. So for such a layer this reads
the weight back through the layer's own kernel: ``cpu_linear(I)`` with an
identity input is ``I @ W.T``, and every output element is one product ``1 * w``
plus exact zeros, accumulated in fp32 and rounded back to the weight's dtype:
``w`` itself. (Two values would not survive: ``-0.0`` reads back as ``+0.0``,
and a kernel that flushes denormals would zero them; trained weights of a
random-init model hold neither, and a test comparing bytes would say so.)

Start the server with ``--worker-extension-cls vllm_live_weights.LiveWeights``
and this directory on ``PYTHONPATH``; call it through the dev-mode route
``POST /collective_rpc {"method": "live_weights"}``.
"""
from __future__ import annotations

import base64

import torch

from wsync.engines.vllm import WsyncWorkerExtension


class LiveWeights(WsyncWorkerExtension):
    def live_weights(self) -> dict:
        """{"weights": {name: base64 bytes}, "read_through_kernel": [names], "dtypes": {name: str}, "shapes": ...}"""
        model = self.get_model()
        weights, dtypes, shapes, through_kernel = {}, {}, {}, []
        with torch.inference_mode():
            for mname, module in model.named_modules():
                for pname, param in module.named_parameters(recurse=False):
                    name = f"{mname}.{pname}" if mname else pname
                    t = param.data
                    if pname == "weight" and t.numel() == 0 and getattr(module, "cpu_linear", None) is not None:
                        t = kernel_readout(module)
                        through_kernel.append(name)
                    weights[name] = _b64(t)
                    dtypes[name], shapes[name] = str(t.dtype).removeprefix("torch."), list(t.shape)
        return {"weights": weights, "dtypes": dtypes, "shapes": shapes, "read_through_kernel": through_kernel}

    def kernel_self_check(self) -> dict:
        """For layers that keep their weight beside a packed copy (vLLM's lm_head and embeddings on CPU):
        {name: [readout bytes == parameter bytes]}; shows the readout is exact on this machine's kernels."""
        model = self.get_model()
        out = {}
        with torch.inference_mode():
            for mname, module in model.named_modules():
                w = getattr(module, "weight", None)
                if getattr(module, "cpu_linear", None) is None or not isinstance(w, torch.Tensor) or w.numel() == 0:
                    continue
                read = kernel_readout(module, k=w.shape[1])
                out[f"{mname}.weight"] = _bytes(read) == _bytes(w.data)
        return out


def kernel_readout(module, k: int | None = None) -> torch.Tensor:
    """The [N, K] weight a CPU-dispatched vLLM linear computes with, read through its kernel."""
    k = k if k is not None else module.input_size_per_partition
    dtype = getattr(module, "params_dtype", None) or module.weight.dtype
    eye = torch.eye(k, dtype=dtype)
    return module.cpu_linear(eye, module.weight, None).t().contiguous()


def _bytes(t: torch.Tensor) -> bytes:
    return t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(_bytes(t)).decode()
