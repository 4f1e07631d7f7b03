"""The node's Mooncake client: zero-copy batch puts, gets, existence checks and removals.

Every method returns one code per object (``controllers.result_codes``), never raising:
put -> 0 stored / ``ALREADY_PRESENT`` (1, not rewritten) / negative error;
get -> bytes read / negative error; exists -> 1 / 0 / negative error; remove -> 0 /
negative error. The clearing calls (``remove_matching``, ``remove_unleased``,
``put_bytes``) return one code for the call.
Exceptions from the client are turned into ``CLIENT_ERROR`` for each object of the call.

Put-if-absent reports "stored" only for bytes known to be in the store. Mooncake's
``batch_put_from`` returns 0 both for an object it stored and for a key that another
client is still putting (measured on 0.3.13: while a 768 MiB put by another process was
in flight, ``batch_is_exist`` of its key returned 0 and ``batch_put_from`` of the same
key returned 0 at once; the object only exists once the first put ends, and never if it
fails). So a put first asks which keys exist (those are ``ALREADY_PRESENT``: an object
reported existing is complete), sends the others, and confirms the ones that came back 0
with one more ``batch_is_exist``: an object not reported existing then gets
``NOT_CONFIRMED`` (a failure: the caller may put it again later), never a success.

A put that Mooncake placed on a dead client's segment fails with ``TRANSFER_FAIL``
(-800): the master keeps listing a segment until that client's heartbeats have been
missing for its ``-client_ttl`` (10 s), so after a node actor is killed about half the
objects put meanwhile failed (measured: 1 node, its killed actor's segment and its new
one). Those objects are put once more at once, with the same placement (the own
segment, or a fresh random one), so puts succeed as soon as a restarted actor answers. A
retry that fails again keeps its code.

Placement (``NodeSettings.placement``): with ``prefer_own_segment`` every put prefers
the node's *own segment* (``own_segment``: the segment its Mooncake client contributes,
named by that client's ``host:port``), through ``ReplicateConfig.preferred_segment``;
Mooncake places an object elsewhere when that segment has no room (measured on 0.3.13:
48 objects of 1 MiB preferring a full 16 MiB segment all stored, 16 on it and 32 on the
other). A rank's pages then stay on its own node, where the node's puts and gets are a
memory copy instead of a transfer (32 x 256 KiB, two clients on one machine over TCP:
1.7-2.0 ms against 4-9 ms for a random segment). An embedded client with a segment
knows its name (``get_hostname``). A dummy client (standalone mode) places at random
and cannot ``locate``: Mooncake 0.3.13's ``mooncake_client`` does not serve
``batch_get_replica_desc`` to its dummies ("the rpc function not registered", measured),
so a standalone node cannot find out which segment is its own either. ``locate`` says
on which segments an object's replicas live (``batch_get_replica_desc``).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import replace

from raykv.cache_actors.node.disk_tier import DiskSlot
from raykv.cache_actors.node.dummy_calls import DummyCalls
from raykv.cache_actors.node.sealed_objects import SealedObjects
from raykv.controllers.node_records import TierStats
from raykv.controllers.result_codes import (
    ALREADY_PRESENT,
    CLIENT_ERROR,
    EXISTS,
    NOT_CONFIRMED,
    TRANSFER_FAIL,
)

log = logging.getLogger(__name__)

UNABLE_OFFLOAD = -1300
"""Mooncake's setup code for a client asking to offload to a master that does not."""


