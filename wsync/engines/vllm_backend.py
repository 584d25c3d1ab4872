"""The "wsync" backend for vLLM's weight-transfer engine (imported by vLLM's factory, inside vLLM only).

vLLM's control plane (init / start / update / finish, as dicts over its RPC or
HTTP routes) carries only small JSON-able values here: the wsync address and
token at init, a version number per update. The weights themselves arrive over
the wsync transport, are checked by the wsync codec, and are loaded through
``model.load_weights`` inside vLLM's update call. Layerwise mode (quantized
models, and vLLM's CPU backend, whose linear layers keep only a prepacked copy
of their weights) runs one of vLLM's layerwise reloads per applied version, so
vLLM's own post-processing runs as for its built-in backends.
"""
from __future__ import annotations

from dataclasses import dataclass

from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from ..subscriber import Subscriber
from .vllm import LoadWeights


@dataclass
class WsyncInitInfo(WeightTransferInitInfo):
    address: str  # the trainer's Publisher, e.g. "tcp://trainer:7070"
    token: str | None = None  # the Publisher's auth token, hex (prefer token_id: request bodies get logged)
    token_id: str | None = None  # the token's fingerprint; the token itself comes from WSYNC_TOKEN / WSYNC_TOKEN_FILE
    timeout_s: float = 600.0  # how long update_weights waits for a version to arrive
    # True: vLLM's layerwise reload, fed every tensor of every version (quantized models); False: the changed
    # tensors in place, unless the model keeps kernel-format weights load_weights cannot reach (CPU backend)
    layerwise: bool = False


@dataclass
class WsyncUpdateInfo(WeightTransferUpdateInfo):
    version: int  # apply this version (or a newer one already received)


class WsyncWeightTransferEngine(WeightTransferEngine[WsyncInitInfo, WsyncUpdateInfo]):
    init_info_cls = WsyncInitInfo
    update_info_cls = WsyncUpdateInfo

    def init_transfer_engine(self, init_info: WsyncInitInfo) -> None:
        self.timeout_s, self.layerwise = init_info.timeout_s, init_info.layerwise
        # follows set_weight_update_target (draft models); the device is the worker's, never the model's
        # parameters' (a layerwise reload has them on meta)
        self.engine = LoadWeights(lambda: self.model, layerwise=True if init_info.layerwise else "auto",
                                  device=self.device, model_config=lambda: self.model_config)
        from ..tokens import engine_token

        token = bytes.fromhex(init_info.token) if init_info.token else engine_token(init_info.token_id)
        self.sub = Subscriber(init_info.address, engine=self.engine, token=token, apply="poll")

    def start_weight_update(self) -> None:
        pass  # the layerwise reload brackets each applied version (several may land in one update call)

    def receive_weights(self, update_info: WsyncUpdateInfo) -> None:
        self.sub.wait_for(update_info.version, timeout=self.timeout_s)

    def finish_weight_update(self) -> None:
        pass

    def shutdown(self) -> None:
        sub = getattr(self, "sub", None)
        if sub is not None:
            sub.close()
