"""Test helpers for the disk tier at the backend level: a real ``mooncake_master`` with
offload on, real embedded Mooncake clients (``MooncakeBackend.embedded``) with disk
slots and seals, pages whose every byte is known, and the bucket files Mooncake's
``bucket_storage_backend`` writes (read and damaged from the test side).

Settings that keep a run short, all from the test side: 256 KiB pages, 32 MiB
segments, a 2.5 s object lease (every put is confirmed by an exists, which leases the
object: memory full of objects younger than the lease answers puts -200) and the
client's offload heartbeat at 1 s (Mooncake's default, 10 s, halves the put rate while
memory is full: 200 puts took 14.4 s against 7.3 s).

A bucket file, as Mooncake 0.3.13 writes it: records ``b"default\\0" + key`` then the
object's bytes (the page and its seal), back to back, in an order of Mooncake's own;
beside it a ``.meta`` file (protobuf) naming its keys. ``buckets`` reads the keys back
from the records, so every key here has one length (``key``).
"""

from __future__ import annotations

import gc
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from raykv.cache_actors.node.disk_tier import MASTER_FLAGS, DiskSlot
from raykv.cache_actors.node.mooncake_backend import MooncakeBackend
from raykv.clusters.mooncake_master import MooncakeMaster
from raykv.controllers.object_seal import SEAL_BYTES, check_seal_key, read_seal_key

PAGE = 256 << 10
SEGMENT = 32 << 20
CAPACITY = SEGMENT // PAGE
"""The most pages one segment holds."""
LEASE = "-default_kv_lease_ttl=2500"
NO_ROOM = -200
"""Mooncake's put code while memory is full of leased objects or objects still being
offloaded: the put is tried again."""
PREFIX = b"default\0"
RECORD = len(PREFIX) + 4 + PAGE + SEAL_BYTES
WRONG = "WRONG"
"""``read``'s answer for a get that returned a size but not the bytes written."""


def key(i: int) -> str:
    """The object key of page ``i`` (4 characters for every ``i`` below 1000)."""
    return f"p{i:03d}"


def page(seed: int, i: int) -> np.ndarray:
    """Page ``i`` of a store filled with ``seed``: PAGE bytes fixed by both."""
    return np.random.default_rng([seed, i]).integers(0, 256, PAGE, dtype=np.uint8)


def start_master(log_dir: str, offload: bool = True) -> MooncakeMaster:
    """A master with a short lease, with the disk tier's flags when ``offload``."""
    flags = [*MASTER_FLAGS] if offload else []
    return MooncakeMaster("127.0.0.1", extra_args=[*flags, LEASE], log_dir=log_dir).start()


def where(master: MooncakeMaster) -> tuple[str, str]:
    """What a client needs of ``master``: its address and metadata server."""
    return master.master_address, master.metadata_server


def client(master: tuple[str, str], *, slot: DiskSlot | None = None,
           seal_key: bytes | None = None, segment: int = SEGMENT) -> MooncakeBackend:
    """A real embedded client of ``master`` (``where``): with ``slot`` it offloads
    there, with ``seal_key`` it seals."""
    return MooncakeBackend.embedded(local_hostname="127.0.0.1",
                                    metadata_server=master[1], master_server_addr=master[0],
                                    global_segment_size=segment, local_buffer_size=16 << 20,
                                    disk=slot, seal_key=seal_key)


def seal_key_of(disk_dir: str) -> bytes:
    return check_seal_key(read_seal_key(disk_dir))


def close(backend: MooncakeBackend) -> None:
    """Close ``backend`` and free its client now (Mooncake unmounts the segment in the
    client's destructor: run while the master still answers, it takes seconds; after
    the master stopped, tens of seconds of retries)."""
    backend.close()
    backend._store = backend._sealed = None
    gc.collect()


@dataclass
class Buffer:
    """``pages`` pages of registered memory of one client."""

    backend: MooncakeBackend
    pages: int
    array: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        self.array = np.zeros(self.pages * PAGE, dtype=np.uint8)
        self.backend.register(self.ptr(0), self.array.nbytes)

    def ptr(self, slot: int) -> int:
        return self.array.ctypes.data + slot * PAGE

    def view(self, slot: int) -> np.ndarray:
        return self.array[slot * PAGE:(slot + 1) * PAGE]


def put_pages(buf: Buffer, seed: int, ids: list[int], batch: int = 8,
              attempts: int = 600, after_batch=None) -> dict[str, int]:
    """Put page ``i`` of ``seed`` under ``key(i)`` for each of ``ids``, ``batch`` at a
    time, each object tried again while it answers ``NO_ROOM`` (at most ``attempts``
    times): the last code of each key. ``after_batch(codes)`` is called after each
    batch with the codes so far."""
    assert buf.pages >= batch
    codes: dict[str, int] = {}
    for start in range(0, len(ids), batch):
        part = ids[start:start + batch]
        for j, i in enumerate(part):
            buf.view(j)[:] = page(seed, i)
        todo = list(range(len(part)))
        for _ in range(attempts):
            got = buf.backend.put([key(part[j]) for j in todo], [buf.ptr(j) for j in todo],
                                  [PAGE] * len(todo))
            for j, rc in zip(todo, got, strict=True):
                codes[key(part[j])] = rc
            todo = [j for j, rc in zip(todo, got, strict=True) if rc == NO_ROOM]
            if not todo:
                break
            time.sleep(0.1)
        if after_batch is not None:
            after_batch(codes)
    return codes


