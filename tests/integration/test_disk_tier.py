"""The disk tier (L4) at the backend level: a real ``mooncake_master`` with offload on
and real embedded Mooncake clients with disk slots and seals (no Ray).

One store is filled once for the module (``store``: more pages than its segment holds,
so most reach its disk slot) and the tests read it in file order: first as filled
(eviction to disk, a reader of another slot, damage while the client runs), then after
``restarted`` stopped its client and its master, damaged its files and started both
again on the same disk directory (what a restart keeps, damage found by the re-scan, a
bucket planted from another cluster). Every byte any get returns is compared with what
was written: no test lets a get answer a size with other bytes.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from raykv.cache_actors.node.disk_tier import MIN_SLOT_BYTES, DiskSlot
from raykv.controllers.result_codes import OBJECT_NOT_FOUND, SEAL_MISMATCH

from tests.integration.disk_stores import (
    CAPACITY,
    PAGE,
    WRONG,
    Buffer,
    buckets,
    client,
    close,
    fill_other_cluster,
    flip,
    key,
    meta,
    page,
    plain_read,
    put_pages,
    read,
    read_from_another_slot,
    seal_key_of,
    start_master,
    tiers,
    value_offset,
    where,
)

SEED, OTHER_SEED = 1, 2
COUNT = 256
"""Pages put: 64 MiB, twice the 32 MiB segment."""
IDS = list(range(COUNT))


@dataclass
class Store:
    """The module's store: its directory, master, client and what was put."""

    root: Path
    disk_dir: str
    master: object
    backend: object
    buf: Buffer | None
    stored: list[int]
    other: dict = field(default_factory=dict)
    plan: dict = field(default_factory=dict)

    @property
    def slot(self) -> Path:
        return self.backend.disk.path


def wrong(answers: dict) -> list[str]:
    return [k for k, v in answers.items() if v == WRONG]


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """A store filled with ``COUNT`` pages of ``SEED``, most of them offloaded to its
    disk slot; meanwhile another cluster (``OTHER_SEED``, its own seal key) fills its own
    store under the same keys in a process of its own (for the planted bucket)."""
    root = tmp_path_factory.mktemp("disk-tier")
    ctx = mp.get_context("spawn")
    other_done = ctx.Event()
    other = ctx.Process(target=fill_other_cluster,
                        args=(str(root / "other-disk"), str(root), OTHER_SEED, COUNT,
                              other_done))
    other.start()
    disk_dir = str(root / "disk")
    s = Store(root, disk_dir, None, None, None, [],
              other={"process": other, "done": other_done})
    try:
        s.master = start_master(str(root))
        s.backend = client(where(s.master), slot=DiskSlot.claim(disk_dir, 1 << 30),
                           seal_key=seal_key_of(disk_dir))
        s.buf = Buffer(s.backend, 8)
        codes = put_pages(s.buf, SEED, IDS)
        s.stored = [i for i in IDS if codes[key(i)] >= 0]
        yield s
    finally:
        other.join(120)
        if other.is_alive():
            other.kill()
        if s.backend is not None:
            close(s.backend)
        if s.master is not None:
            s.master.stop()


def on_disk_only(s: Store, keys: list[str]) -> list[str]:
    return [k for k, t in zip(keys, tiers(s.backend, keys), strict=True) if t == "l3_disk"]


def test_more_pages_than_memory_holds_come_back_from_disk_byte_exact(store, tmp_path):
    """Every stored page reads back exact, more of them than the segment holds, some
    counted served from the disk tier, from bucket files in the slot. CONTROL: the same
    puts into a store without a disk tier keep at most a segment's worth."""
    assert len(store.stored) == COUNT
    got = read(store.buf, SEED, IDS)
    assert wrong(got) == []
    exact = [k for k, v in got.items() if v == PAGE]
    assert len(exact) == COUNT, {v for v in got.values() if v != PAGE}
    stats = store.backend.tier_stats()
    assert stats.served.get("l3_disk", 0) > 0 and stats.refused == {}
    on_disk = {k for keys in buckets(store.slot).values() for k in keys}
    assert len(on_disk) >= COUNT - CAPACITY and on_disk <= set(exact)
    assert 0 < stats.used_bytes <= stats.limit_bytes

    master = start_master(str(tmp_path), offload=False)  # CONTROL: no disk tier
    try:
        bare = client(where(master))
        try:
            buf = Buffer(bare, 8)
            codes = put_pages(buf, SEED, IDS)
            got = read(buf, SEED, IDS)
        finally:
            close(bare)
    finally:
        master.stop()
    # a put may also be refused while the full segment evicts: not kept either
    assert wrong(got) == [] and sum(rc >= 0 for rc in codes.values()) > 0
    assert 0 < sum(v == PAGE for v in got.values()) <= CAPACITY
    assert sum(v == OBJECT_NOT_FOUND for v in got.values()) >= COUNT - CAPACITY


