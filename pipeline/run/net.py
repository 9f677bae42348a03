"""Network addresses a component publishes in the run directory: which interface it binds (loopback,
the node's hostname, or a named interface) and a free port on it."""

from __future__ import annotations

import fcntl
import os
import socket
import struct


def interface_address(name: str) -> str:
    """IPv4 address of a network interface (SIOCGIFADDR)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name[:15].encode()))
    return socket.inet_ntoa(packed[20:24])


def bind_address(mode: str | None = None, default: str = "127.0.0.1") -> str:
    """Resolve LOCKSTEP_BIND (set from the cluster profile): loopback | hostname | interface:NAME."""
    mode = mode or os.environ.get("LOCKSTEP_BIND")
    if not mode:
        return default
    if mode == "loopback":
        return "127.0.0.1"
    if mode == "hostname":
        return socket.gethostbyname(socket.gethostname())
    if mode.startswith("interface:"):
        return interface_address(mode.split(":", 1)[1])
    raise ValueError(f"LOCKSTEP_BIND={mode!r}: use loopback, hostname or interface:NAME")


def free_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on now (the OS picks it; a rendezvous file then tells the others)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
