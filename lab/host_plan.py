"""Pure plan of an emulated multi-host cluster (no ``ip``, no ``tc``, no Ray): names,
addresses, link rates and the commands that build and remove the network.

An emulated cluster ``k`` lives on the private subnet ``10.213.k.0/24`` (``SUBNETS``):
*host 0* is this machine's own network namespace, on the bridge ``rkvh<k>`` at
``10.213.k.1``; *host i* (i >= 1) is the network namespace ``rkvh<k>-<i>`` at
``10.213.k.<i+1>``, joined to the bridge by the veth pair ``rkvh<k>-<i>r`` (this side)
/ ``rkvh<k>-<i>n`` (the host's side). A host's **link** is that pair: shaped with
``tc``'s token bucket (``tbf``) on both ends, so the rate holds each way. Every name
starts with ``NAME_PREFIX``, which is how the clean-up finds leftovers.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable
from dataclasses import dataclass

NAME_PREFIX = "rkvh"
SUBNETS = ipaddress.ip_network("10.213.0.0/16")
"""The /16 raykv's emulated clusters take their /24s from: no network here uses it
(checked before each start against this machine's addresses and routes)."""
MAX_HOSTS = 32
BURST_S = 0.004
"""A shaped link's token bucket holds 4 ms of its rate (at least ``MIN_BURST`` bytes)."""
MIN_BURST = 64 * 1024
QUEUE_S = 0.05
"""Packets wait at most 50 ms in a shaped link's queue, then are dropped (``tbf
latency``): a full link loses packets as a real one does, TCP backs off."""

_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9}
_RATE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(bit|kbit|mbit|gbit)\s*$", re.IGNORECASE)


def parse_rate(text: str) -> int:
    """A link rate as ``tc`` writes it (``100mbit``, ``10gbit``, ``2.5gbit``) in bits per
    second; ``ValueError`` for anything else or a rate under 1 Mbit/s or over 400 Gbit/s."""
    m = _RATE.match(str(text))
    if not m:
        raise ValueError(f"link rate {text!r} is not a number with bit, kbit, mbit or gbit "
                         "(e.g. 10gbit)")
    bits = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if not 10**6 <= bits <= 400 * 10**9:
        raise ValueError(f"link rate {text!r} is outside 1mbit..400gbit")
    return bits


def format_rate(bits: int) -> str:
    """``bits`` per second as ``tc`` reads it (the largest unit that divides it)."""
    for unit in ("gbit", "mbit", "kbit"):
        if bits % _UNITS[unit] == 0:
            return f"{bits // _UNITS[unit]}{unit}"
    return f"{bits}bit"


def choose_index(taken_links: Iterable[str], used: Iterable[str]) -> int:
    """The first cluster index whose bridge does not exist (``taken_links``: every link
    name on this machine) and whose /24 overlaps none of ``used`` (this machine's
    addresses and routes, CIDR strings; the default route is ignored).
    ``RuntimeError`` if none is free."""
    links = set(taken_links)
    nets = [ipaddress.ip_network(u, strict=False) for u in used]
    nets = [n for n in nets if n.prefixlen > 0]
    for k in range(256):
        net = HostPlan(k, 1).subnet
        if bridge_name(k) not in links and not any(net.overlaps(n) for n in nets):
            return k
    raise RuntimeError(f"no free /24 left in {SUBNETS} for an emulated cluster")


def bridge_name(index: int) -> str:
    return f"{NAME_PREFIX}{index}"


def index_of(link_or_netns: str) -> int | None:
    """The cluster index a name of ours carries (``rkvh3``, ``rkvh3-1``, ``rkvh3-1r``),
    None for any other name."""
    m = re.fullmatch(rf"{NAME_PREFIX}(\d+)(?:-\d+[rn]?)?", link_or_netns)
    return int(m.group(1)) if m else None


