"""TCP ports on this host: picking a free one, and whether something listens on one.

Used to start Mooncake's processes (``mooncake_master``, ``mooncake_client``) on free
ports and to wait until they accept connections.
"""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that nothing listens on right now."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def listening(host: str, port: int) -> bool:
    """Whether a TCP connection to ``host:port`` is accepted within 0.2 s."""
    try:
        with socket.create_connection((host, port), timeout=0.2):
            return True
    except OSError:
        return False