def test_nodes_of_one_machine_take_distinct_slots_and_read_each_others_disk(store):
    """A second node of the machine (another process) claims the next slot of the same
    disk directory and reads the pages on the first node's disk: exact, counted from
    the disk tier; so does a client without a disk tier."""
    keys = on_disk_only(store, [key(i) for i in IDS])
    assert len(keys) >= 16
    ids = [int(k[1:]) for k in keys]
    ctx = mp.get_context("spawn")
    answer = ctx.Queue()
    reader = ctx.Process(target=read_from_another_slot,
                         args=(where(store.master), store.disk_dir,
                               seal_key_of(store.disk_dir), SEED, ids, answer))
    reader.start()
    try:
        slot_name, got, stats = answer.get(timeout=120)
    finally:
        reader.join(60)
        if reader.is_alive():
            reader.kill()
    assert store.slot.name == "node-0" and slot_name == "node-1"
    assert set(got.values()) == {PAGE}
    assert stats.served == {"l3_disk": len(ids)}

    diskless = client(where(store.master), seal_key=seal_key_of(store.disk_dir), segment=0)
    try:
        got = read(Buffer(diskless, 8), SEED, ids)
        stats = diskless.tier_stats()
    finally:
        close(diskless)
    assert set(got.values()) == {PAGE}
    assert stats.served == {"l3_disk": len(ids)}


def disk_records(s: Store, bucket: Path, keys: list[str]) -> list[int]:
    """The record numbers of ``bucket`` (keys ``keys``) whose object lives on disk
    alone (a get reads it from the file)."""
    alone = set(on_disk_only(s, keys))
    return [n for n, k in enumerate(keys) if k in alone]


def test_flipped_bytes_on_disk_are_refused_counted_and_removed(store):
    """16 bytes flipped in a page on disk: the get answers ``SEAL_MISMATCH``, counted
    (``refused``), the object removed (exists: absent; a put writes it anew), the
    bucket's other pages still exact. CONTROL: the plain Mooncake client reads the
    flipped bytes without error."""
    bucket, keys = next(iter(buckets(store.slot).items()))
    records = disk_records(store, bucket, keys)
    assert len(records) >= 4
    n = records[0]
    store.plan["flipped-running"] = (bucket, keys[n])
    flip(bucket, n)
    victim = int(keys[n][1:])
    plain = plain_read(store.backend, [keys[n]])[keys[n]]
    assert not isinstance(plain, int)  # read in full, no error
    changed = (plain != page(SEED, victim)).nonzero()[0]
    assert len(changed) == 16 and changed[0] == PAGE // 2

    before = store.backend.tier_stats().refused.get("mac", 0)
    assert read(store.buf, SEED, [victim]) == {keys[n]: SEAL_MISMATCH}
    assert store.backend.tier_stats().refused.get("mac", 0) == before + 1
    assert store.backend.exists([keys[n]]) == [0]
    assert read(store.buf, SEED, [victim]) == {keys[n]: OBJECT_NOT_FOUND}
    assert put_pages(store.buf, SEED, [victim]) == {keys[n]: 0}  # written anew
    assert read(store.buf, SEED, [victim]) == {keys[n]: PAGE}
    rest = [int(keys[m][1:]) for m in records[1:]]
    assert set(read(store.buf, SEED, rest).values()) == {PAGE}


