"""Which TCP addresses a process listens on, read from Linux ``/proc``, and which of them
reach further than they should.

raykv starts Mooncake's servers (the master's RPC and metrics ports, the HTTP metadata
server) bound to chosen addresses and checks afterwards that they listen nowhere else;
a node actor checks its Mooncake client's ports the same way. ``exposed`` names every
listening socket bound beyond its allowed addresses (a wildcard ``0.0.0.0`` / ``::``
included). A process's sockets are the
``socket:[inode]`` links of ``/proc/<pid>/fd``, matched against the LISTEN rows of
``/proc/<pid>/net/tcp`` and ``tcp6``. ``parse_tcp_table`` is pure (unit-tested); the
rest reads ``/proc`` (same uid or root).
"""

from __future__ import annotations

import ipaddress
import os
import socket
from collections.abc import Iterable
from dataclasses import dataclass

LISTEN = 0x0A
"""The kernel's TCP state number for a listening socket (``/proc/net/tcp``'s ``st``)."""


@dataclass(frozen=True, order=True)
class Listener:
    """One listening TCP socket: the address it is bound to (``0.0.0.0`` or ``::``: every
    interface) and its port."""

    address: str
    port: int

    def __str__(self) -> str:
        return f"[{self.address}]:{self.port}" if ":" in self.address else \
            f"{self.address}:{self.port}"


def _address(hex_addr: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """``/proc/net/tcp{,6}``'s hex address (32-bit words, little-endian on the machines
    raykv runs on) as an address; an IPv4-mapped IPv6 address as its IPv4 address."""
    raw = bytes.fromhex(hex_addr)
    address = ipaddress.ip_address(b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4)))
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped:
        return address.ipv4_mapped
    return address


def parse_tcp_table(text: str, inodes: set[int] | None = None) -> list[Listener]:
    """The listening sockets in ``text`` (the contents of ``/proc/<pid>/net/tcp`` or
    ``tcp6``), only those whose inode is in ``inodes`` unless it is None. An IPv4-mapped
    IPv6 address is given as its IPv4 address."""
    out = []
    for line in text.splitlines()[1:]:
        fields = line.split()
        if len(fields) < 10 or int(fields[3], 16) != LISTEN:
            continue
        if inodes is not None and int(fields[9]) not in inodes:
            continue
        hex_addr, hex_port = fields[1].split(":")
        out.append(Listener(str(_address(hex_addr)), int(hex_port, 16)))
    return out


def socket_inodes(pid: int) -> set[int]:
    """Inodes of the sockets process ``pid`` holds open."""
    inodes = set()
    fd_dir = f"/proc/{pid}/fd"
    for fd in os.listdir(fd_dir):
        try:
            target = os.readlink(os.path.join(fd_dir, fd))
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[8:-1]))
    return inodes


def listeners(pid: int) -> list[Listener]:
    """Every TCP socket process ``pid`` listens on (IPv4 and IPv6); ``OSError`` if its
    ``/proc`` entries cannot be read (gone, or another user's)."""
    inodes = socket_inodes(pid)
    out = []
    for table in ("tcp", "tcp6"):
        try:
            with open(f"/proc/{pid}/net/{table}") as f:
                out += parse_tcp_table(f.read(), inodes)
        except FileNotFoundError:  # no IPv6 in this kernel
            continue
    return out


def addresses_of(host: str) -> set[str]:
    """The IP addresses ``host`` (a name or an address) stands for."""
    try:
        return {str(ipaddress.ip_address(host))}
    except ValueError:
        return {info[4][0] for info in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)}


def exposed(found: Iterable[Listener], allowed: Iterable[str]) -> list[Listener]:
    """The listeners of ``found`` bound to an address not in ``allowed`` (IP addresses):
    a wildcard address always is."""
    allowed = {str(ipaddress.ip_address(a)) for a in allowed}
    return [x for x in found if x.address not in allowed]
