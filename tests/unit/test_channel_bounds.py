"""Bounded input on the local channel, over real Unix sockets: decoding a hostile frame
builds a bounded number of values (and the old decoder's growth, its control); the
partial frames of many connections share one bound; a peer that never reads its replies
stalls no other peer; a rank refuses a socket served by another uid."""

from __future__ import annotations

import os
import socket
import subprocess
import tempfile
import textwrap
import time
import tracemalloc

import msgpack
import pytest
from raykv.cache_actors import channel_codec as codec
from raykv.cache_actors.channel_codec import MAX_DECODED, MAX_FRAME, WireError
from raykv.cache_actors.channel_socket import ChannelClosedError
from raykv.cache_actors.data_ops import DATA_OP_ARGS
from raykv.cache_actors.node import channel_server
from raykv.cache_actors.node.channel_server import ChannelServer
from raykv.cache_actors.rank.channel_client import ChannelClient
from raykv.controllers.object_batch import MAX_BATCH_OBJECTS, ObjectBatch

from tests.unit.test_channel import ANSWER_S, RawPeer, settle

OLD_LIMITS = dict(max_str_len=1 << 20, max_bin_len=0, max_array_len=16 * MAX_BATCH_OBJECTS,
                  max_map_len=1024, max_ext_len=MAX_FRAME)
"""The decoder before the value budget: per-container limits only."""


def _array(items: bytes, n: int) -> bytes:
    return b"\xdd" + n.to_bytes(4, "big") + items


