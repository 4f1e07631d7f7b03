"""A hostile peer on a real node actor's local channel (real Ray, real mooncake_master):
frames announced at 4 GiB cost the actor no memory and drop only those connections;
garbage on a group connection is answered with ``ValueError`` on that connection; a
64 MiB frame of tiny values costs the actor under 200 MB; peers that never read their
replies stall no rank's group queries; a registration of ten million ranks is refused.
An honest rank's data calls and group queries answer over the same channel throughout."""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
import time

import msgpack
import pytest
import ray
from raykv.cache_actors import channel_codec as codec
from raykv.controllers import StorageConfig
from raykv.controllers.contract import PoolName
from raykv.controllers.deployments import PoolSpec, deployment_id
from raykv.controllers.naming import CONTROLLER_NAME
from raykv.controllers.object_batch import MAX_BATCH_OBJECTS

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



class Peer:
    """A connection speaking the wire by hand (no owner claim)."""

    def __init__(self, path: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(path)
        self.sock.settimeout(ANSWER_S)
        self.reader = codec.FrameReader()
        self.sock.sendall(codec.hello())
        codec.check_hello(codec.decode(self.frame()), "node actor")

    def frame(self) -> object:
        while (body := self.reader.next()) is None:
            data = self.sock.recv(1 << 20)
            assert data, "the node actor closed the connection"
            self.reader.feed(data)
        return body

    def call(self, op: str, *args) -> tuple[bool, object]:
        self.sock.sendall(codec.request(op, time.monotonic() + ANSWER_S, args))
        return codec.parse_reply(self.frame())


def group_connection(path: str) -> Peer:
    """A connection whose first request is a group query (of a deployment nobody
    registered: answered with an error), so the actor's I/O thread reads it from now on,
    beside every rank's group connection."""
    peer = Peer(path)
    ok, error = peer.call("group_exists", "no-such-deployment", 1, (0, 0), "", ["k"], [])
    assert not ok and isinstance(error, ValueError), error
    return peer


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
    group.sock.sendall(codec.frame(b"\xc1 not msgpack \xff"))

    # the rank's own connections, its group one included, opened before all this
    assert ray.get(rank.call.remote("batch_exists", keys)) == N
    assert ray.get(rank.call.remote("group_exists", keys)).kv_hit_pages == N
    assert ray.get(rank.call.remote("batch_get_v1", keys, indices(N, N))) == [True] * N
    grown = rss_bytes(pid) - before
    assert grown < 100 << 20, f"the node actor's RSS grew {grown >> 20} MiB"
    assert [closed_by_peer(s, ANSWER_S) for s in huge] == [True] * 8
    ok, error = codec.parse_reply(group.frame())  # answered, on the same connection
    assert not ok and type(error) is ValueError and "malformed" in str(error), error
    assert group.call("exists", ["k"])[0]  # which serves on
    for s in (*huge, group.sock):
        s.close()


def vm_kib(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field} for pid {pid}")


def hostile_body(one: bytes) -> bytes:
    """``["exists", deadline, [X, X, ...]]`` just under ``MAX_FRAME``: every X an
    array of ``MAX_BATCH_OBJECTS`` copies of the value ``one`` (each within every
    per-container limit; the old decoder built all of them)."""
    inner = b"\xdd" + MAX_BATCH_OBJECTS.to_bytes(4, "big") + one * MAX_BATCH_OBJECTS
    head = b"\x93" + msgpack.packb("exists") + msgpack.packb(time.monotonic() + ANSWER_S)
    n = (codec.MAX_FRAME - len(head) - 5) // len(inner)
    return head + b"\xdd" + n.to_bytes(4, "big") + inner * n


@pytest.mark.parametrize("one", [b"\x80", b"\x90", b"\xa2xy"],
                         ids=["empty-maps", "empty-lists", "small-strs"])
def test_a_64_mib_frame_of_tiny_values_costs_the_node_actor_under_200_mb(cluster, uid, one):
    """A frame of just under 64 MiB whose values are one to three bytes each (decoded
    whole, ~4.6 GB of empty maps): the node actor answers ``ValueError`` on the same
    connection and serves its next request; its peak RSS over the whole exchange
    (``VmHWM``, reset first through ``clear_refs``) and its RSS after stay under 200 MB
    above where they were. (The old decoder's growth: tests/unit/test_channel_bounds.py,
    on a smaller frame.)"""
    node = cluster.node_ids[0]
    actor = cluster.node_actors[node]
    rank = start_rank(node, StorageConfig(model_name=f"hostile-frame/{uid}"))
    keys = [f"{uid}-{i}" for i in range(N)]
    ray.get(rank.fill.remote(0))
    assert ray.get(rank.call.remote("batch_set_v1", keys, indices(0, N))) == [True] * N
    path = ray.get(actor.channel_path.remote())
    pid = ray.get(actor.health.remote())["pid"]
    body = hostile_body(one)
    peer = Peer(path)
    assert peer.call("exists", ["k"])[0]
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    before = vm_kib(pid, "VmRSS")
    peer.sock.sendall(codec.frame(body))
    ok, error = codec.parse_reply(peer.frame())
    peak, after = vm_kib(pid, "VmHWM"), vm_kib(pid, "VmRSS")
    assert not ok and type(error) is ValueError and "MAX_DECODED" in str(error), error
    assert peer.call("exists", ["k"])[0]  # the same connection serves on
    assert peak - before < 200 << 20, f"peak RSS grew {(peak - before) >> 20} MiB"
    assert after - before < 200 << 20, f"RSS grew {(after - before) >> 20} MiB"
    print(f"{len(body) >> 20} MiB frame: node actor peak +{(peak - before) >> 20} MiB, "
          f"after +{(after - before) >> 20} MiB")
    peer.sock.close()
    assert ray.get(rank.call.remote("batch_exists", keys)) == N


def test_peers_that_never_read_stall_no_rank_s_group_queries(cluster, uid):
    """Eight peers on group connections each send 2,000 group queries at once, side by
    side, and never read a reply; the node actor answers each of them from its I/O
    thread (refused: no owner claim) until that peer's socket buffer is full (then it is
    dropped: its next request came before the reply was written). An honest rank's
    group queries and data calls, made meanwhile, are answered within their 5 s
    deadline. Before, the I/O thread waited ``SEND_TIMEOUT_S`` (2 s) in ``sendall`` for
    each such peer in turn, 16 s in all, and the rank's group queries ran past their
    deadline."""
    node = cluster.node_ids[0]
    actor = cluster.node_actors[node]
    config = StorageConfig(model_name=f"never-reads/{uid}")
    rank = start_rank(node, config)
    keys = [f"{uid}-{i}" for i in range(N)]
    ray.get(rank.fill.remote(0))
    assert ray.get(rank.call.remote("batch_set_v1", keys, indices(0, N))) == [True] * N
    assert ray.get(rank.call.remote("group_exists", keys)).kv_hit_pages == N  # claimed
    path = ray.get(actor.channel_path.remote())
    query = codec.request("group_exists", time.monotonic() + 600,
                          [deployment_id(config), 1, (0, 0), "", keys, []])
    hostile = [group_connection(path) for _ in range(8)]
    ready = threading.Barrier(len(hostile) + 1)

    def flood(peer: Peer) -> None:
        ready.wait()
        # dropped during the send: it sent requests while its replies waited unread
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            peer.sock.sendall(query * 2000)
    floods = [threading.Thread(target=flood, args=(p,)) for p in hostile]
    for t in floods:
        t.start()
    ready.wait()
    for _ in range(5):
        assert ray.get(rank.call.remote("group_exists", keys)).kv_hit_pages == N
        assert ray.get(rank.call.remote("batch_exists", keys)) == N
    for t in floods:
        t.join(ANSWER_S)
    for peer in hostile:
        peer.sock.close()


def test_a_registration_of_ten_million_ranks_is_refused(cluster, uid):
    """A rank's config with ``tp_size=10**7`` (set after it was made, so its own check
    never saw it) registered straight with the controller: ``ValueError`` naming
    ``MAX_GROUP_RANKS``, and no deployment of it exists, so no home node ever lists its
    ranks. Control: the same config with a sane size registers."""
    controller = ray.get_actor(CONTROLLER_NAME, namespace=cluster.namespace)
    config = StorageConfig(model_name=f"huge-group/{uid}")
    config.tp_size = 10**7
    spec = PoolSpec(PoolName.KV, "mha", ("k", "v"))
    with pytest.raises(ray.exceptions.RayTaskError, match="MAX_GROUP_RANKS") as e:
        ray.get(controller.register_rank.remote(config, [spec], cluster.node_ids[0]))
    assert isinstance(e.value.cause, ValueError)
    assert deployment_id(config) not in ray.get(controller.deployments.remote())
    config.tp_size = 2
    ray.get(controller.register_rank.remote(config, [spec], cluster.node_ids[0]))
    assert ray.get(controller.deployment.remote(deployment_id(config))).tp_size == 2
