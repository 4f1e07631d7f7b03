"""Socket helpers shared by the channel's unit and integration tests (no raykv import)."""

from __future__ import annotations

import socket


def closed_by_peer(sock: socket.socket, wait_s: float) -> bool:
    """Whether the peer closed ``sock`` (EOF or reset) within ``wait_s`` seconds; any
    bytes it sent first are skipped."""
    sock.settimeout(wait_s)
    try:
        while sock.recv(1 << 16):
            pass
    except (ConnectionResetError, BrokenPipeError):
        pass
    except TimeoutError:
        return False
    return True
