"""The disk tier (L4): how fast a node's sealed backend serves objects from its disk,
against the device's own sequential read of the same files, what the seal costs, and
the hit rate a disk tier adds on a working set four times the memory tier.

Run: ``python -m raykv_lab.bench.disk_tier [--dir DIR] [--passes 3] [--out FILE]``
(no Ray; three to four minutes on 2 cores). Everything lives in one fresh directory under
``--dir`` (the system's temporary directory by default), removed at the end.

Two clients, one after the other, each with a ``mooncake_master`` of its own (the disk
tier's ``MASTER_FLAGS``, a lease of ``LEASE_MS``) and one embedded ``MooncakeBackend``
with a ``SEGMENT``-byte segment and a disk slot (``DiskSlot``) under the directory: the
*sealed* client (a seal key, as a node with a disk tier runs) and the *raw* one (no
seal: plain ``batch_get_into``). Every object read is checked against the bytes it was
put with (untimed). GB/s: bytes over the time spent in the get calls, median of
``--passes`` passes of ``BATCH`` keys per get. Beside each warm and memory figure, the
bytes the machine's loopback interface sent meanwhile per byte read (a get that is a
memory copy sends none).

1. **The seal on memory gets.** Each client first puts ``MEMORY_SET`` bytes per page
   size of ``PAGES`` into its empty segment, reads them and removes them; sealed over
   raw is the seal's whole cost on a memory hit (its 32 bytes, its BLAKE3 check and the
   tier lookup of each get). Alone: a batch's seal checks (``object_seal.check``), ms
   per MiB, and the lookup (``batch_get_replica_desc``) per batch.
2. **Disk-served gets.** Each client then puts ``DISK_SET`` bytes per page size, then
   ``FILLER`` bytes more, so eviction moves the sets to disk; only the objects then on
   disk alone (present, no memory replica) are read, *cold* (fsync and
   ``POSIX_FADV_DONTNEED`` on every file of the slot before each pass) and *warm* (the
   page cache holding them; one pass first, untimed). The device: the slot's bucket
   files read start to end in ``CHUNK`` reads, cold (after the same drop), warm, and
   with ``O_DIRECT``, in each pass after its gets, so both see the same load; a ratio is
   the median over the passes of a pass's get GB/s over its device read's.
3. **Hit rate.** A sample of the conversation trace: requests grouped by their second
   block (the first is shared by all), groups drawn in a seeded order until the drawn
   requests hold ``WORKING_SET``x the distinct blocks a ``HIT_SEGMENT``-byte segment
   holds as ``HIT_PAGE`` objects, replayed in arrival order as a node serves them: the
   request's leading blocks the store holds are read (a hit each, bytes checked), the
   rest put. Once with a disk slot, once with none (a master without offload), the same
   segment and seals; a block-weighted hit rate each, and the rates one LRU of the
   segment's objects and an unbounded one would reach on the same sample.

Writes JSON: the command, date, machine and its disk (``df``, ``lsblk``), the settings,
then ``disk_gets``, ``device``, ``ratios``, ``memory_gets``, ``seal``, ``hit_rate``.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import mmap
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
from raykv import KiB, MiB
from raykv.cache_actors.node.disk_tier import BUCKET_BYTES, MASTER_FLAGS, DiskSlot
from raykv.cache_actors.node.mooncake_backend import MooncakeBackend
from raykv.clusters.mooncake_master import MooncakeMaster
from raykv.controllers.node_records import as_dict
from raykv.controllers.object_seal import SEAL_BYTES, check, seal
from raykv_lab.bench.toolkit import gbps, machine_info, summarize
from raykv_lab.bench.warm_workload import Request, read_trace
from raykv_lab.sim.block_lru import BlockLRU
from raykv_lab.sim.trace import conversations

PAGES = (256 * KiB, MiB, 4 * MiB)
BATCH = 16
SEGMENT = 128 * MiB
DISK_SET = 96 * MiB
FILLER = 160 * MiB
MEMORY_SET = 64 * MiB
LEASE_MS = 2500
DISK_BYTES = 4 << 30
HIT_SEGMENT = 32 * MiB
HIT_PAGE = 64 * KiB
WORKING_SET = 4
PUT_WAIT_S = 30.0
"""How long a put may keep answering 'no room' (about one lease per fill) before the
run gives up."""
CHUNK = 4 * MiB
TRACE = (Path(__file__).resolve().parents[2] / "tests" / "data" / "traces"
         / "conversation_trace.jsonl")


class Client:
    """A master of its own and one embedded backend on it, with a registered buffer of
    ``BATCH`` slots of ``slot`` bytes whose pages are a random base stamped per object."""

    def __init__(self, root: Path, name: str, segment: int, slot: int, disk: bool,
                 seal_key: bytes | None) -> None:
        flags = [*MASTER_FLAGS] if disk else []
        self.master = MooncakeMaster(extra_args=[*flags, f"-default_kv_lease_ttl={LEASE_MS}"],
                                     log_dir=str(root)).start()
        self.slot = DiskSlot.claim(str(root / name), DISK_BYTES) if disk else None
        try:
            self.backend = MooncakeBackend.embedded(
                local_hostname="127.0.0.1", metadata_server=self.master.metadata_server,
                master_server_addr=self.master.master_address, global_segment_size=segment,
                local_buffer_size=16 * MiB, disk=self.slot, seal_key=seal_key)
        except RuntimeError:
            self.master.stop()
            raise
        self._map = mmap.mmap(-1, BATCH * slot)
        self.ptr = ctypes.addressof(ctypes.c_char.from_buffer(self._map))
        self.buf = np.frombuffer(self._map, dtype=np.uint8).reshape(BATCH, slot)
        self.base = np.random.default_rng(0).integers(0, 256, slot, dtype=np.uint8)
        self.buf[:] = self.base
        self.backend.register(self.ptr, len(self._map))
        self.slot_bytes = slot
        self.put_s = 0.0
        """Seconds spent in ``put``, waits for room included."""
        self.put_retries = 0
        """Puts sent again because the store had no room for some of their objects."""

    def ptrs(self, n: int) -> list[int]:
        """Addresses of the buffer's first ``n`` slots."""
        return [self.ptr + j * self.slot_bytes for j in range(n)]

    def put(self, keys: Sequence[str], stamps: Sequence[int], page: int) -> int:
        """Put-if-absent ``keys`` (at most ``BATCH``), page j stamped ``stamps[j]``,
        retrying those the store had no room for; the number never stored."""
        for j, s in enumerate(stamps):
            self.buf[j, :8] = np.frombuffer(int(s).to_bytes(8, "little"), np.uint8)
            self.buf[j, 8:page] = self.base[8:page]
        todo = list(range(len(keys)))
        ptrs = self.ptrs(len(keys))
        t = time.perf_counter()
        deadline = time.monotonic() + PUT_WAIT_S
        while todo and time.monotonic() < deadline:
            codes = self.backend.put([keys[j] for j in todo],
                                     [ptrs[j] for j in todo],
                                     [page] * len(todo))
            todo = [j for j, c in zip(todo, codes, strict=True) if c < 0]
            if todo:
                self.put_retries += 1
                time.sleep(0.05)
        self.put_s += time.perf_counter() - t
        return len(todo)

    def get(self, keys: Sequence[str], stamps: Sequence[int], page: int) -> tuple[float, int, int]:
        """One get of ``keys`` (at most ``BATCH``): (seconds in the call, objects read,
        of those the ones whose bytes are not the page put under their stamp)."""
        self.buf[:len(keys), :8] = 0
        t = time.perf_counter()
        codes = self.backend.get(list(keys), self.ptrs(len(keys)), [page] * len(keys))
        seconds = time.perf_counter() - t
        read = wrong = 0
        for j, (c, s) in enumerate(zip(codes, stamps, strict=True)):
            if c != page:
                continue
            read += 1
            wrong += int(int.from_bytes(self.buf[j, :8].tobytes(), "little") != s
                         or not np.array_equal(self.buf[j, 8:page], self.base[8:page]))
        return seconds, read, wrong

    def where(self, keys: Sequence[str]) -> tuple[list[str], list[str]]:
        """(keys with a memory replica, keys present on disk alone)."""
        located = self.backend.locate(list(keys)) or [()] * len(keys)
        present = self.backend.exists(list(keys))
        memory = [k for k, at in zip(keys, located, strict=True) if at]
        disk = [k for k, at, e in zip(keys, located, present, strict=True) if not at and e == 1]
        return memory, disk

    def close(self) -> None:
        """Backend, slot, then master (the client's teardown still talks to it)."""
        self.backend.close()
        del self.backend, self.buf
        gc.collect()
        self.master.stop()


