"""The "wsync" backend for vLLM's weight-transfer engine (imported by vLLM's factory, inside vLLM only).

vLLM's control plane (init / start / update / finish, as dicts over its RPC or
HTTP routes) carries only small JSON-able values here: the wsync address and
token at init, a version number per update. The weights themselves arrive over
the wsync transport, are checked by the wsync codec, and are loaded through
``model.load_weights`` between vLLM's start and finish calls, so vLLM's own
post-processing (layerwise reload for quantized models) runs as for its
built-in backends.
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
    layerwise: bool = False  # quantized models: vLLM's layerwise reload, fed every tensor of every version


@dataclass
class WsyncUpdateInfo(WeightTransferUpdateInfo):
    version: int  # apply this version (or a newer one already received)


class WsyncWeightTransferEngine(WeightTransferEngine[WsyncInitInfo, WsyncUpdateInfo]):
    init_info_cls = WsyncInitInfo
    update_info_cls = WsyncUpdateInfo

    def init_transfer_engine(self, init_info: WsyncInitInfo) -> None:
        self.timeout_s, self.layerwise = init_info.timeout_s, init_info.layerwise
        # follows set_weight_update_target (draft models); layerwise reload processes a layer once all of it
        # arrived, so it needs whole versions, while plain in-place loading takes just the changed tensors
        self.engine = LoadWeights(lambda: self.model, whole=init_info.layerwise)
        from ..integrations.common import engine_token

        token = bytes.fromhex(init_info.token) if init_info.token else engine_token(init_info.token_id)
        self.sub = Subscriber(init_info.address, engine=self.engine, token=token, apply="poll")

    def start_weight_update(self) -> None:
        if not self.layerwise:
            return
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def receive_weights(self, update_info: WsyncUpdateInfo) -> None:
        self.sub.wait_for(update_info.version, timeout=self.timeout_s)

    def finish_weight_update(self) -> None:
        if not self.layerwise:
            return
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def shutdown(self) -> None:
        sub = getattr(self, "sub", None)
        if sub is not None:
            sub.close()
