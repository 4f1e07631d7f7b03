"""A hostile peer on a real node actor's local channel (real Ray, real mooncake_master):
frames announced at 4 GiB and garbage on a group connection cost the actor no memory,
drop only those connections, and leave an honest rank's data calls and group queries
answering over the same channel."""

from __future__ import annotations

import socket
import struct
import time

import ray
from raykv.cache_actors import channel_codec as codec
from raykv.controllers import StorageConfig

from tests.integration.ranks import indices, start_rank
from tests.sockets import closed_by_peer

N = 4
ANSWER_S = 30.0  # "answers at all": a bound far above any healthy call, against hangs


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")



def group_connection(path: str) -> socket.socket:
    """A connection whose first request is a group query (of a deployment nobody
    registered: answered with an error), so the actor's I/O thread reads it from now on,
    beside every rank's group connection."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(path)
    sock.settimeout(ANSWER_S)
    reader = codec.FrameReader()

    def frame() -> object:
        while (body := reader.next()) is None:
            data = sock.recv(1 << 16)
            assert data, "the node actor closed the connection"
            reader.feed(data)
        return body

    sock.sendall(codec.hello())
    codec.check_hello(codec.decode(frame()), "node actor")
    sock.sendall(codec.request("group_exists", time.monotonic() + ANSWER_S,
                               ["no-such-deployment", 1, (0, 0), ["k"], []]))
    ok, error = codec.parse_reply(frame())
    assert not ok and isinstance(error, ValueError), error
    return sock


def test_huge_frames_and_garbage_leave_the_node_actor_serving(cluster, uid):
    node = cluster.node_ids[0]
    actor = cluster.node_actors[node]
    rank = start_rank(node, StorageConfig(model_name=f"hostile/{uid}"))  # its group's home
    keys = [f"{uid}-{i}" for i in range(N)]
    ray.get(rank.fill.remote(0))
    assert ray.get(rank.call.remote("batch_set_v1", keys, indices(0, N))) == [True] * N
    assert ray.get(rank.call.remote("batch_exists", keys)) == N
    assert ray.get(rank.call.remote("group_exists", keys)).kv_hit_pages == N

    path = ray.get(actor.channel_path.remote())
    pid = ray.get(actor.health.remote())["pid"]
    before = rss_bytes(pid)
    huge = []
    for _ in range(8):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(path)
        s.sendall(struct.pack("!I", 0xFFFFFFFF) + b"\x00" * 64)
        huge.append(s)
    group = group_connection(path)
    group.sendall(codec.frame(b"\xc1 not msgpack \xff"))

    # the rank's own connections, its group one included, opened before all this
    assert ray.get(rank.call.remote("batch_exists", keys)) == N
    assert ray.get(rank.call.remote("group_exists", keys)).kv_hit_pages == N
    assert ray.get(rank.call.remote("batch_get_v1", keys, indices(N, N))) == [True] * N
    grown = rss_bytes(pid) - before
    assert grown < 100 << 20, f"the node actor's RSS grew {grown >> 20} MiB"
    assert [closed_by_peer(s, ANSWER_S) for s in huge] == [True] * 8
    assert closed_by_peer(group, ANSWER_S)
    for s in (*huge, group):
        s.close()
