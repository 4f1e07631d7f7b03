"""A node's disk tier (L4): the directory its Mooncake client offloads to, claimed for
the node actor's life, and the client settings that make Mooncake 0.3.13's SSD offload
work.

Every node of a cluster is given the same ``disk_dir`` (``NodeSettings``); a node actor
takes the first of its slots ``node-0``, ``node-1``, ... that no live process holds (an
``flock`` on ``node-N.lock``, released when the process ends), so several node actors
of one machine (emulated hosts) never share one, and a node actor started again on the
same machine finds its slot, and the objects its client offloaded there, again: the
client scans the slot at ``setup`` and tells the master what it holds.

A client that stops (killed, or closed: Mooncake 0.3.13's ``close`` does not leave
the master) stays known to the master until its heartbeats have been missing for the
master's ``-client_ttl`` (``CLIENT_TTL_S``, 10 s); when the master then expires it, it
drops every disk object that client's slot listed, also those a new client of the same
slot found again meanwhile (measured: all of them, within 3-10 s). So the slot's owner
marks it alive every ``BEAT_S`` (the lock file's modification time), and a claim of a
slot whose last mark is younger than ``client_ttl_s`` + ``BEAT_S`` waits for the rest
before the new client scans it: a node actor restarted at once joins up to ~12 s later
and keeps its disk tier. A master that restarts is told the slot's objects again by
the running client itself (measured: within ~1 s).

Mooncake's settings (measured on 0.3.13): the bucket storage backend with buckets of
``BUCKET_BYTES`` (``NodeSettings``' ``DISK_BUCKET_BYTES``; with Mooncake's default of
256 MiB a bucket never filled on a small segment and nothing reached disk), the slot's
size as the offload's total limit (at least ``MIN_SLOT_BYTES``, three buckets; a full
slot makes room by deleting its oldest bucket), an offload heartbeat every
``OFFLOAD_BEAT_S``.
Objects still in memory when the node actor stops, and those of a bucket not yet full,
are lost with it; the master must offload on eviction (``MASTER_FLAGS``), or objects
reported stored are dropped from memory before they reach disk.
"""

from __future__ import annotations

import fcntl
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from raykv.controllers.node_settings import DISK_BUCKET_BYTES as BUCKET_BYTES
from raykv.controllers.node_settings import MIN_DISK_BYTES as MIN_SLOT_BYTES

MASTER_FLAGS = ("-enable_offload=true", "-offload_on_evict=true")
"""What ``mooncake_master`` needs for a cluster with a disk tier: offload allowed, and
an object evicted from memory written to its node's disk first."""

MAX_SLOTS = 256
"""The most node actors of one machine that share one disk directory."""

OFFLOAD_BEAT_S = 1
"""Seconds between the client's offload heartbeats, at each of which the master hands it
the evicted objects to write (Mooncake's default 10: measured, 200 puts into a full
segment took 14.4 s against 7.3 s with 1, as memory frees only once they are written)."""

CLIENT_TTL_S = 10.0
"""``mooncake_master``'s ``-client_ttl`` default in 0.3.13 (seconds)."""

BEAT_S = 1.0
"""Seconds between two marks of a claimed slot as alive."""


@dataclass
class DiskSlot:
    """A claimed slot: ``path`` (the directory Mooncake offloads to), ``limit_bytes``
    (the most bytes it holds), and the open lock file that claims it (kept open, and
    marked alive every ``BEAT_S`` by a thread of its own, until ``release``)."""

    path: Path
    limit_bytes: int
    _lock: int
    waited_s: float = 0.0
    """Seconds the claim waited for the master to forget the slot's last client."""
    _stop: threading.Event = field(default_factory=threading.Event)
    _mark: threading.Lock = field(default_factory=threading.Lock)

    @classmethod
    def claim(cls, disk_dir: str, limit_bytes: int,
              client_ttl_s: float = CLIENT_TTL_S) -> DiskSlot:
        """The first free slot of ``disk_dir`` (made if absent), once the master has
        forgotten its last client (see the module docstring: a wait of at most
        ``client_ttl_s`` + ``BEAT_S`` seconds, ``client_ttl_s`` the master's
        ``-client_ttl``). ``ValueError`` for a bound below ``MIN_SLOT_BYTES``;
        ``RuntimeError`` if every slot is held."""
        if limit_bytes < MIN_SLOT_BYTES:
            raise ValueError(f"a disk tier needs disk_bytes >= {MIN_SLOT_BYTES} (three "
                             f"offload buckets), got {limit_bytes}")
        root = Path(disk_dir)
        root.mkdir(parents=True, exist_ok=True)
        for n in range(MAX_SLOTS):
            fd = os.open(root / f"node-{n}.lock", os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            path = root / f"node-{n}"
            path.mkdir(mode=0o700, exist_ok=True)
            slot = cls(path, limit_bytes, fd)
            quiet_s = time.time() - os.fstat(fd).st_mtime  # since its last owner's mark
            if any(path.iterdir()) and quiet_s < client_ttl_s + BEAT_S:
                slot.waited_s = client_ttl_s + BEAT_S - quiet_s
                time.sleep(slot.waited_s)
            os.utime(fd)
            threading.Thread(target=slot._beat, name="raykv-disk-slot", daemon=True).start()
            return slot
        raise RuntimeError(f"all {MAX_SLOTS} disk slots of {root} are held by live "
                           "processes")

    def environment(self) -> dict[str, str]:
        """The environment Mooncake's client reads for its offload (set before
        ``setup``)."""
        return {
            "MOONCAKE_OFFLOAD_FILE_STORAGE_PATH": str(self.path),
            "MOONCAKE_OFFLOAD_STORAGE_BACKEND_DESCRIPTOR": "bucket_storage_backend",
            "MOONCAKE_OFFLOAD_BUCKET_SIZE_LIMIT_BYTES": str(BUCKET_BYTES),
            "MOONCAKE_OFFLOAD_TOTAL_SIZE_LIMIT_BYTES": str(self.limit_bytes),
            "MOONCAKE_OFFLOAD_BUCKET_MAX_TOTAL_SIZE": str(self.limit_bytes),
            "MOONCAKE_OFFLOAD_HEARTBEAT_INTERVAL_SECONDS": str(OFFLOAD_BEAT_S),
        }

    def used_bytes(self) -> int:
        """Bytes of the files in the slot now."""
        with os.scandir(self.path) as entries:
            return sum(e.stat().st_size for e in entries if e.is_file())

    def _beat(self) -> None:
        while not self._stop.wait(BEAT_S):
            with self._mark:
                if self._lock < 0:
                    return
                os.utime(self._lock)

    def release(self) -> None:
        """Give the slot up (the node actor stops)."""
        self._stop.set()
        with self._mark:
            if self._lock >= 0:
                os.close(self._lock)
                self._lock = -1
