"""Engine adapters: what a Subscriber loads weights into (see base.py)."""
from .base import Engine
from .hf import HF
from .shadow import Shadow

__all__ = ["Engine", "HF", "Shadow"]
