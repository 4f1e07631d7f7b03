"""The simulator's cost model: what a block costs to load from each tier, what a token
costs to compute, what a link carries (pure).

Every default says where it comes from: raykv's own measurements in
``docs/benchmarks.md`` (the H200 lease of ``raykv bench-gpu`` and the emulated hosts of
``raykv bench-hosts``), a model's architecture, or an assumption (no raykv benchmark
measures it: a parameter to set from one's own engine).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from raykv_lab.sim.trace import BLOCK_TOKENS

GB = 1e9


@dataclass(frozen=True)
class Costs:
    """Speeds of one engine, node and link (see each field)."""

    kv_bytes_per_token: int = 131072
    """Llama-3-8B's KV in bf16: 2 (K, V) x 32 layers x 8 KV heads x 128 x 2 bytes
    (architecture, not measured)."""
    prefill_tokens_per_s: float = 10000.0
    """An engine's prefill rate: an assumption (no raykv benchmark runs a GPU model's
    prefill); set it from the engine's own figure."""
    decode_tokens_per_s: float = 50.0
    """One request's decode rate (the time after its first token): an assumption."""
    l2_load_gbps: float = 20.0
    """L2 -> GPU: vLLM's KV cache loaded from L2, 20.0-21.0 GB/s (``bench-gpu``, H200)."""
    l2_call_s: float = 0.0004
    """The node actor's L2 op as seen by a worker, 0.36-0.40 ms (``bench-gpu``)."""
    host_load_gbps: float = 36.7
    """A per-engine host tier -> GPU: torch pinned h2d into vLLM's KV cache, the lowest
    of 35.7-43.8 GB/s (``bench-gpu``): an engine's own CPU offload copies at that rate."""
    store_get_gbps: float = 2.97
    """An L3 read: raykv's whole get of 256 KiB pages over Mooncake's TCP, 2.97 GB/s
    (``bench-gpu``; 2.4-3.1 in the vLLM rounds)."""
    store_put_gbps: float = 2.0
    """An L3 write: raykv's whole put of 256 KiB pages, 2.00 GB/s (``bench-gpu``)."""
    store_call_s: float = 0.00033
    """raykv's per-call overhead over a raw Mooncake get, 0.32-0.33 ms (``bench``)."""
    link_gbit: float = 25.0
    """Each node's link, Gbit/s each way: an assumption (a common data-centre NIC)."""
    link_efficiency: float = 0.94
    """The share of a link a transfer fills: 0.94 of a shaped 1 Gbit/s link, raykv and
    raw Mooncake alike, seen in a ``bench-hosts`` run of which no JSON was recorded (an
    assumption of the model, as ``link_gbit`` is)."""
    object_bytes: int = 1 << 20
    """One Mooncake object of raykv's with vLLM: the K or the V of one 16-token block of
    Llama-3-8B, 1 MiB (architecture; the object of ``bench-scale-down``'s drain rate and
    of ``disk_tier``'s figures below)."""
    disk_get_gbps: float = 0.39
    """A get served from a node's disk tier: the sealed client's cold gets of 1 MiB
    objects, 0.39 GB/s (``disk_tier``, median of 5 passes; each object's seal check is
    in it)."""
    seal_check_s_per_mib: float = 0.00027
    """A cluster with a disk tier seals every object: one BLAKE3 pass per page put and
    per page got from memory, 0.27 ms per MiB on one core (``disk_tier``)."""
    drain_objects_per_s: float = 16.0
    """A drain's moves: Mooncake 0.3.13's client takes move tasks about 16 at a time
    about once a second, whatever their size; 15.5-16.3 objects/s measured at 1 and
    10 Gbit/s (11.2 on a loaded machine: ``bench-scale-down``)."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if not (isinstance(v, int | float) and math.isfinite(v) and v > 0):
                raise ValueError(f"costs: {f.name} must be > 0 (finite), got {v!r}")
        if self.link_efficiency > 1:
            raise ValueError(f"costs: link_efficiency must be <= 1, got "
                             f"{self.link_efficiency!r}")

    @property
    def block_bytes(self) -> int:
        """Bytes of one block's KV."""
        return BLOCK_TOKENS * self.kv_bytes_per_token

    @property
    def link_bytes_per_s(self) -> float:
        """What a transfer moves over a link, bytes per second."""
        return self.link_gbit * 1e9 / 8 * self.link_efficiency

    @property
    def drain_blocks_per_s(self) -> float:
        """Blocks a drain moves per second: its object rate times the object, at most
        the link's rate."""
        return min(self.drain_objects_per_s * self.object_bytes,
                   self.link_bytes_per_s) / self.block_bytes

    def seal_s(self, nbytes: int) -> float:
        """Seconds to seal or check ``nbytes`` of pages (a cluster with a disk tier)."""
        return nbytes / (1 << 20) * self.seal_check_s_per_mib

    def prefill_s(self, tokens: int) -> float:
        """Seconds to compute ``tokens`` prompt tokens."""
        return tokens / self.prefill_tokens_per_s
