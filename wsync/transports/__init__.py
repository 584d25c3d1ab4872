"""Transports move messages; see base.py for the interface and the address form."""
from .base import REGISTRY, Address, Link, Listener, Message, TransportTimeout, connect, listen, parse_address

__all__ = ["REGISTRY", "Address", "Link", "Listener", "Message", "TransportTimeout", "connect", "listen", "parse_address"]