def test_a_truncated_bucket_gives_misses_never_wrong_bytes(store):
    """A bucket cut in the middle of a page: the pages wholly before the cut read exact,
    also in a batch with cut ones (Mooncake fails the whole batch with
    ``FILE_READ_FAIL``: each is read again alone), the cut ones miss, no get answers
    other bytes; a cut page is counted ``unreadable`` and removed from the store, so a
    put writes it anew (Mooncake's exists kept answering present for it, and
    put-if-absent then never rewrote it: a miss for good, also after a restart). The
    bucket then deleted: its other pages miss (``FILE_OPEN_FAIL``), removed as well."""
    bucket, keys = list(buckets(store.slot).items())[1]
    records = disk_records(store, bucket, keys)
    cut = records[len(records) // 2]
    os.truncate(bucket, value_offset(cut) + PAGE // 2)
    store.plan["truncated"] = (bucket, keys)
    before = [int(keys[n][1:]) for n in records if n < cut]
    after = [int(keys[n][1:]) for n in records if n >= cut]
    assert len(before) >= 4 and len(after) >= 4
    mixed = read(store.buf, SEED, before[:4] + after[:4])
    whole = read(store.buf, SEED, before)
    cut_off = read(store.buf, SEED, after)
    assert wrong(mixed) == [] and wrong(cut_off) == []
    assert set(whole.values()) == {PAGE}
    assert [mixed[key(i)] for i in before[:4]] == [PAGE] * 4
    assert all(v < 0 for v in cut_off.values()) and all(mixed[key(i)] < 0 for i in after[:4])
    assert store.backend.tier_stats().refused.get("unreadable") == len(after)
    assert store.backend.exists([key(i) for i in after]) == [0] * len(after)
    assert set(put_pages(store.buf, SEED, after[:4]).values()) == {0}  # written anew
    assert set(read(store.buf, SEED, after[:4]).values()) == {PAGE}

    bucket.unlink()
    gone = read(store.buf, SEED, before)
    assert wrong(gone) == [] and all(v < 0 for v in gone.values())
    print("truncated bucket:", set(cut_off.values()), "deleted:", set(gone.values()))
    assert store.backend.exists([key(i) for i in before]) == [0] * len(before)


def plant(s: Store, ours: set[str]) -> tuple[Path, list[str]]:
    """Copy the bucket (and its ``.meta``) of the other cluster's slot with the most
    keys not in ``ours`` into this store's slot, under a bucket id of its own: the copy
    and its keys."""
    assert s.other["done"].wait(120), "the other cluster did not fill its store"
    s.other["process"].join(60)
    theirs = buckets(s.root / "other-disk" / "node-0")
    assert theirs, "the other cluster offloaded nothing"
    source, keys = max(theirs.items(), key=lambda item: len(set(item[1]) - ours))
    fresh = max(int(p.stem) for p in s.slot.glob("*.bucket")) + 1000
    target = s.slot / f"{fresh}.bucket"
    shutil.copyfile(source, target)
    shutil.copyfile(meta(source), meta(target))
    return target, keys


@pytest.fixture(scope="module")
def restarted(store):
    """``store`` after damage and a restart: besides the damage of the tests before, a
    page flipped and two ``.meta`` files truncated and deleted, a bucket of the other
    cluster planted; then its client closed and its master stopped, and both started
    again on the same disk directory (the client claims its slot again and scans it)."""
    truncated, truncated_keys = store.plan["truncated"]  # deleted since
    found = buckets(store.slot)
    assert len(found) >= 4, f"only {len(found) + 1} buckets reached disk"
    paths = list(found)
    flipped_bucket, running_flip = store.plan["flipped-running"]
    assert paths[0] == flipped_bucket and truncated not in found
    records = [n for n in disk_records(store, paths[0], found[paths[0]])
               if found[paths[0]][n] != running_flip]
    flip(paths[0], records[0])
    os.truncate(meta(paths[1]), meta(paths[1]).stat().st_size // 2)
    meta(paths[2]).unlink()
    found[truncated] = truncated_keys
    planted, planted_keys = plant(store, {k for keys in found.values() for k in keys})
    store.plan |= {"buckets": found, "flipped-before": found[paths[0]][records[0]],
                   "meta-truncated": found[paths[1]], "meta-deleted": found[paths[2]],
                   "intact": paths[3:], "planted": planted_keys}

    close(store.backend)
    store.backend = None
    store.master.stop()
    store.master = start_master(str(store.root))
    # the master restarted too: it never knew the slot's last client, so the claim need
    # not wait for it to forget that client (client_ttl_s=0)
    slot = DiskSlot.claim(store.disk_dir, 1 << 30, client_ttl_s=0)
    store.backend = client(where(store.master), slot=slot, seal_key=seal_key_of(store.disk_dir))
    store.buf = Buffer(store.backend, 8)
    return store


def ids_of(keys) -> list[int]:
    return sorted(int(k[1:]) for k in keys)


def test_a_restart_keeps_the_pages_that_reached_disk(restarted):
    """After client and master restarted on the same directory (the client in the same
    slot), every page of an undamaged bucket reads back exact, from disk. CONTROL: the
    pages that were in memory alone are gone (misses)."""
    s, plan = restarted, restarted.plan
    assert s.slot.name == "node-0"
    planted = set(plan["planted"])
    intact = [k for p in plan["intact"] for k in plan["buckets"][p] if k not in planted]
    got = read(s.buf, SEED, ids_of(intact))
    assert set(got.values()) == {PAGE}
    assert s.backend.tier_stats().served == {"l3_disk": len(intact)}
    on_disk = {k for keys in plan["buckets"].values() for k in keys}
    memory_only = [i for i in IDS if key(i) not in on_disk | planted]
    assert len(memory_only) >= 16
    got = read(s.buf, SEED, memory_only)
    assert set(got.values()) == {OBJECT_NOT_FOUND}


def test_damage_before_a_restart_is_never_served_after_it(restarted):
    """The re-scan at setup does not launder damage: the page flipped before the restart
    answers ``SEAL_MISMATCH`` (counted, removed); the buckets whose ``.meta`` was
    truncated or deleted miss (Mooncake's scan drops such a bucket, or keeps entries
    of a truncated ``.meta`` that then fail their seal), as do the deleted bucket and
    the page removed before; no get answers other bytes."""
    s, plan = restarted, restarted.plan
    before = s.backend.tier_stats().refused.get("mac", 0)
    flipped = plan["flipped-before"]
    assert read(s.buf, SEED, ids_of([flipped])) == {flipped: SEAL_MISMATCH}
    assert s.backend.tier_stats().refused.get("mac", 0) == before + 1
    assert s.backend.exists([flipped]) == [0]
    for name in ("meta-truncated", "meta-deleted"):
        got = read(s.buf, SEED, ids_of(plan[name]))
        print(name, "after the restart:", set(got.values()), s.backend.tier_stats().refused)
        assert wrong(got) == [] and set(got.values()) != {PAGE}
    _, truncated = plan["truncated"]
    got = read(s.buf, SEED, ids_of(truncated))
    print("truncated, then deleted bucket after the restart:", set(got.values()))
    assert wrong(got) == []
    _, removed = plan["flipped-running"]
    assert wrong(read(s.buf, SEED, ids_of([removed]))) == []


def test_a_bucket_planted_from_another_cluster_is_never_served(restarted):
    """A bucket of another cluster (its own seal key, the same keys, other bytes) copied
    into the slot before the restart: its pages are misses (``SEAL_MISMATCH``), never the
    other cluster's bytes. CONTROL: the plain Mooncake client serves them."""
    s, plan = restarted, restarted.plan
    on_disk = {k for keys in plan["buckets"].values() for k in keys}
    foreign = [k for k in plan["planted"] if k not in on_disk]
    assert len(foreign) >= 4
    plain = plain_read(s.backend, foreign[:2])
    for k, got in plain.items():
        assert not isinstance(got, int), got
        assert (got == page(OTHER_SEED, int(k[1:]))).all()
    got = read(s.buf, SEED, ids_of(plan["planted"]))
    print("planted: ours", {got[k] for k in plan["planted"] if k in on_disk}, "foreign",
          {got[k] for k in foreign})
    assert wrong(got) == []
    assert {got[k] for k in foreign} == {SEAL_MISMATCH}
    assert s.backend.exists(foreign) == [0] * len(foreign)


def test_damage_after_a_restart_is_caught(restarted):
    """A page flipped on disk after the restart's scan: ``SEAL_MISMATCH``, not served.
    CONTROL: before the flip it read exact."""
    s, plan = restarted, restarted.plan
    path = plan["intact"][0]
    keys = plan["buckets"][path]
    n = next(n for n in disk_records(s, path, keys) if keys[n] not in plan["planted"])
    assert read(s.buf, SEED, ids_of([keys[n]])) == {keys[n]: PAGE}
    flip(path, n)
    assert read(s.buf, SEED, ids_of([keys[n]])) == {keys[n]: SEAL_MISMATCH}


def test_a_full_disk_drops_what_it_cannot_hold_and_puts_go_on_in_memory(tmp_path):
    """The smallest slot (three buckets) under more pages than memory and disk hold: the
    slot stays within its bound, Mooncake deleting its oldest buckets for new ones;
    puts still succeed after the first deletion, and every page a put stored reads back
    exact or misses, never other bytes; the kept buckets' pages all read exact. CONTROL:
    pages do miss, none of them a page of a kept bucket, pages of deleted buckets among
    them (the disk did fill), while the module's store, with room on disk, read every
    page back."""
    limit = MIN_SLOT_BYTES
    master = start_master(str(tmp_path))
    backend = None
    try:
        disk_dir = str(tmp_path / "disk")
        backend = client(where(master), slot=DiskSlot.claim(disk_dir, limit),
                         seal_key=seal_key_of(disk_dir))
        buf = Buffer(backend, 8)
        written: dict[str, list[str]] = {}  # every bucket seen, by name: its keys
        seen: list[tuple[int, frozenset[str], int]] = []  # per batch: puts, buckets, bytes

        def note(codes):
            now = buckets(backend.disk.path)
            written.update((p.name, k) for p, k in now.items() if p.name not in written)
            seen.append((len(codes), frozenset(p.name for p in now),
                         backend.disk.used_bytes()))

        codes = put_pages(buf, SEED, IDS, after_batch=note)
        got = read(buf, SEED, [i for i in IDS if codes[key(i)] >= 0])
        stats = backend.tier_stats()
    finally:
        if backend is not None:
            close(backend)
        master.stop()
    final = seen[-1][1]
    deleted = [name for name in written if name not in final]
    first_deleted = next(n for (_, before, _), (n, names, _) in zip(seen, seen[1:],
                                                                     strict=False)
                         if before - names)
    in_deleted = {k for name in deleted for k in written[name]}
    missed = {k for k, v in got.items() if v == OBJECT_NOT_FOUND}
    print("disk full: buckets written", len(written), "deleted", len(deleted), "first after",
          first_deleted, "puts; most bytes", max(b for _, _, b in seen), "of", limit,
          "; stored", sum(rc >= 0 for rc in codes.values()), "missed", len(missed), "of which",
          len(missed & in_deleted), "in the", len(in_deleted), "pages of deleted buckets",
          stats)
    assert max(b for _, _, b in seen) <= limit
    assert wrong(got) == [] and set(got.values()) <= {PAGE, OBJECT_NOT_FOUND}
    late = [i for i in IDS[first_deleted:] if codes[key(i)] >= 0]
    assert len(late) >= 16  # puts after the disk filled still succeed
    # the 8 newest stored: in memory (a put may be refused while the segment evicts, so
    # the newest stored are not always the last 8 put)
    assert {got[key(i)] for i in late[-8:]} == {PAGE}
    assert sorted(deleted) == sorted(written)[:len(deleted)]  # the oldest first
    # each miss: a page of no kept bucket (a bucket written and deleted between two
    # looks is never seen, so not every miss is in a deleted bucket that was seen)
    in_final = {k for name in final for k in written[name]}
    assert missed & in_deleted and not missed & in_final
    assert {got[k] for name in final for k in written[name]} == {PAGE}