def read(buf: Buffer, seed: int, ids: list[int], batch: int = 8) -> dict[str, object]:
    """Get each ``key(i)`` of ``ids`` and compare every byte with page ``i`` of
    ``seed``: per key ``PAGE`` (read, exact), ``WRONG`` (a size, other bytes) or the
    negative code. ``seed`` None: no bytes are right (any size is ``WRONG``)."""
    out: dict[str, object] = {}
    for start in range(0, len(ids), batch):
        part = ids[start:start + batch]
        buf.array[:len(part) * PAGE] = 0
        got = buf.backend.get([key(i) for i in part], [buf.ptr(j) for j in range(len(part))],
                              [PAGE] * len(part))
        for j, (i, rc) in enumerate(zip(part, got, strict=True)):
            if rc < 0:
                out[key(i)] = rc
            elif seed is not None and rc == PAGE and np.array_equal(buf.view(j), page(seed, i)):
                out[key(i)] = PAGE
            else:
                out[key(i)] = WRONG
    return out


def plain_read(backend: MooncakeBackend, keys: list[str]) -> dict[str, object]:
    """The plain Mooncake client's read of each object, seal or not (one buffer of the
    page and its seal's size, no check): per key its first PAGE bytes, or the negative
    code."""
    size = PAGE + SEAL_BYTES
    area = np.zeros(size * len(keys), dtype=np.uint8)
    backend.register(area.ctypes.data, area.nbytes)
    try:
        got = backend._store.batch_get_into(keys, [area.ctypes.data + j * size
                                                   for j in range(len(keys))],
                                            [size] * len(keys))
    finally:
        backend.unregister(area.ctypes.data)
    return {k: (area[j * size:j * size + PAGE].copy() if rc == size else int(rc))
            for j, (k, rc) in enumerate(zip(keys, got, strict=True))}


def buckets(slot: Path) -> dict[Path, list[str]]:
    """Each bucket file of ``slot`` and the keys of its records, in file order."""
    out = {}
    for path in sorted(slot.glob("*.bucket")):
        keys = []
        with open(path, "rb") as f:
            for offset in range(0, os.fstat(f.fileno()).st_size, RECORD):
                f.seek(offset)
                head = f.read(len(PREFIX) + 4)
                assert head.startswith(PREFIX), f"{path} at {offset}: not a record {head!r}"
                keys.append(head[len(PREFIX):].decode())
        out[path] = keys
    return out


def meta(bucket: Path) -> Path:
    return bucket.with_suffix(".meta")


def value_offset(n: int) -> int:
    """Where the page of a bucket's record ``n`` starts."""
    return n * RECORD + len(PREFIX) + 4


def flip(bucket: Path, n: int, nbytes: int = 16) -> None:
    """Invert ``nbytes`` bytes in the middle of the page of record ``n``."""
    offset = value_offset(n) + PAGE // 2
    with open(bucket, "r+b") as f:
        f.seek(offset)
        data = f.read(nbytes)
        f.seek(offset)
        f.write(bytes(b ^ 0xFF for b in data))
        f.flush()
        os.fsync(f.fileno())


def tiers(backend: MooncakeBackend, keys: list[str]) -> list[str]:
    """Where each object lives now (``l3_memory``, ``l3_disk`` alone, ``unknown``:
    absent)."""
    return backend._sealed._tiers(keys)


def fill_other_cluster(disk_dir: str, log_dir: str, seed: int, count: int,
                       done) -> None:
    """In a process of its own (Mooncake's offload settings are per process): another
    cluster, its own master, disk directory and seal key, fills its store with pages
    ``0..count-1`` of ``seed`` under the same keys, last first (so the pages it
    offloads first are those another store filled in order kept in memory), then
    stops, leaving its bucket files. ``done`` is set at the end."""
    master = start_master(log_dir)
    try:
        backend = client(where(master), slot=DiskSlot.claim(disk_dir, 1 << 30),
                         seal_key=seal_key_of(disk_dir))
        codes = put_pages(Buffer(backend, 8), seed, list(reversed(range(count))))
        assert all(rc >= 0 for rc in codes.values()), codes
        close(backend)
    finally:
        master.stop()
    done.set()


def read_from_another_slot(master: tuple[str, str], disk_dir: str, seal_key: bytes,
                           seed: int, ids: list[int], answer) -> None:
    """In a process of its own: a second node of the machine claims a slot of the same
    ``disk_dir``, sets up a client offloading there and reads ``ids`` of ``seed``;
    puts ``(slot name, read's answers, tier_stats)`` on ``answer``."""
    slot = DiskSlot.claim(disk_dir, 1 << 30)
    backend = client(master, slot=slot, seal_key=seal_key)
    got = read(Buffer(backend, 8), seed, ids)
    stats = backend.tier_stats()
    close(backend)
    answer.put((slot.path.name, got, stats))
