"""Puts across clients (real mooncake_master, real Mooncake clients): a put of a key
whose put by another client is still in flight is not reported stored, and a node's puts
land on its own segment while it has room.

Mooncake's ``batch_put_from`` returns 0 for such a key (and ``batch_is_exist`` says 0
until the first put ends), so without the confirmation the second writer was told
"stored" for an object that did not exist yet, and never would if the first put failed
(``cache_actors.node.mooncake_backend``)."""

import ctypes
import mmap
import multiprocessing as mp
import time

import pytest
from raykv.cache_actors.node.mooncake_backend import MooncakeBackend
from raykv.clusters.mooncake_master import MooncakeMaster
from raykv.controllers.result_codes import ALREADY_PRESENT, NOT_CONFIRMED

BIG = 512 << 20  # a put that takes a while over TCP loopback
SMALL = 64 << 10


def _client(master: tuple[str, str], segment: int) -> MooncakeBackend:
    address, metadata = master
    return MooncakeBackend.embedded(local_hostname="127.0.0.1", metadata_server=metadata,
                                    master_server_addr=address, global_segment_size=segment,
                                    local_buffer_size=16 << 20)


def _buffer(backend: MooncakeBackend, nbytes: int, fill: int) -> tuple[mmap.mmap, int]:
    mm = mmap.mmap(-1, nbytes)
    mm.write(bytes([fill]) * nbytes)
    ptr = ctypes.addressof(ctypes.c_char.from_buffer(mm))
    backend.register(ptr, nbytes)
    return mm, ptr


def _provider(master, ready, stop) -> None:
    """The segment every object lands in (another process: a TCP transfer)."""
    backend = _client(master, 1 << 30)
    ready.set()
    stop.wait(300)
    backend.close()


def _first_writer(master, key, started, done) -> None:
    backend = _client(master, 0)
    _mm, ptr = _buffer(backend, BIG, 7)
    started.set()
    backend._store.batch_put_from([key], [ptr], [BIG])
    done.set()
    stop = time.monotonic() + 5
    while time.monotonic() < stop:
        time.sleep(0.1)
    backend.close()


@pytest.fixture
def master():
    m = MooncakeMaster("127.0.0.1").start()
    yield m.master_address, m.metadata_server
    m.stop()


def test_a_put_behind_another_writers_put_in_flight_is_not_reported_stored(master):
    ctx = mp.get_context("spawn")
    ready, stop, started, done = (ctx.Event() for _ in range(4))
    provider = ctx.Process(target=_provider, args=(master, ready, stop))
    provider.start()
    try:
        assert ready.wait(120)
        second = _client(master, 0)
        _mm, ptr = _buffer(second, SMALL, 9)
        for attempt in range(3):  # the first put must still be in flight when we ask
            key = f"confirm-{attempt}"
            first = ctx.Process(target=_first_writer, args=(master, key, started, done))
            started.clear()
            done.clear()
            first.start()
            assert started.wait(120)
            time.sleep(0.05)
            codes = second.put([key], [ptr], [SMALL])
            in_flight = not done.is_set()
            first.join(120)
            if in_flight:
                break
        assert in_flight, "the first put never stayed in flight long enough to race it"
        assert codes == [NOT_CONFIRMED]  # not "stored": the first writer's put decides
        assert second.put([key], [ptr], [SMALL]) == [ALREADY_PRESENT]  # it ended: there
        assert second.put(["confirm-alone"], [ptr], [SMALL]) == [0]  # a plain put: 0
        second.close()
    finally:
        stop.set()
        provider.join(60)


def _marked_provider(master, ready, stop) -> None:
    """A segment of another process holding one object, ``provider-marker``, on itself."""
    backend = _client(master, 1 << 30)
    _mm, ptr = _buffer(backend, SMALL, 1)
    assert backend.put(["provider-marker"], [ptr], [SMALL]) == [0]
    ready.set()
    stop.wait(300)
    backend.close()


def _endpoints(backend: MooncakeBackend, keys: list[str]) -> list[str]:
    """The transfer endpoint of the segment holding each key's replica."""
    found = backend._store.batch_get_replica_desc(keys)
    return [found[k][0].get_memory_descriptor().buffer_descriptor.transport_endpoint
            for k in keys]


def test_puts_land_on_the_writers_own_segment_while_it_has_room(master):
    """``placement="own"``: 16 MiB of puts all land on the writer's 32 MiB segment, and
    48 MiB more are all stored, the overflow on the other segment. Control, the same
    client with Mooncake's default placement: its puts land on the other segment too."""
    ctx = mp.get_context("spawn")
    ready, stop = ctx.Event(), ctx.Event()
    provider = ctx.Process(target=_marked_provider, args=(master, ready, stop))
    provider.start()
    try:
        assert ready.wait(120)
        address, metadata = master
        writer = MooncakeBackend.embedded(
            local_hostname="127.0.0.1", metadata_server=metadata, master_server_addr=address,
            global_segment_size=32 << 20, local_buffer_size=16 << 20)
        page = 1 << 20
        _mm, ptr = _buffer(writer, 64 * page, 5)
        (elsewhere,) = _endpoints(writer, ["provider-marker"])

        def put(backend: MooncakeBackend, keys: list[str], first_page: int) -> list[str]:
            ptrs = [ptr + (first_page + i) * page for i in range(len(keys))]
            assert backend.put(keys, ptrs, [page] * len(keys)) == [0] * len(keys)
            return _endpoints(writer, keys)

        control = [f"any-{i}" for i in range(16)]
        assert elsewhere in put(MooncakeBackend(writer._store, writer.own_segment,
                                                        prefer_own_segment=False), control, 0)
        writer.remove(control)
        placed = put(writer, [f"own-{i}" for i in range(16)], 0)
        assert elsewhere not in placed and len(set(placed)) == 1
        assert elsewhere in put(writer, [f"more-{i}" for i in range(48)], 16)  # full
        writer.close()
    finally:
        stop.set()
        provider.join(60)