class MooncakeBackend:
    """Wraps ``MooncakeDistributedStore`` set up as an embedded (real) client or as a
    dummy client of a ``mooncake_client`` process (standalone mode)."""

    def __init__(self, store, own_segment: str | None = None,
                 prefer_own_segment: bool = True, sealed: SealedObjects | None = None,
                 disk: DiskSlot | None = None) -> None:
        """``store``: a set-up ``MooncakeDistributedStore``; ``own_segment``: the name
        of this client's segment (None: it has none, or cannot tell); puts prefer it
        when ``prefer_own_segment``, else Mooncake places them at random. ``sealed``:
        puts and gets go through it (a cluster with a disk tier); ``disk``: this
        client's disk slot, released at ``close``."""
        self._store = store
        self._sealed = sealed
        self.disk = disk
        self._steer = None
        self._steered: str | None = None  # the segment puts prefer (None: Mooncake places)
        self._prefer_own = prefer_own_segment
        self.own_segment: str | None = None
        self.can_locate = True  # a dummy client cannot (see the module docstring)
        if own_segment:
            self.prefer(own_segment)

    @property
    def prefers_own(self) -> bool:
        """Whether puts prefer ``own_segment`` (``ReplicateConfig.preferred_segment``)."""
        return self._steer is not None and self._steered == self.own_segment

    def prefer(self, segment: str) -> None:
        """Name ``segment`` this node's own: every later put prefers it (when
        ``prefer_own_segment``)."""
        self.own_segment = segment
        self.steer(None)

    def steer(self, segment: str | None) -> None:
        """Every later put prefers ``segment`` (a drain: another node's), or with None
        ``own_segment`` again (when ``prefer_own_segment``; else Mooncake places)."""
        from mooncake.store import ReplicateConfig

        if segment is None and not (self._prefer_own and self.own_segment):
            self._steer = self._steered = None
            return
        target = segment or self.own_segment
        steer = ReplicateConfig()
        steer.preferred_segment = target
        self._steer, self._steered = steer, target

    @classmethod
    def embedded(
        cls,
        *,
        local_hostname: str,
        metadata_server: str,
        master_server_addr: str,
        global_segment_size: int,
        local_buffer_size: int,
        protocol: str = "tcp",
        rdma_devices: str = "",
        prefer_own_segment: bool = True,
        disk: DiskSlot | None = None,
        seal_key: bytes | None = None,
    ) -> MooncakeBackend:
        """A real client contributing ``global_segment_size`` bytes to the store; its puts
        prefer that segment when ``prefer_own_segment`` (and it has one).

        Its transport binds to ``local_hostname``, the address peers are told to use
        (``MC_TCP_BIND_ADDRESS`` is set to it, also over one the process inherited: a
        driver's ``127.0.0.1`` would bind a node of another host where no peer reaches
        it). With ``disk`` (a claimed slot) the client offloads objects evicted from
        memory to it and, at ``setup``, finds those a client offloaded there before
        (``cache_actors.node.disk_tier``). With ``seal_key`` every object is sealed
        (``cache_actors.node.sealed_objects``). Raises
        ``RuntimeError`` when ``setup`` fails (master unreachable, bad address, a
        master without offload for a ``disk``).
        """
        os.environ["MC_TCP_BIND_ADDRESS"] = local_hostname
        if disk is not None:
            os.environ.update(disk.environment())
        from mooncake.store import MooncakeDistributedStore

        store = MooncakeDistributedStore()
        offload = {} if disk is None else {"enable_ssd_offload": True,
                                           "ssd_offload_path": str(disk.path)}
        rc = store.setup(local_hostname, metadata_server, global_segment_size,
                         local_buffer_size, protocol, rdma_devices, master_server_addr,
                         **offload)
        if rc != 0:
            hint = ("" if disk is None else f", disk {disk.path}" + (
                ": the master does not offload; start it with -enable_offload=true "
                "-offload_on_evict=true" if rc == UNABLE_OFFLOAD else ""))
            raise RuntimeError(f"Mooncake setup failed with code {rc} (master "
                               f"{master_server_addr}, metadata {metadata_server}{hint})")
        sealed = None if seal_key is None else SealedObjects(store, seal_key)
        # its segment (if any) is named by its hostname
        return cls(store, store.get_hostname() if global_segment_size > 0 else None,
                   prefer_own_segment, sealed, disk)

    @classmethod
    def dummy(cls, *, server_address: str, mem_pool_size: int, local_buffer_size: int,
              up: Callable[[], bool], attempts: int = 50) -> MooncakeBackend:
        """A dummy client of the ``mooncake_client`` listening on ``server_address``
        (``host:port``); ``setup`` is never called. ``mem_pool_size`` is the node's budget
        for host pools, each allocated later with ``alloc``; ``up``: whether that process
        is up (``DummyCalls``). Retries while the process is still coming up;
        ``RuntimeError`` if it never answers."""
        from mooncake.store import MooncakeDistributedStore

        store = MooncakeDistributedStore()
        for _ in range(attempts):
            rc = store.setup_dummy(mem_pool_size, local_buffer_size, server_address)
            if rc == 0:  # calls sent again after a restart's dead connections
                backend = cls(DummyCalls(store, up))
                backend.can_locate = False
                return backend
            time.sleep(0.1)
        raise RuntimeError(f"Mooncake setup_dummy to {server_address} failed with code {rc}")

    def alloc(self, nbytes: int) -> int:
        """``nbytes`` of the real client's shared memory (dummy only): the base address of
        a new memfd mapping of exactly that size, still to be registered."""
        ptr = self._store.alloc_from_mem_pool(nbytes)
        if not ptr:
            raise RuntimeError(f"Mooncake alloc_from_mem_pool({nbytes} bytes) failed")
        return ptr

    def register(self, ptr: int, nbytes: int) -> None:
        rc = self._store.register_buffer(ptr, nbytes)
        if rc != 0:
            raise RuntimeError(f"Mooncake register_buffer({nbytes} bytes) failed with {rc}")

    def unregister(self, ptr: int) -> None:
        rc = self._store.unregister_buffer(ptr)
        if rc != 0:
            log.warning("Mooncake unregister_buffer failed with %s", rc)

    def exists(self, keys: list[str]) -> list[int]:
        try:
            return list(self._store.batch_is_exist(keys))
        except Exception:
            log.exception("batch_is_exist raised")
            return [CLIENT_ERROR] * len(keys)

    def put(self, keys: list[str], ptrs: list[int], sizes: list[int]) -> list[int]:
        """Put-if-absent: objects that already exist are not sent and count as stored
        (``ALREADY_PRESENT``); a sent object is 0 only once the store reports it
        existing, else ``NOT_CONFIRMED`` (see the module docstring)."""
        present = self.exists(keys)
        codes = [ALREADY_PRESENT if e == EXISTS else 0 for e in present]
        todo = [i for i, e in enumerate(present) if e != EXISTS]
        if not todo:
            return codes
        results = self._put_from(todo, keys, ptrs, sizes, self._steer)
        retry = [j for j, rc in enumerate(results) if rc == TRANSFER_FAIL]
        if retry:  # placed on a dead segment (own one full): once more, placed afresh
            again = self._put_from([todo[j] for j in retry], keys, ptrs, sizes, self._steer)
            for j, rc in zip(retry, again, strict=True):
                results[j] = rc
        sent = []
        for i, rc in zip(todo, results, strict=True):
            codes[i] = int(rc)
            if codes[i] == 0:
                sent.append(i)
        if sent:
            confirmed = self.exists([keys[i] for i in sent])
            for i, e in zip(sent, confirmed, strict=True):
                if e != 1:
                    codes[i] = NOT_CONFIRMED
        return codes

    def _put_from(self, which: list[int], keys: list[str], ptrs: list[int],
                  sizes: list[int], config=None) -> list[int]:
        """``batch_put_from`` of the objects ``which`` (``config``: a ``ReplicateConfig``,
        None: Mooncake's default); ``CLIENT_ERROR`` each if it raised."""
        args = ([keys[i] for i in which], [ptrs[i] for i in which], [sizes[i] for i in which])
        if self._sealed is not None:
            return self._sealed.put_from(*args, config)
        try:
            codes = (self._store.batch_put_from(*args) if config is None
                     else self._store.batch_put_from(*args, config))
            return [int(rc) for rc in codes]
        except Exception:
            log.exception("batch_put_from raised")
            return [CLIENT_ERROR] * len(which)

    def get(self, keys: list[str], ptrs: list[int], sizes: list[int]) -> list[int]:
        if self._sealed is not None:
            return self._sealed.get_into(keys, ptrs, sizes)
        try:
            return [int(r) for r in self._store.batch_get_into(keys, ptrs, sizes)]
        except Exception:
            log.exception("batch_get_into raised")
            return [CLIENT_ERROR] * len(keys)

    def locate(self, keys: list[str]) -> list[tuple[str, ...]] | None:
        """Per key, the segments holding a complete in-memory replica of it (empty: the
        store has none); None if the check raised (logged) or this client cannot
        locate (``can_locate``)."""
        if not self.can_locate:
            return None
        from mooncake.store import ReplicaStatus

        try:
            found = self._store.batch_get_replica_desc(keys)
        except Exception:
            log.exception("batch_get_replica_desc raised")
            return None
        done = ReplicaStatus.COMPLETE
        return [tuple(r.get_memory_descriptor().buffer_descriptor.transport_endpoint
                      for r in found.get(k, ()) if r.is_memory_replica() and r.status == done)
                for k in keys]

    def start_move(self, key: str, source: str, target: str) -> tuple[object, int]:
        """A Mooncake move task of ``key``'s replica on segment ``source`` to segment
        ``target`` (the client owning ``source`` runs it): ``(task id, 0)``, or ``(None,
        negative error)``. A dummy client may start one too (measured on 0.3.13)."""
        try:
            task, rc = self._store.create_move_task(key, source, target)
        except Exception:
            log.exception("create_move_task raised")
            return None, CLIENT_ERROR
        return (task, 0) if rc == 0 else (None, int(rc) if rc < 0 else CLIENT_ERROR)

    def move_state(self, task: object) -> str:
        """``"done"``, ``"failed"`` (the task failed, or the master no longer knows it)
        or ``"running"`` (pending or processing) of a task ``start_move`` started."""
        try:
            answer, rc = self._store.query_task(task)
        except Exception:
            log.exception("query_task raised")
            return "failed"
        if rc != 0 or answer is None:
            return "failed"
        status = str(answer.status).rsplit(".", 1)[-1]
        return {"SUCCESS": "done", "FAILED": "failed"}.get(status, "running")

    def remove(self, keys: list[str]) -> list[int]:
        """Forced ``batch_remove`` (leases ignored): 0 / negative error per key."""
        try:
            return [int(r) for r in self._store.batch_remove(keys, True)]
        except Exception:
            log.exception("batch_remove raised")
            return [CLIENT_ERROR] * len(keys)

    def remove_matching(self, pattern: str) -> int:
        """Non-forced ``remove_by_regex``: the number of objects whose key ``pattern``
        matches that were removed; leased objects (Mooncake leases what an existence check or a
        read reported) and objects still being written stay. Negative: an error (-600
        a pattern the master cannot read)."""
        try:
            return int(self._store.remove_by_regex(pattern, False))
        except Exception:
            log.exception("remove_by_regex raised")
            return CLIENT_ERROR

    def remove_unleased(self, key: str) -> int:
        """Non-forced ``remove`` of one object: 0 removed, ``OBJECT_HAS_LEASE`` while a
        lease holds it, else negative."""
        try:
            return int(self._store.remove(key, False))
        except Exception:
            log.exception("remove raised")
            return CLIENT_ERROR

    def put_bytes(self, key: str, data: bytes) -> int:
        """Put a small object from this client's own buffer: 0 or negative."""
        try:
            return int(self._store.put(key, data))
        except Exception:
            log.exception("put raised")
            return CLIENT_ERROR

    def healthy(self) -> bool:
        return self._store.health_check() == 0

    def endpoint(self) -> str:
        """``host:port`` this client's transfer engine tells its peers (Mooncake's
        ``get_hostname``); "" where the client has none (a dummy's may not say)."""
        try:
            return str(self._store.get_hostname())
        except Exception:
            return ""

    def tier_stats(self) -> TierStats | None:
        """Sealed gets' counts (``SealedObjects.stats``) and the disk slot's ``path``,
        ``limit_bytes`` and ``used_bytes``; None without seals."""
        if self._sealed is None:
            return None
        out = self._sealed.stats()
        if self.disk is not None:
            out = replace(out, path=str(self.disk.path), limit_bytes=self.disk.limit_bytes,
                          used_bytes=self.disk.used_bytes())
        return out

    def close(self) -> None:
        if self._sealed is not None:
            self._sealed.close()
        self._store.close()
        if self.disk is not None:
            self.disk.release()
