"""flash-attn stand-in (CUDA-only build): importable names that refuse to run."""