def batches(keys: Sequence[str]) -> Iterator[tuple[list[str], list[int]]]:
    """``keys`` (``<name>-<stamp>``) in gets of ``BATCH``, with their stamps."""
    for s in range(0, len(keys), BATCH):
        chunk = list(keys[s:s + BATCH])
        yield chunk, [int(k.rsplit("-", 1)[1]) for k in chunk]


def put_set(client: Client, name: str, page: int, nbytes: int) -> list[str]:
    """Put ``nbytes`` of ``page``-byte objects ``<name>-<page>-<i>``; their keys.
    ``RuntimeError`` if the store found no room for one within ``PUT_WAIT_S``."""
    keys = [f"{name}-{page}-{i}" for i in range(nbytes // page)]
    for chunk, stamps in batches(keys):
        if client.put(chunk, stamps, page):
            raise RuntimeError(f"puts of {name} ({page} B pages) found no room for "
                               f"{PUT_WAIT_S} s")
    return keys


def get_pass(client: Client, keys: Sequence[str], page: int) -> tuple[float, dict]:
    """Every key once: (seconds in get calls, counts: read, wrong, failed)."""
    total = 0.0
    counts = {"read": 0, "wrong": 0, "failed": 0}
    for chunk, stamps in batches(keys):
        seconds, read, wrong = client.get(chunk, stamps, page)
        total += seconds
        counts["read"] += read
        counts["wrong"] += wrong
        counts["failed"] += len(chunk) - read
    return total, counts


def drop_cache(path: Path) -> None:
    """fsync and ``POSIX_FADV_DONTNEED`` every file of ``path``: their next read comes
    from the device (no root needed, unlike ``drop_caches``)."""
    for f in path.iterdir():
        if f.is_file():
            fd = os.open(f, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def read_files(files: Sequence[Path], direct: bool) -> float:
    """Seconds to read ``files`` start to end in ``CHUNK`` reads (``O_DIRECT``: past the
    page cache)."""
    chunk = mmap.mmap(-1, CHUNK)
    t = time.perf_counter()
    for f in files:
        fd = os.open(f, os.O_RDONLY | (os.O_DIRECT if direct else 0))
        try:
            while os.readv(fd, [chunk]) == CHUNK:
                pass
        finally:
            os.close(fd)
    return time.perf_counter() - t


def loopback_bytes() -> int | None:
    """Bytes this machine's loopback interface has sent (every process's), or None."""
    try:
        return int(Path("/sys/class/net/lo/statistics/tx_bytes").read_text())
    except (OSError, ValueError):
        return None


def over_loopback(n: int, run: Callable[[], float], nbytes: int) -> tuple[list[float],
                                                                          float | None]:
    """``n`` timed ``run()`` (each returns its seconds), and the loopback bytes sent
    meanwhile per byte they read (the whole machine's: other processes' traffic counts
    too)."""
    before = loopback_bytes()
    times = [run() for _ in range(n)]
    after = loopback_bytes()
    return times, (None if before is None or after is None
                   else (after - before) / (n * nbytes))


def disk_side(client: Client, n: int) -> dict:
    """Part 2 for one client (module docstring): its gets of the disk-only objects and
    the device's read of its slot's bucket files, pass by pass (each pass: every page
    size's get pass, then the device's read), cold, then warm; per page size the ratios
    of each pass's get GB/s over the same pass's device GB/s, median."""
    slot = client.slot.path
    sets = {page: put_set(client, "disk", page, DISK_SET) for page in PAGES}
    put_set(client, "filler", MiB, FILLER)
    on_disk = {page: client.where(keys)[1] for page, keys in sets.items()}
    files = sorted(slot.glob("*.bucket"))
    nbytes = sum(f.stat().st_size for f in files)
    counts = {page: {"read": 0, "wrong": 0, "failed": 0} for page in PAGES}
    times: dict[str, dict] = {state: {page: [] for page in PAGES} for state in ("cold", "warm")}
    device: dict[str, list[float]] = {"cold": [], "warm": [], "direct": []}

    def gets(page: int) -> float:
        seconds, c = get_pass(client, on_disk[page], page)
        for k, v in c.items():
            counts[page][k] += v
        return seconds

    for _ in range(n):
        for page in PAGES:
            drop_cache(slot)
            times["cold"][page].append(gets(page))
        drop_cache(slot)
        device["cold"].append(read_files(files, False))
        device["direct"].append(read_files(files, True))
    for page in PAGES:  # into the page cache
        gets(page)
    read_files(files, False)
    before = loopback_bytes()
    for _ in range(n):
        for page in PAGES:
            times["warm"][page].append(gets(page))
        device["warm"].append(read_files(files, False))
    after = loopback_bytes()
    read_bytes = n * sum(len(on_disk[page]) * page for page in PAGES)
    out: dict = {"device": {"files": len(files), "bytes": nbytes}
                 | {k: summarize(nbytes, v) for k, v in device.items()},
                 "warm_loopback_per_byte": (None if before is None or after is None
                                            else (after - before) / read_bytes),
                 "gets": {}, "ratios": {}}
    for page, keys in sets.items():
        got = len(on_disk[page]) * page
        out["gets"][str(page)] = {
            "objects": len(keys), "on_disk": len(on_disk[page]), "bytes": got,
            "cold": summarize(got, times["cold"][page]),
            "warm": summarize(got, times["warm"][page]),
            "in_memory_after": len(client.where(on_disk[page])[0]), **counts[page]}
        out["ratios"][str(page)] = {
            f"{state}_vs_{'direct' if dev == 'direct' else 'device'}": statistics.median(
                (got / t) / (nbytes / d)
                for t, d in zip(times[state][page], device[dev], strict=True))
            for state, dev in (("cold", "cold"), ("warm", "warm"), ("cold", "direct"))}
    return out | {"slot_bytes": client.slot.used_bytes(),
                  "tier_stats": as_dict(client.backend.tier_stats())}


def memory_side(client: Client, n: int) -> dict:
    """Part 1 for one client (its segment still empty): gets of objects its segment
    holds, per page size (each set removed after), and the lookup a sealed get makes per
    batch."""
    out = {}
    for page in PAGES:
        keys = put_set(client, "memory", page, MEMORY_SET)
        in_memory, _ = client.where(keys)
        counts: dict[str, int] = {}

        def timed_pass(keys=in_memory, page=page, counts=counts) -> float:
            seconds, c = get_pass(client, keys, page)
            for k, v in c.items():
                counts[k] = counts.get(k, 0) + v
            return seconds

        timed_pass()
        times, loopback = over_loopback(n, timed_pass, len(in_memory) * page)
        client.backend.remove(keys)  # room for the next set: nothing is evicted
        lookups = []
        for chunk, _ in batches(in_memory):
            t = time.perf_counter()
            client.backend.locate(chunk)
            lookups.append(time.perf_counter() - t)
        out[str(page)] = {"objects": len(keys), "in_memory": len(in_memory),
                          **summarize(len(in_memory) * page, times),
                          "loopback_per_byte": loopback,
                          "lookup_ms_per_batch": 1e3 * statistics.median(lookups), **counts}
    return out


def seal_check_cost(seal_key: bytes, n: int = 5) -> dict:
    """Per page size, ``BATCH`` seal checks (``object_seal.check``) of distinct pages in a
    row, as a sealed get makes them once its batch landed (the first pages no longer in
    the CPU's cache at the larger sizes): ms per MiB and GB/s, median of ``n``."""
    out = {}
    for page in PAGES:
        region = mmap.mmap(-1, BATCH * page)
        np.frombuffer(region, dtype=np.uint8)[:] = np.random.default_rng(1).integers(
            0, 256, BATCH * page, dtype=np.uint8)
        pages = [memoryview(region)[j * page:(j + 1) * page] for j in range(BATCH)]
        seals = [seal(seal_key, f"k{j}", p) for j, p in enumerate(pages)]
        times = []
        for _ in range(n):
            t = time.perf_counter()
            for j, p in enumerate(pages):
                if check(seal_key, f"k{j}", p, seals[j]) is not None:
                    raise RuntimeError("a seal check failed on the bytes it was made for")
            times.append(time.perf_counter() - t)
        seconds = statistics.median(times)
        out[str(page)] = {"ms_per_mib": 1e3 * seconds * MiB / (BATCH * page),
                          "gbps": gbps(BATCH * page, seconds)}
    return out


def seal_cost(memory: dict, checks: dict) -> dict:
    """Sealed over raw memory gets per page size, and one batch's time split: the raw
    get, the sealed one, its tier lookup and its ``BATCH`` seal checks (the rest is the
    multi-buffer get's own)."""
    out: dict = {"check": checks, "sealed_vs_raw_memory": {}, "ms_per_batch": {}}
    for page, sealed in memory["sealed"].items():
        raw = memory["raw"][page]
        out["sealed_vs_raw_memory"][page] = sealed["median_gbps"] / raw["median_gbps"]
        per_batch = BATCH * int(page)
        out["ms_per_batch"][page] = {
            "raw": 1e3 * gbps(per_batch, 1) / raw["median_gbps"],
            "sealed": 1e3 * gbps(per_batch, 1) / sealed["median_gbps"],
            "lookup": sealed["lookup_ms_per_batch"],
            "checks": checks[page]["ms_per_mib"] * per_batch / MiB}
    return out


def conversation_sample(requests: Sequence[Request], distinct: int,
                        seed: int = 0) -> list[Request]:
    """Requests grouped by their second block (their first when they have one), the
    groups drawn in a seeded random order until the drawn requests hold at least
    ``distinct`` distinct blocks; the drawn requests in arrival order. ``ValueError`` if
    the whole trace holds fewer."""
    drawn: list[Request] = []
    seen: set[int] = set()
    for group in conversations(requests, seed):
        if len(seen) >= distinct:
            break
        drawn += group
        seen.update(b for r in group for b in r.blocks)
    if len(seen) < distinct:
        raise ValueError(f"the trace holds {len(seen)} distinct blocks, fewer than {distinct}")
    return sorted(drawn, key=lambda r: r.at_s)


def lru_hit_rate(requests: Sequence[Request], capacity: int) -> float:
    """Leading blocks found over all blocks, with one LRU of ``capacity`` blocks that
    takes each request's blocks after its lookup."""
    lru = BlockLRU(capacity)
    hits = 0
    for r in requests:
        hits += lru.leading(r.blocks)
        lru.insert(r.blocks)
    return hits / sum(len(r.blocks) for r in requests)


def replay(client: Client, requests: Sequence[Request]) -> dict:
    """Part 3 on one client: each request's leading stored blocks read, the rest put."""
    hits = blocks = wrong = unsaved = 0
    t = time.perf_counter()
    for r in requests:
        keys = [f"hit-{b}" for b in r.blocks]
        present = client.backend.exists(keys)
        lead = next((i for i, e in enumerate(present) if e != 1), len(keys))
        got = 0
        for s in range(0, lead, BATCH):
            _, read, bad = client.get(keys[s:min(lead, s + BATCH)],
                                      r.blocks[s:min(lead, s + BATCH)], HIT_PAGE)
            wrong += bad
            got += read
            if read < min(lead, s + BATCH) - s:
                break
        hits += got
        blocks += len(keys)
        for s in range(got, len(keys), BATCH):
            unsaved += client.put(keys[s:s + BATCH], r.blocks[s:s + BATCH], HIT_PAGE)
    memory, disk = client.where([f"hit-{b}" for b in {b for r in requests for b in r.blocks}])
    return {"hit_rate": hits / blocks, "hits": hits, "blocks": blocks, "wrong": wrong,
            "unsaved": unsaved, "seconds": time.perf_counter() - t,
            "put_seconds": client.put_s, "put_retries": client.put_retries,
            "served": client.backend.tier_stats().served,
            "held_at_end": {"memory": len(memory), "disk": len(disk)}}


def disk_info(path: Path) -> dict:
    """The file system and device under ``path`` as ``df`` and ``lsblk`` tell."""
    def out(*cmd: str) -> str:
        try:
            return subprocess.run(cmd, capture_output=True, text=True, timeout=10).stdout
        except (OSError, subprocess.TimeoutExpired):
            return ""

    df = out("df", "-hT", str(path)).splitlines()[-1:]
    device = df[0].split()[0] if df else ""
    return {"df": df[0] if df else "", "lsblk": out(
        "lsblk", "-d", "-o", "NAME,ROTA,SIZE,MODEL,TYPE", *([device] if device.startswith(
            "/dev/") else [])).strip()}


@contextmanager
def client(root: Path, name: str, segment: int, slot: int, disk: bool,
           seal_key: bytes | None) -> Iterator[Client]:
    c = Client(root, name, segment, slot, disk, seal_key)
    try:
        yield c
    finally:
        c.close()


def run(root: Path, n: int, trace: Path) -> dict:
    """Parts 1-3 in ``root`` (module docstring); the JSON's content but the command."""
    seal_key = os.urandom(32)
    started = time.perf_counter()
    load = list(os.getloadavg())
    sides, memory = {}, {}
    for name, key in (("sealed", seal_key), ("raw", None)):
        with client(root, name, SEGMENT, max(PAGES), True, key) as c:
            memory[name] = memory_side(c, n)
            sides[name] = disk_side(c, n)
    capacity = HIT_SEGMENT // (HIT_PAGE + SEAL_BYTES)
    requests = read_trace(trace)
    sample = conversation_sample(requests, WORKING_SET * capacity)
    whole = len({b for r in requests for b in r.blocks})
    hits = {}
    for name, disk in (("disk", True), ("memory_only", False)):
        with client(root, f"hits-{name}", HIT_SEGMENT, HIT_PAGE, disk, seal_key) as c:
            hits[name] = replay(c, sample)
    return {
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "seconds": time.perf_counter() - started,
        "machine": machine_info() | {"disk": disk_info(root), "load_avg_start": load,
                                     "load_avg_end": list(os.getloadavg())},
        "settings": {"pages": list(PAGES), "batch": BATCH, "segment_bytes": SEGMENT,
                     "disk_set_bytes": DISK_SET, "filler_bytes": FILLER,
                     "memory_set_bytes": MEMORY_SET, "lease_ms": LEASE_MS,
                     "bucket_bytes": BUCKET_BYTES, "passes": n, "read_bytes": CHUNK,
                     "hit_segment_bytes": HIT_SEGMENT, "hit_page_bytes": HIT_PAGE,
                     "working_set": WORKING_SET, "trace": trace.name},
        "disk_gets": {name: s["gets"] for name, s in sides.items()},
        "device": {name: s["device"] for name, s in sides.items()},
        "slots": {name: {"used_bytes": s["slot_bytes"], "tier_stats": s["tier_stats"]}
                  for name, s in sides.items()},
        "ratios": {name: s["ratios"] for name, s in sides.items()},
        "warm_loopback_per_byte": {name: s["warm_loopback_per_byte"]
                                   for name, s in sides.items()},
        "memory_gets": memory,
        "seal": seal_cost(memory, seal_check_cost(seal_key)),
        "hit_rate": {"capacity_objects": capacity, "requests": len(sample),
                     "distinct_blocks": len({b for r in sample for b in r.blocks}),
                     "lru_segment": lru_hit_rate(sample, capacity),
                     "lru_unbounded": lru_hit_rate(sample, 1 << 40),
                     "whole_trace": {"distinct_blocks": whole,
                                     "lru_quarter": lru_hit_rate(requests, whole // WORKING_SET),
                                     "lru_unbounded": lru_hit_rate(requests, 1 << 40)},
                     **hits}}


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", type=Path, default=None,
                   help="where the run's directory is made (its disk is measured)")
    p.add_argument("--passes", type=int, default=3, help="timed passes per figure")
    p.add_argument("--trace", type=Path, default=TRACE)
    p.add_argument("--out", type=Path, default=Path("raykv-out/disk_tier.json"))
    a = p.parse_args(argv)
    if a.passes < 1:
        p.error("--passes must be >= 1")
    os.environ["MC_LOG_LEVEL"] = "ERROR"
    root = Path(tempfile.mkdtemp(prefix="raykv-disk-bench-", dir=a.dir))
    try:
        result = {"command": "python -m raykv_lab.bench.disk_tier "
                  + shlex.join(sys.argv[1:] if argv is None else argv)} | run(
                      root, a.passes, a.trace)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=2) + "\n")
    for name, gets in result["disk_gets"].items():
        for page, g in gets.items():
            r = result["ratios"][name][page]
            print(f"{name} {int(page) // KiB} KiB from disk: cold {g['cold']['median_gbps']:.2f}"
                  f" GB/s ({r['cold_vs_device']:.2f}x the device), warm "
                  f"{g['warm']['median_gbps']:.2f} GB/s ({r['warm_vs_device']:.2f}x)")
    h = result["hit_rate"]
    print(f"hit rate: {h['disk']['hit_rate']:.1%} with disk, "
          f"{h['memory_only']['hit_rate']:.1%} without")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
