"""Channels of versions: promotion behind a gate, rollback in seconds, canaries; see hub.py."""
from .control import Control, call
from .hub import GATE_CHANNEL, ChannelError, Channels, Gate, GateRefused, Promotion, Rollout, channel_for, report
from ..errors import NotHeld
from .store import StateStore

__all__ = ["GATE_CHANNEL", "ChannelError", "Channels", "Control", "Gate", "GateRefused", "NotHeld", "Promotion",
           "Rollout", "StateStore", "call", "channel_for", "report"]