def hostile(kind: str, nbytes: int) -> bytes:
    """A request-shaped body of about ``nbytes``: ``["exists", 1.0, [X, X, ...]]`` where
    every X is an array of ``MAX_BATCH_OBJECTS`` one- to three-byte values (within every
    per-container limit)."""
    one = {"empty-maps": b"\x80", "empty-lists": b"\x90", "small-strs": b"\xa2xy",
           "small-ints": b"\xcd\x10\x00"}[kind]
    inner = _array(one * MAX_BATCH_OBJECTS, MAX_BATCH_OBJECTS)
    n = max(1, nbytes // len(inner))
    return b"\x93" + msgpack.packb("exists") + msgpack.packb(1.0) + _array(inner * n, n)


def peak_bytes(fn) -> tuple[int, object]:
    """Peak bytes Python allocated while ``fn()`` ran, and what it returned or raised."""
    tracemalloc.start()
    try:
        try:
            out: object = fn()
        except Exception as e:  # noqa: BLE001 - returned for the assertion
            out = e
        return tracemalloc.get_traced_memory()[1], out
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize(("kind", "mib"), [("empty-maps", 2), ("empty-lists", 2),
                                           ("small-strs", 6), ("small-ints", 10)])
def test_a_hostile_frame_decodes_to_a_bounded_number_of_values(kind, mib):
    """A body of ``mib`` MiB of tiny values: the old decoder builds all of them
    (control: over 100 MB each; ~72 bytes per wire byte for empty containers); the
    channel's stops at ``MAX_DECODED`` values (``WireError``) having allocated under
    32 MB, whatever the body's size. The largest real request (a put of
    ``MAX_BATCH_OBJECTS`` objects) still decodes."""
    body = hostile(kind, mib << 20)
    old, decoded = peak_bytes(lambda: msgpack.unpackb(body, **OLD_LIMITS))
    assert isinstance(decoded, list)
    values = len(decoded[2]) * (1 + MAX_BATCH_OBJECTS)
    assert values > MAX_DECODED
    del decoded
    new, error = peak_bytes(lambda: codec.parse_request(body, DATA_OP_ARGS))
    assert isinstance(error, WireError) and "MAX_DECODED" in str(error), error
    assert new < 32 << 20, f"{kind}: {new >> 20} MiB for a {len(body) >> 20} MiB body"
    assert old > 100 << 20, f"control: the old decoder took only {old >> 20} MiB"

    batch = ObjectBatch()
    for i in range(MAX_BATCH_OBJECTS):
        batch.add(f"k{i}", "p", i, 1)
    largest = codec.request("put", 1.0, [batch, None])[codec.HEADER:]  # no ticket
    assert codec.parse_request(largest, DATA_OP_ARGS)[2][0] == batch


def test_a_list_over_max_batch_objects_is_named_as_such():
    body = msgpack.packb(["exists", 1.0, [["k"] * (MAX_BATCH_OBJECTS + 1)]])
    with pytest.raises(WireError, match="MAX_BATCH_OBJECTS=65536"):
        codec.parse_request(body, DATA_OP_ARGS)


def test_a_frame_alone_in_the_buffer_is_handed_over_without_a_copy():
    """The usual case (one request at a time) costs no copy of the frame: the body is
    a view of the buffer the reader gave up; a frame followed by more bytes is copied
    out and the rest kept."""
    reader = codec.FrameReader()
    reader.feed(codec.encode(["a" * 1000]))
    body = reader.next()
    assert isinstance(body, memoryview) and reader.pending == 0
    assert codec.decode(body) == ["a" * 1000]
    reader.feed(codec.encode(["x"]) + codec.encode(["y"])[:3])
    assert codec.decode(reader.next()) == ["x"]
    assert reader.pending == 3 and reader.next() is None


# ------------------------------------------------------------ a peer that never reads
BIG = 60_000  # values of ~100 bytes: a ~6 MB reply, far over a Unix socket's buffer


def _send_or_dropped(peer: RawPeer, data: bytes) -> bool:
    """Send ``data``; False if the server dropped the connection meanwhile."""
    try:
        peer.sock.sendall(data)
        return True
    except (BrokenPipeError, ConnectionResetError):
        return False


def _answered(peer: RawPeer, rest: bytes) -> bool:
    """Finish the request with ``rest``: whether its reply came (False: dropped)."""
    if not _send_or_dropped(peer, rest):
        return False
    try:
        return codec.parse_reply(peer.frame())[0]
    except (AssertionError, ConnectionResetError):  # the server closed it
        return False


@pytest.mark.parametrize("limit", [5 << 20, 1 << 40], ids=["bounded", "control-unbounded"])
def test_partial_frames_of_many_connections_share_one_bound(tmp_path, limit):
    """Three peers each send 3 MiB of a 3.2 MiB request and stop (a frame not finished),
    one after the other. With 5 MiB shared beyond the 1 MiB each connection holds alone,
    the server holds the first two (2 MiB each beyond their own) and drops the third
    when it would buffer more than is left; an honest small call is served meanwhile;
    the two finish and are answered, and what their frames held is given back (a
    fourth peer is then held and answered). Control (no shared bound: what every
    connection could hold before, up to a 64 MiB frame each, 64 GiB for 1,024
    connections): all three are held."""
    from tests.unit.test_channel import ARGS

    srv = ChannelServer(str(tmp_path / "node.sock"), {"echo": lambda *a: list(a)},
                        arg_types={"echo": ARGS["echo"]}, max_buffered=limit)
    beyond = (3 << 20) - codec.FREE_BUFFERED  # what one partial frame draws
    try:
        body = codec.request("echo", time.monotonic() + 60, [1, ["x" * 800_000] * 4, {}])
        head, rest = body[:3 << 20], body[3 << 20:]
        peers = []
        for i in range(3):
            peers.append(RawPeer(srv.path))
            _send_or_dropped(peers[-1], head)
            held = min(i + 1, 2) if limit < 1 << 30 else i + 1
            assert settle(lambda n=held: srv.buffered == n * beyond), (i, srv.buffered)
        client = ChannelClient(srv.path)
        assert client.call("echo", 2, [], {}) == [2, [], {}]  # served meanwhile
        answered = [_answered(p, rest) for p in peers]
        assert answered == ([True, True, False] if limit < 1 << 30 else [True] * 3)
        assert settle(lambda: srv.buffered == 0)  # given back
        late = RawPeer(srv.path)
        assert _send_or_dropped(late, head) and _answered(late, rest)
        for p in (*peers, late):
            p.close()
        client.close()
    finally:
        srv.close()


def _big(n: int) -> list[str]:
    return ["x" * 100] * n


@pytest.fixture
def slow_server(tmp_path, monkeypatch):
    """A server whose ``now`` replies at once, from the I/O thread itself (as a group
    query answered from a recent answer does), and whose ``big`` is a data op (run on a
    pool thread when sent on an async connection); a reply not read is given up only
    after 60 s, so any thread that waited on it would wait that long."""
    monkeypatch.setattr(channel_server, "SEND_TIMEOUT_S", 60.0)
    args = {"now": codec.Signature((int,)), "big": codec.Signature((int,))}
    srv = ChannelServer(str(tmp_path / "n.sock"), {"big": _big}, arg_types=args,
                        async_handlers={"now": lambda reply, n: reply(_big(n), None)})
    yield srv
    srv.close()


def _unread_reply_pending(sock: socket.socket) -> bool:
    """Whether the server has begun a reply on ``sock`` that sits unread (and the
    connection is open): bytes wait in ``sock``'s buffer."""
    try:
        return bool(sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT))
    except BlockingIOError:
        return False