@dataclass(frozen=True)
class HostPlan:
    """Emulated cluster ``index`` of ``hosts`` hosts, each link shaped to ``rate`` bits per
    second (None: not shaped)."""

    index: int
    hosts: int
    rate: int | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.index <= 255:
            raise ValueError(f"cluster index must be 0..255, got {self.index}")
        if not 1 <= self.hosts <= MAX_HOSTS:
            raise ValueError(f"hosts must be 1..{MAX_HOSTS}, got {self.hosts}")

    @property
    def subnet(self) -> ipaddress.IPv4Network:
        return ipaddress.ip_network(f"{SUBNETS.network_address + (self.index << 8)}/24")

    @property
    def bridge(self) -> str:
        return bridge_name(self.index)

    def address(self, host: int) -> str:
        """Host ``host``'s address (host 0: the bridge's, this machine's namespace)."""
        self._check(host)
        return str(self.subnet.network_address + host + 1)

    def netns(self, host: int) -> str | None:
        """Host ``host``'s network namespace; None for host 0 (this machine's own)."""
        self._check(host)
        return f"{self.bridge}-{host}" if host else None

    def veth(self, host: int) -> tuple[str, str]:
        """Host ``host``'s link: (this side, on the bridge; the host's side)."""
        if host == 0:
            raise ValueError("host 0 is this machine's namespace: it has no link of its own")
        self._check(host)
        return f"{self.bridge}-{host}r", f"{self.bridge}-{host}n"

    def _check(self, host: int) -> None:
        if not 0 <= host < self.hosts:
            raise ValueError(f"host must be 0..{self.hosts - 1}, got {host}")

    def exec_prefix(self, host: int) -> list[str]:
        """The argv prefix that runs a command on host ``host``."""
        ns = self.netns(host)
        return ["ip", "netns", "exec", ns] if ns else []

    def setup_commands(self) -> list[list[str]]:
        """Every command that builds the network, in order (``ip`` and ``tc`` argv)."""
        prefix = self.subnet.prefixlen
        cmds = [["ip", "link", "add", self.bridge, "type", "bridge"],
                ["ip", "addr", "add", f"{self.address(0)}/{prefix}", "dev", self.bridge],
                ["ip", "link", "set", self.bridge, "up"]]
        for h in range(1, self.hosts):
            ns, (near, far) = self.netns(h), self.veth(h)
            cmds += [["ip", "netns", "add", ns],
                     ["ip", "link", "add", near, "type", "veth", "peer", "name", far],
                     ["ip", "link", "set", far, "netns", ns],
                     ["ip", "link", "set", near, "master", self.bridge],
                     ["ip", "link", "set", near, "up"],
                     ["ip", "-n", ns, "addr", "add", f"{self.address(h)}/{prefix}", "dev", far],
                     ["ip", "-n", ns, "link", "set", far, "up"],
                     ["ip", "-n", ns, "link", "set", "lo", "up"]]
            if self.rate is not None:
                cmds += self.shape_commands(h, self.rate)
        return cmds

    def shape_commands(self, host: int, rate: int) -> list[list[str]]:
        """Shape host ``host``'s link to ``rate`` bits per second each way (``tbf`` on
        both ends; replaces any shaping before)."""
        near, far = self.veth(host)
        burst = max(MIN_BURST, int(rate / 8 * BURST_S))
        tbf = ["root", "tbf", "rate", format_rate(rate), "burst", str(burst),
               "latency", f"{int(QUEUE_S * 1000)}ms"]
        return [["tc", "qdisc", "replace", "dev", near, *tbf],
                ["ip", "netns", "exec", self.netns(host), "tc", "qdisc", "replace", "dev",
                 far, *tbf]]

    def unshape_commands(self, host: int) -> list[list[str]]:
        """Remove host ``host``'s shaping (both ends): the link runs at what the machine
        moves through a veth pair. Fails (``tc``: no such qdisc) on a link not shaped."""
        near, far = self.veth(host)
        return [["tc", "qdisc", "del", "dev", near, "root"],
                ["ip", "netns", "exec", self.netns(host), "tc", "qdisc", "del", "dev", far,
                 "root"]]

    def link_commands(self, host: int, up: bool) -> list[list[str]]:
        """Take host ``host``'s link down (both ends: nothing passes either way) or up."""
        near, far = self.veth(host)
        state = "up" if up else "down"
        return [["ip", "link", "set", near, state],
                ["ip", "-n", self.netns(host), "link", "set", far, state]]
