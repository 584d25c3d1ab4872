"""OpenRLHF: the real vLLM worker extension (openrlhf 0.11.2 WorkerWrap, patched) follows the patched
broadcast_to_vllm over wsync tcp, bit-exact. ActorPPOTrainer needs ray and DeepSpeed, so the trainer
functions run on a stand-in trainer object (its signatures are checked against OpenRLHF's source in
test_integrations_signatures.py); each Ray engine handle is a stand-in that calls WorkerWrap in-process.
"""
from types import SimpleNamespace

import pytest
import torch

from engine_helpers import rl_step, same_bytes, tiny_qwen



def _load_worker_wrap():
    """openrlhf.trainer.ray's __init__ imports ray; the worker extension's own file imports nothing, so load it alone."""
    import importlib.util
    import sys
    from pathlib import Path

    spec = importlib.util.find_spec("openrlhf")
    if spec is None:
        pytest.skip("pip install torch==2.13.0 --no-deps openrlhf", allow_module_level=True)
    name = "openrlhf.trainer.ray.vllm_worker_wrap"
    if name not in sys.modules:
        path = Path(spec.origin).parent / "trainer" / "ray" / "vllm_worker_wrap.py"
        mod_spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(mod_spec)
        mod_spec.loader.exec_module(module)
        sys.modules[name] = module
    return sys.modules[name]


wrap = _load_worker_wrap()

TOKEN = "ef" * 16


class Served(torch.nn.Module):
    """vLLM's model as the worker sees it: load_weights over (name, tensor) pairs."""

    def __init__(self, model):
        super().__init__()
        self.inner = model

    def load_weights(self, weights):
        params = dict(self.inner.named_parameters())
        for name, t in weights:
            params[name].data.copy_(t)


class Handle:
    """A Ray actor handle stand-in: .method.remote(...) runs the worker's method now."""

    def __init__(self, worker):
        self.worker = worker

    def __getattr__(self, name):
        return SimpleNamespace(remote=getattr(self.worker, name))


def test_broadcast_to_vllm_over_wsync():
    import wsync.integrations.openrlhf as wo

    wo.patch_worker()
    try:
        trainer, served = tiny_qwen(0, tie=False), tiny_qwen(1, tie=False)
        worker = wrap.WorkerWrap()
        worker.model_runner = SimpleNamespace(model=Served(served))
        args = SimpleNamespace(vllm=SimpleNamespace(sync_backend="wsync", tensor_parallel_size=1),
                               ds=SimpleNamespace(zero_stage=2, tensor_parallel_size=1))
        me = SimpleNamespace(strategy=SimpleNamespace(args=args), vllm_engines=[Handle(worker)],
                             actor=SimpleNamespace(model=SimpleNamespace(module=trainer)))
        wo._CONFIG = wo.SyncConfig(address="tcp://127.0.0.1:0", token=TOKEN, keyframe_every=3)
        wo.init_vllm_sync_group(me, "wsync")
        gen = torch.Generator().manual_seed(9)
        for v in range(4):
            rl_step(trainer, gen)
            wo.broadcast_to_vllm(me)
            assert worker._wsync_sub.version == v
            assert same_bytes(trainer.state_dict(), served.state_dict())
        me._wsync_pub.close()
        worker._wsync_sub.close()
    finally:
        wo.unpatch()


def test_other_backends_reach_openrlhf_code(monkeypatch):
    import wsync.integrations.openrlhf as wo

    monkeypatch.setattr(torch.distributed, "get_rank", lambda *a: 1)  # a vLLM worker other than rank 0

    original = wrap.WorkerWrap.update_weight
    wo.patch_worker()
    try:
        w = wrap.WorkerWrap()
        w.model_config = SimpleNamespace(dtype=torch.float32)
        with pytest.raises(AssertionError, match="mismatch dtype"):  # OpenRLHF's own check ran
            w.update_weight("model.norm.weight", torch.bfloat16, (4,))
    finally:
        wo.unpatch()
    assert wrap.WorkerWrap.update_weight is original
