"""Integrations: wsync inside the RL frameworks people already run.

One module per framework, each importing its framework only when a function
that needs it runs (``import wsync.integrations.verl`` alone pulls in neither
verl nor ray):

- ``verl``: a ``wsync`` checkpoint-engine backend (``checkpoint_engine.backend=wsync``).
- ``trl``: a ``VLLMClient`` that pushes weights to ``trl vllm-serve`` / ``vllm serve`` through wsync.
- ``openrlhf``: ``broadcast_to_vllm`` over wsync (OpenRLHF has no transport hook: a patch that reaches its Ray
  actors through the job's runtime_env).
- ``slime``: an update-weight class for slime's actor, with a sidecar that writes the reload folders.
- ``prime_rl``: a ``WeightBroadcast`` for prime-rl's trainer, with the same sidecar for its broadcast folders.

docs/integrations.md has the exact lines to change in each framework.
"""
