"""A node's Mooncake client and pool memory, in embedded or standalone mode.

- *embedded*: the node actor's process is a real Mooncake client (``setup``) and owns
  the node's L3 segment; pools are ``/dev/shm`` files. The segment dies with the actor.
- *standalone*: the actor supervises a ``mooncake_client`` process that owns the
  segment and talks to it as a dummy client (``setup_dummy``; ``setup`` is never
  called); pools are allocated from that process's shared memory. The segment survives
  a restart of the actor.

While ``mooncake_client`` is down, data calls raise a retryable ``StoreUnavailableError``
(a ``NodeUnavailableError``) instead of reporting per-object codes: -900 and -1 then say
"the store is down", never "the object is missing". After it came back, the pools are
allocated anew and a call with the old mappings gets ``StalePoolsError``
(``cache_actors.node.node_pools``).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from raykv.cache_actors.errors import StoreUnavailableError
from raykv.cache_actors.listeners import Listener, addresses_of, exposed, listeners
from raykv.cache_actors.node.client_supervisor import MooncakeClientProcess
from raykv.cache_actors.node.disk_tier import DiskSlot
from raykv.cache_actors.node.mooncake_backend import MooncakeBackend
from raykv.cache_actors.node.pool_memory import (
    MemfdPoolMemory,
    PoolBudget,
    PoolMemory,
    ShmPoolMemory,
)
from raykv.cache_actors.node.store_backend import StoreBackend
from raykv.controllers.node_records import StoreStats
from raykv.controllers.object_seal import check_seal_key

log = logging.getLogger(__name__)

PROBE_KEY = "raykv-store-probe"


def _check_doors(found: Iterable[Listener], host: str,
                 dummy_port: int | None = None) -> list[Listener]:
    """The sockets of ``found`` (the Mooncake client's) bound beyond ``host`` and
    loopback, and ``mooncake_client``'s port for its dummy client (``dummy_port``,
    standalone) bound beyond loopback, each named in one warning. Mooncake 0.3.13's
    transfer engine binds its handshake and TCP data ports to every interface whatever
    ``MC_TCP_BIND_ADDRESS`` says, and whoever reaches them can read and write the
    segment's bytes; ``mooncake_client`` binds its dummy client's port to its ``-host``,
    the address it also advertises to its peers (one flag for both), and whoever reaches
    that port can make the node's store calls and allocate its shared memory, while
    only the node actor of its own node needs it."""
    found = list(found)
    dummy = [x for x in found if x.port == dummy_port]
    wide = sorted(exposed([x for x in found if x.port != dummy_port],
                          addresses_of(host) | {"127.0.0.1"}))
    if wide:
        log.warning("Mooncake's transfer engine listens on %s, beyond %s: whoever reaches "
                    "this machine on those ports can read and write this node's store "
                    "segment; let only the cluster's nodes reach them (docs/deploy.md, Ports)",
                    ", ".join(map(str, wide)), host)
    beyond = sorted(exposed(dummy, {"127.0.0.1"}))
    if beyond:
        log.warning("mooncake_client's port for its dummy client listens on %s, beyond "
                    "loopback (mooncake_client binds it to the address it advertises): "
                    "whoever reaches it can make this node's store calls and allocate its "
                    "shared memory; only this node's actor needs it: let nothing else reach "
                    "it (docs/deploy.md, Ports)", ", ".join(map(str, beyond)))
    return sorted(wide + beyond)


@dataclass
class NodeStore:
    """What one node actor stores through: ``backend``, pool ``memory``, and in standalone
    mode the supervised ``process``."""

    backend: StoreBackend
    memory: PoolMemory
    process: MooncakeClientProcess | None = None
    exposed: list[Listener] = field(default_factory=list)
    """The Mooncake client's listening sockets bound beyond its host, and standalone
    the dummy client's port bound beyond loopback (``_check_doors``)."""

    @classmethod
    def open(cls, node_prefix: str, *, standalone: bool, host: str, master_address: str,
             metadata_server: str, segment_size: int, local_buffer_size: int,
             protocol: str, rdma_devices: str, host_pool_bytes: int,
             placement: str = "own", disk_dir: str = "", disk_bytes: int = 0,
             seal_key: str = "") -> NodeStore:
        """Join the store in the chosen mode (standalone: adopt the node's running
        ``mooncake_client`` or start one); ``placement``, ``disk_dir``, ``disk_bytes``
        and ``seal_key`` as ``NodeSettings`` says (embedded mode only: the disk slot is
        claimed here, ``cache_actors.node.disk_tier``). ``ValueError`` for a bad budget,
        ``RuntimeError`` if Mooncake cannot be reached or every disk slot is held."""
        budget = PoolBudget(host_pool_bytes)
        if not standalone:
            before = set(listeners(os.getpid()))  # Ray's own
            disk = DiskSlot.claim(disk_dir, disk_bytes) if disk_dir else None
            try:
                backend = MooncakeBackend.embedded(
                    local_hostname=host, metadata_server=metadata_server,
                    master_server_addr=master_address, global_segment_size=segment_size,
                    local_buffer_size=local_buffer_size, protocol=protocol,
                    rdma_devices=rdma_devices, prefer_own_segment=placement == "own",
                    disk=disk, seal_key=check_seal_key(seal_key) if seal_key else None)
            except BaseException:
                if disk is not None:
                    disk.release()
                raise
            store = cls(backend, ShmPoolMemory(node_prefix, budget))
            store.exposed = _check_doors(set(listeners(os.getpid())) - before, host)
            return store
        if not budget.limit:
            raise ValueError("standalone mode needs host_pool_bytes > 0: the bytes of host "
                             "pools requested from mooncake_client")
        process = MooncakeClientProcess(
            node_prefix, host=host, master_address=master_address,
            metadata_server=metadata_server, segment_size=segment_size, protocol=protocol,
            rdma_devices=rdma_devices).start_or_adopt()
        backend = MooncakeBackend.dummy(server_address=process.address,
                                        mem_pool_size=host_pool_bytes,
                                        local_buffer_size=local_buffer_size,
                                        up=lambda: not process.down.is_set())
        store = cls(backend, MemfdPoolMemory(backend, budget), process)
        store.exposed = _check_doors(listeners(process.record.pid), host,
                                     process.record.port)
        return store

    @property
    def mode(self) -> str:
        return self.memory.mode

    def supervise(self, reallocate: Callable[[], None]) -> None:
        """Standalone: restart ``mooncake_client`` whenever it exits, wait until the dummy
        reconnected, then call ``reallocate`` (every pool anew, ``memory.renew()`` first)."""
        if self.process is None:
            return

        def on_restart() -> None:
            self._wait_connected()
            reallocate()

        self.process.watch(on_restart)

    def _wait_connected(self, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while self.backend.exists([PROBE_KEY])[0] < 0:
            if time.monotonic() > deadline:
                raise RuntimeError("the dummy client did not reconnect to mooncake_client")
            time.sleep(0.1)

    def before_call(self) -> int:
        """Before a data call (and a pool's creation): ``StoreUnavailableError`` while
        ``mooncake_client`` is down; returns the current epoch of the pool memory."""
        if self.process is not None and self.process.down.is_set():
            raise StoreUnavailableError(
                f"mooncake_client on port {self.process.record.port} is down; the node actor "
                "is restarting it: retry the call")
        return self.memory.epoch

    def after_call(self, epoch: int, codes: list[int]) -> list[int]:
        """After a data call that started at ``epoch``: ``StoreUnavailableError`` if some
        object failed because ``mooncake_client`` went down or the pools were replaced
        meanwhile; else ``codes`` unchanged."""
        if self.process is None or all(c >= 0 for c in codes):
            return codes
        if self.process.down.is_set() or not self.process.alive() or \
                epoch != self.memory.epoch:
            raise StoreUnavailableError(
                f"mooncake_client on port {self.process.record.port} went down during the "
                "call; the node actor is restarting it: retry the call")
        return codes

    def healthy(self) -> bool:
        if self.process is not None:
            return not self.process.down.is_set() and self.process.alive()
        return self.backend.healthy()

    def stats(self) -> StoreStats:
        """Mode, host pool budget and bytes in use, the client's ``mooncake_endpoint``
        (``host:port`` its peers are told: the node's address), ``own_segment`` (the
        name of the segment this node's puts prefer; None: none known), the
        ``mooncake_client`` process, and with seals the ``tiers``
        (``StoreBackend.tier_stats``)."""
        return StoreStats(mode=self.mode, host_pool_bytes=self.memory.budget.limit,
                          host_pool_used=self.memory.budget.used,
                          exposed_ports=[str(x) for x in self.exposed],
                          mooncake_endpoint=self.backend.endpoint(),
                          own_segment=self.backend.own_segment,
                          mooncake_client=None if self.process is None
                          else self.process.info(), tiers=self.backend.tier_stats())

    def close(self) -> None:
        """Close the client and stop ``mooncake_client`` (the actor stops for good)."""
        self.backend.close()
        if self.process is not None:
            self.process.stop()