@pytest.mark.parametrize("op", ["now", "big"])
def test_a_peer_that_never_reads_its_replies_stalls_no_other_peer(slow_server, op):
    """Four peers each ask for a 6 MB reply on an async connection and never read it;
    while those replies are still pending (their connections open, bytes waiting unread)
    an honest rank's async and data calls are answered, well within their 5 s deadline
    (and data ops on an async connection, which pool threads run). Before, the I/O
    thread (``now``) or the pool threads (``big``) waited in ``sendall`` for each such
    reader for ``SEND_TIMEOUT_S``: the honest calls timed out (this test failed so on
    the old code)."""
    honest = ChannelClient(slow_server.path, async_ops=frozenset({"now"}), timeout_s=5.0)
    assert honest.call("now", 1) == _big(1)
    hostile = []
    for _ in range(4):
        peer = RawPeer(slow_server.path)
        assert peer.call("now", 1) == (True, _big(1))  # read by the I/O thread from now on
        peer.sock.sendall(codec.request(op, time.monotonic() + ANSWER_S, [BIG]))
        hostile.append(peer)
    assert settle(lambda: all(_unread_reply_pending(p.sock) for p in hostile), ANSWER_S)
    mixed = RawPeer(slow_server.path)  # data ops on an async connection: pool threads
    assert mixed.call("now", 1) == (True, _big(1))
    for i in range(20):
        assert honest.call("now", i) == _big(i)
        assert honest.call("big", i) == _big(i)
        assert mixed.call("big", i) == (True, _big(i))
    assert all(_unread_reply_pending(p.sock) for p in hostile)  # still not given up
    for peer in [*hostile, mixed]:
        peer.close()
    honest.close()


def test_a_reply_never_read_closes_its_connection_only(tmp_path, monkeypatch):
    """A peer that does not read its 6 MB reply for ``SEND_TIMEOUT_S`` (0.5 s here) is
    dropped (a write to it then fails); another peer that reads is served meanwhile."""
    monkeypatch.setattr(channel_server, "SEND_TIMEOUT_S", 0.5)
    srv = ChannelServer(str(tmp_path / "n.sock"), {}, arg_types={"now": codec.Signature(
        (int,))}, async_handlers={"now": lambda reply, n: reply(_big(n), None)})
    peer = RawPeer(srv.path)
    assert peer.call("now", 1) == (True, _big(1))
    peer.sock.sendall(codec.request("now", time.monotonic() + ANSWER_S, [BIG]))

    def dropped() -> bool:
        try:
            peer.sock.send(b"\x00")
        except (BrokenPipeError, ConnectionResetError):
            return True
        return False
    reader = ChannelClient(srv.path, async_ops=frozenset({"now"}), timeout_s=ANSWER_S)
    assert reader.call("now", BIG) == _big(BIG)
    assert settle(dropped, ANSWER_S)
    assert reader.call("now", 2) == _big(2)
    peer.close()
    reader.close()
    srv.close()


def test_a_request_before_the_reply_was_written_whole_drops_the_connection(slow_server):
    """A peer that sends its next request while the reply to the last is still pending
    (it did not read it) is dropped, so an unread reply never grows a queue."""
    peer = RawPeer(slow_server.path)
    assert peer.call("now", 1) == (True, _big(1))
    deadline = time.monotonic() + ANSWER_S
    peer.sock.sendall(codec.request("now", deadline, [BIG]))
    assert settle(lambda: _unread_reply_pending(peer.sock), ANSWER_S)
    peer.sock.sendall(codec.request("now", deadline, [1]))

    def dropped() -> bool:
        try:
            peer.sock.send(b"\x00")
        except (BrokenPipeError, ConnectionResetError):
            return True
        return False
    assert settle(dropped, ANSWER_S)
    peer.close()


# ------------------------------------------------------------------ the server's uid
IMPOSTOR = textwrap.dedent("""
    import socket, sys
    s = socket.socket(socket.AF_UNIX)
    s.bind(sys.argv[1])
    s.listen(1)
    print("ready", flush=True)
    conn, _ = s.accept()
    conn.settimeout(5.0)
    got = b""
    try:
        while chunk := conn.recv(1 << 16):
            got += chunk
    except OSError:
        pass
    print(repr(got), flush=True)
""")


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to serve as another uid")
def test_a_rank_refuses_a_socket_served_by_another_uid(tmp_path):
    """A process of another uid listening where the node actor's socket should be: the
    rank's client refuses it at connect (``ChannelClosedError`` naming both uids), and
    the impostor received nothing, no hello, no owner claim. Control: the same client
    connects to a server of its own uid."""
    folder = tempfile.mkdtemp()
    os.chmod(folder, 0o777)
    path = os.path.join(folder, "n.sock")
    impostor = subprocess.Popen(["/usr/bin/python3", "-c", IMPOSTOR, path], user=65534,
                                stdout=subprocess.PIPE, text=True)
    try:
        assert impostor.stdout.readline().strip() == "ready"
        with pytest.raises(ChannelClosedError, match="served by uid 65534, not by this "
                                                     f"process's uid {os.getuid()}"):
            ChannelClient(path, timeout_s=ANSWER_S)
        assert impostor.stdout.readline().strip() == "b''"
    finally:
        impostor.kill()
        impostor.wait()
    os.unlink(path)
    own = ChannelServer(path, {"echo": lambda: 1}, arg_types={"echo": codec.Signature(())})
    client = ChannelClient(path, timeout_s=ANSWER_S)
    assert client.call("echo") == 1
    client.close()
    own.close()
    os.rmdir(folder)
