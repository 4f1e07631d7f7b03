"""The same-node channel on its own, over real Unix sockets: replies, errors by kind,
concurrent callers, the socket's mode, a clear retryable error once the server is gone;
and what a hostile or broken peer cannot do: allocate by announcing a huge frame, stop
other connections with a bad message, leak fds or threads, end accepting by exhausting
fds; deadlines on the client and stale requests left unrun on the server."""

import contextlib
import logging
import os
import resource
import signal
import socket
import stat
import struct
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

import msgpack
import pytest
from raykv.cache_actors import channel_codec as codec
from raykv.cache_actors.channel_codec import MAX_FRAME, ChannelVersionError, Signature, WireError
from raykv.cache_actors.channel_socket import ChannelClosedError, RequestNotSentError
from raykv.cache_actors.data_ops import DATA_OP_ARGS, DataOp
from raykv.cache_actors.errors import (
    DeadlineExceededError,
    NodeUnavailableError,
    StalePoolsError,
    UnknownPoolError,
)
from raykv.cache_actors.node import channel_server
from raykv.cache_actors.node.channel_server import ChannelServer
from raykv.cache_actors.rank.channel_client import MAX_IDLE, ChannelClient
from raykv.controllers.contract import PoolHitPolicy, PoolName, PoolTransferResult
from raykv.controllers.deployments import PoolQuery
from raykv.controllers.object_batch import ObjectBatch

from tests.integration.process_stop import stop_process
from tests.sockets import closed_by_peer

ANSWER_S = 10.0  # "answers at all": a generous bound, only there to turn a hang into a failure
GONE_S = 30.0    # fds and threads of closed connections are released within this


def bad(_):
    raise ValueError("bad offset 7")


def broken():
    raise KeyError("internal")


def later(reply, value):
    """An async op: answered from another thread, after the I/O thread moved on."""
    threading.Timer(0.05, reply, (value, None)).start()


def refuse(reply, value):
    raise ValueError(f"refused {value}")


ARGS = {"echo": Signature((int, list[str], dict[str, int])), "bad": Signature((int,)),
        "broken": Signature(()), "together": Signature(()), "later": Signature((int,)),
        "refuse": Signature((int,))}


@pytest.fixture
def server(tmp_path):
    together = threading.Barrier(4, timeout=5)
    srv = ChannelServer(str(tmp_path / "node.sock"), {
        "echo": lambda *a: list(a), "bad": bad, "broken": broken,
        "together": lambda: together.wait() is not None},
        arg_types=ARGS, async_handlers={"later": later, "refuse": refuse})
    yield srv
    srv.close()


def fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def threads() -> int:
    return len(os.listdir("/proc/self/task"))


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def settle(what, limit_s: float = GONE_S) -> bool:
    """Poll ``what()`` until it is true; its last value."""
    end = time.monotonic() + limit_s
    while not (ok := what()) and time.monotonic() < end:
        time.sleep(0.05)
    return ok



class RawPeer:
    """A rank speaking the wire by hand, to send what an honest client never would."""

    def __init__(self, path: str, greet: bool = True) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(path)
        self.sock.settimeout(ANSWER_S)
        self.reader = codec.FrameReader()
        if greet:
            self.sock.sendall(codec.hello())
            codec.check_hello(codec.decode(self.frame()), "node actor")

    def frame(self) -> bytes:
        while (body := self.reader.next()) is None:
            data = self.sock.recv(1 << 16)
            assert data, "the server closed the connection"
            self.reader.feed(data)
        return body

    def call(self, op: str, *args, deadline: float | None = None):
        if deadline is None:
            deadline = time.monotonic() + ANSWER_S
        self.sock.sendall(codec.request(op, deadline, args))
        return codec.parse_reply(self.frame())

    def close(self) -> None:
        self.sock.close()


# ------------------------------------------------------------------ behaviour
def test_replies_and_errors(server):
    client = ChannelClient(server.path)
    assert client.call("echo", 1, ["k"], {"x": 2}) == [1, ["k"], {"x": 2}]
    with pytest.raises(ValueError, match="bad offset 7"):
        client.call("bad", 0)
    with pytest.raises(RuntimeError, match="broken failed in the node actor: KeyError"):
        client.call("broken")
    assert client.call("echo", 2, [], {}) == [2, [], {}]
    assert stat.S_IMODE(os.stat(server.path).st_mode) == 0o600
    client.close()


def test_concurrent_callers_are_served_concurrently(server):
    """Four calls that return only once all four are in the server at the same time:
    concurrent calls run on separate connections, served in parallel."""
    client = ChannelClient(server.path)
    out: list[bool] = []
    callers = [threading.Thread(target=lambda: out.append(client.call("together")))
               for _ in range(4)]
    for t in callers:
        t.start()
    for t in callers:
        t.join(ANSWER_S)
    assert out == [True] * 4
    client.close()


@pytest.mark.parametrize("async_ops", [frozenset({"later", "refuse"}), frozenset()])
def test_async_ops_reply_later_and_many_callers_are_all_answered(server, async_ops):
    """Async ops on connections of their own (served by the I/O thread) or mixed with
    data ops on one connection: every caller gets its own answer."""
    client = ChannelClient(server.path, async_ops=async_ops)
    with pytest.raises(ValueError, match="refused 3"):
        client.call("refuse", 3)
    out: dict[int, object] = {}
    callers = [threading.Thread(target=lambda i=i: out.update({i: client.call("later", i)}))
               for i in range(32)]
    for t in callers:
        t.start()
    for t in callers:
        t.join(ANSWER_S)
    assert out == {i: i for i in range(32)}
    assert client.call("echo", 3, ["after"], {}) == [3, ["after"], {}]
    client.close()


def test_a_data_op_on_an_async_connection_is_still_served(server):
    """A connection that began with an async op is read by the I/O thread; a data op
    sent on it later runs on a worker, never blocking that thread."""
    client = ChannelClient(server.path)
    assert client.call("later", 1) == 1        # this connection goes to the I/O thread
    assert client.call("echo", 2, [], {}) == [2, [], {}]  # a data op on it
    with pytest.raises(RuntimeError, match="broken failed in the node actor"):
        client.call("broken")
    assert client.call("later", 3) == 3
    client.close()


def test_a_closed_server_is_a_clear_connection_error(server):
    """The request to a server that is gone is known never to have reached it (its
    connection broke before the request was written; no connection could be made), so
    a rank may send it again on a new connection."""
    client = ChannelClient(server.path)
    assert client.call("echo", 1, [], {}) == [1, [], {}]
    server.close()
    with pytest.raises(RequestNotSentError, match="Broken pipe"):
        client.call("echo", 2, [], {})
    with pytest.raises(RequestNotSentError, match="cannot reach the node actor"):
        ChannelClient(server.path)


DYING = textwrap.dedent("""
    import os, sys
    from raykv.cache_actors.channel_codec import Signature
    from raykv.cache_actors.node.channel_server import ChannelServer
    srv = ChannelServer(sys.argv[1], {"die": lambda: os._exit(3), "ping": lambda: 1},
                        arg_types={"die": Signature(()), "ping": Signature(())})
    print("ready", flush=True)
    sys.stdin.read()
""")


def test_a_server_that_dies_after_reading_the_request_is_not_unsent(tmp_path):
    """Control for the test above: a server that took the request and died before its
    reply may have run it, so its caller sees ``ChannelClosedError`` but never
    ``RequestNotSentError`` (a rank must not send that one again)."""
    path = str(tmp_path / "n.sock")
    proc = subprocess.Popen([sys.executable, "-c", DYING, path], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        client = ChannelClient(path, timeout_s=ANSWER_S)
        assert client.call("ping") == 1
        with pytest.raises(ChannelClosedError) as caught:
            client.call("die")
        assert not isinstance(caught.value, RequestNotSentError)
        assert proc.wait(ANSWER_S) == 3
    finally:
        proc.kill()
        proc.wait()


def test_the_data_ops_types_travel_and_passthrough_errors_keep_their_class(tmp_path):
    """The node actor's own signatures: an ObjectBatch, PoolQuerys, a PoolTransferResult,
    lists of ints, and the passthrough errors (a subclass travels as itself); a handler
    of ``deadline_ops`` gets the caller's deadline."""
    seen, deadlines = [], []

    def put(batch, ticket, deadline):
        seen.append(batch)
        seen.append(ticket)
        deadlines.append(deadline)
        return [0] * len(batch)

    def get(batch, ticket):
        raise StalePoolsError("re-map")

    def exists(keys):
        if keys == ["gone"]:
            raise UnknownPoolError("no such pool")
        return [1] * len(keys)

    def group(reply, dep, version, rank, engine, keys, queries):
        seen.append((dep, version, rank, engine, keys, queries))
        reply(PoolTransferResult(2, {PoolName.MAMBA: 1}, [0, 2]), None)

    srv = ChannelServer(str(tmp_path / "n.sock"),
                        {DataOp.PUT: put, DataOp.GET: get, DataOp.EXISTS: exists},
                        arg_types=DATA_OP_ARGS, passthrough=(ValueError, NodeUnavailableError),
                        async_handlers={DataOp.GROUP_EXISTS: group},
                        deadline_ops=frozenset({DataOp.PUT}))
    client = ChannelClient(srv.path, async_ops=frozenset({DataOp.GROUP_EXISTS}), timeout_s=60)
    batch = ObjectBatch(["a", "b"], [PoolName.KV, PoolName.KV], [0, 4096], [4096, 4096], 7)
    sent = time.monotonic()
    assert client.call(DataOp.PUT, batch, ("book", 3, 9)) == [0, 0]
    assert sent + 60 <= deadlines[0] <= time.monotonic() + 60  # the caller's, to the handler
    assert seen[0] == batch and isinstance(seen[0], ObjectBatch)
    assert seen[1] == ("book", 3, 9)  # its ticket
    with pytest.raises(StalePoolsError, match="re-map"):
        client.call(DataOp.GET, batch, None)
    assert client.call(DataOp.EXISTS, ["a", "b", "c"]) == [1, 1, 1]
    with pytest.raises(UnknownPoolError, match="no such pool"):  # a ValueError: as itself
        client.call(DataOp.EXISTS, ["gone"])
    query = PoolQuery(PoolName.MAMBA, PoolHitPolicy.TRAILING_PAGES, 2)
    got = client.call(DataOp.GROUP_EXISTS, "dep", 3, (0, 1), "e1", ["a"], [query])
    assert got == PoolTransferResult(2, {PoolName.MAMBA: 1}, [0, 2])
    assert type(next(iter(got.extra_pool_hit_pages))) is PoolName
    assert seen[2] == ("dep", 3, (0, 1), "e1", ["a"], [query])
    client.close()
    srv.close()


BAD_REQUESTS = {
    "nested": ("exists", [[["k"]]]),
    "arity": ("exists", []),
    "too-many": ("exists", [["k"], ["k"]]),
    "bytes": ("exists", [[b"k"]]),
    "mixed": ("exists", [["k", 1]]),
    "long-mixed": ("exists", [["k"] * 2000 + [1]]),
    "float-offset": ("put", [[["k"], ["kv"], [0.5], [1], 0], None]),
    "bool-epoch": ("put", [[["k"], ["kv"], [0], [1], True], None]),
    "four-fields": ("put", [[["k"], ["kv"], [0], [1]], None]),
    "ticket": ("put", [[["k"], ["kv"], [0], [1], 0], ["book", 1]]),
    "rank": ("group_exists", ["d", 1, [0], "", ["k"], []]),
    "engine": ("group_exists", ["d", 1, [0, 0], 7, ["k"], []]),
    "pool-name": ("group_exists", ["d", 1, [0, 0], "", ["k"],
                                   [["no-such-pool", "all_pages", 1]]]),
    "deadline": ("exists", [["k"]], "soon"),
}


@pytest.mark.parametrize("case", BAD_REQUESTS.values(), ids=BAD_REQUESTS.keys())
def test_requests_are_checked_against_their_signature(case):
    """Pure codec: a request whose arguments do not match its op's signature
    (``DATA_OP_ARGS``) never decodes into a call."""
    op, args, deadline = (*case, 1.0)[:3]
    with pytest.raises(WireError):
        codec.parse_request(msgpack.packb([op, deadline, args]), DATA_OP_ARGS)
    good = codec.request("exists", 1.0, [["k"] * 2000])[codec.HEADER:]
    assert codec.parse_request(good, DATA_OP_ARGS) == ("exists", 1.0, [["k"] * 2000])


# ---------------------------------------------------------------- hostile peers
@pytest.mark.parametrize("claim", [0xFFFFFFFF, MAX_FRAME + 1], ids=["4GiB", "limit+1"])
def test_a_huge_frame_header_allocates_nothing_and_drops_its_connection(server, claim):
    """Eight connections each announce a frame of ``claim`` bytes: the server drops
    each at once, having allocated nothing for it (RSS of this process, which is the
    server's, grows < 100 MB), and still serves others."""
    client = ChannelClient(server.path)
    before = rss_bytes()
    peers = []
    for _ in range(8):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(server.path)
        s.sendall(struct.pack("!I", claim) + b"\x00" * 64)
        peers.append(s)
    dropped = [closed_by_peer(s, ANSWER_S) for s in peers]
    grown = rss_bytes() - before
    for s in peers:
        s.close()
    assert grown < 100 << 20, f"RSS grew {grown >> 20} MiB"
    assert dropped == [True] * 8
    assert client.call("echo", 1, [], {}) == [1, [], {}]
    client.close()


UNKNOWN_CLASS_PICKLE = b"craykv.no_such_module\nThing\n)\x81."  # protocol 0: Thing()


BAD_PAYLOADS = {
    "garbage": b"\xc1garbage that is no msgpack \x00\xff",
    "1-tuple": msgpack.packb(["later"]),
    "unknown-op": msgpack.packb(["no_such_op", 1e12, [1]]),
    "unknown-class": UNKNOWN_CLASS_PICKLE,  # a class missing here (pickle)
    "wrong-shape": msgpack.packb(["later", 1e12, ["one", "two"]]),  # arity and type
    "unhashable-op": msgpack.packb([["later"], 1e12, [1]]),
    "too-many-values": msgpack.packb(["later", 1e12, [[[]] * 60_000] * 6]),
}


@pytest.mark.parametrize("payload", BAD_PAYLOADS.values(), ids=BAD_PAYLOADS.keys())
@pytest.mark.parametrize("kind", ["async", "thread"])
def test_a_malformed_request_is_answered_with_value_error_on_the_same_connection(
        server, payload, kind):
    """A whole frame whose body is no valid request (not msgpack, ill-typed, an unknown
    op, over the decoding budget) is answered with a ``ValueError`` naming the problem on
    the same connection, which then serves the next request; both on a connection read
    by the I/O thread (``async``, beside another client's) and on one served by its own
    thread. (Before, the connection was closed: the first ``frame()`` below failed.)"""
    other = ChannelClient(server.path, async_ops=frozenset({"later"}), timeout_s=ANSWER_S)
    assert other.call("later", 1) == 1
    peer = RawPeer(server.path)
    if kind == "async":
        assert peer.call("later", 2) == (True, 2)  # its connection is now the I/O thread's
    peer.sock.sendall(codec.frame(payload))
    ok, error = codec.parse_reply(peer.frame())
    assert not ok and type(error) is ValueError, error
    assert "malformed channel request" in str(error)
    assert peer.call("later", 3) == (True, 3)
    assert peer.call("echo", 4, [], {}) == (True, [4, [], {}])
    assert [other.call("later", i) for i in range(5, 8)] == [5, 6, 7]
    peer.close()
    other.close()


def test_a_second_request_before_the_reply_drops_the_connection(server):
    """One request at a time per connection: a peer that sends more before reading is
    dropped, so a peer that does not read cannot queue work."""
    peer = RawPeer(server.path)
    assert peer.call("later", 1) == (True, 1)
    deadline = time.monotonic() + ANSWER_S
    peer.sock.sendall(codec.request("later", deadline, [2]) + codec.request("later", deadline, [3]))
    assert closed_by_peer(peer.sock, ANSWER_S)
    peer.close()


def flood(path: str) -> None:
    """500 connections that send garbage and close, 100 at a time."""
    for _ in range(5):
        socks = [socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) for _ in range(100)]
        for s in socks:
            s.connect(path)
            s.sendall(b"\x00\x00\x00\x10this is no hello")
        for s in socks:
            s.close()


def test_a_flood_of_garbage_connections_leaves_nothing_behind(server, caplog):
    """500 connections that send garbage and close: fds and threads come back to where
    they were, the garbage costs a few log lines (not 500), clients are served."""
    caplog.set_level(logging.WARNING, logger="raykv.cache_actors.node.channel_server")
    client = ChannelClient(server.path)
    assert client.call("echo", 1, [], {}) == [1, [], {}]
    base_fds, base_threads = fds(), threads()
    flood(server.path)
    assert settle(lambda: fds() <= base_fds and threads() <= base_threads),\
        f"fds {fds()} (were {base_fds}), threads {threads()} (were {base_threads})"
    assert len(caplog.records) < 20
    assert client.call("echo", 2, [], {}) == [2, [], {}]
    client.close()


def test_accepting_survives_running_out_of_fds(server, caplog):
    """After a garbage flood, a moment with no free fd (accept fails with EMFILE): the
    accept thread backs off and goes on; the connection made meanwhile and a new client
    are served; fds and threads come back to where they were."""
    caplog.set_level(logging.WARNING, logger="raykv.cache_actors.node.channel_server")
    client = ChannelClient(server.path)
    assert client.call("echo", 1, [], {}) == [1, [], {}]
    base_fds, base_threads = fds(), threads()
    flood(server.path)
    # The flood's connections first close on the server's side: one closing while the fd
    # table is full would free the fd the accept needs, and no accept would fail.
    assert settle(lambda: fds() <= base_fds), f"fds {fds()} (were {base_fds})"
    waiting = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    fillers: list[int] = []
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (fds() + 32, hard))
        with contextlib.suppress(OSError):
            while True:
                fillers.append(os.open("/dev/null", os.O_RDONLY))
        waiting.connect(server.path)   # queued: accepting it needs an fd
        waiting.sendall(codec.hello())
        settle(lambda: "out of resources" in caplog.text, ANSWER_S)  # accept hit EMFILE
    finally:
        for fd in fillers:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    waiting.settimeout(ANSWER_S)
    reader = codec.FrameReader()
    while (body := reader.next()) is None:
        reader.feed(waiting.recv(1 << 16))
    codec.check_hello(codec.decode(body), "node actor")  # accepted after the back-off
    waiting.close()
    assert "out of resources" in caplog.text  # it was accepted after an EMFILE
    fresh = ChannelClient(server.path)
    assert fresh.call("echo", 2, [], {}) == [2, [], {}]
    fresh.close()
    assert settle(lambda: fds() <= base_fds and threads() <= base_threads),\
        f"fds {fds()} (were {base_fds}), threads {threads()} (were {base_threads})"
    client.close()


def test_short_lived_caller_threads_leave_no_connections_behind(server):
    """100 threads that each make one call and exit, ten at a time: afterwards at most
    ``MAX_IDLE`` connections stay open (each holds an fd at either end)."""
    client = ChannelClient(server.path)
    base_fds = fds()
    out: list[object] = []
    for wave in range(10):
        start = threading.Barrier(10, timeout=ANSWER_S)

        def once(i: int, start=start) -> None:
            start.wait()
            out.append(client.call("echo", i, [], {}))

        callers = [threading.Thread(target=once, args=(10 * wave + i,)) for i in range(10)]
        for t in callers:
            t.start()
        for t in callers:
            t.join(ANSWER_S)
    assert sorted(r[0] for r in out) == list(range(100))
    assert settle(lambda: fds() - base_fds <= 2 * MAX_IDLE),\
        f"{fds() - base_fds} fds more than before the callers"
    client.close()


# ------------------------------------------------------------------ deadlines
def test_a_call_to_a_blocked_handler_ends_at_its_deadline(tmp_path):
    """The handler blocks: the call raises DeadlineExceededError after ~timeout_s and
    closes its connection; the late reply is never read by the next call."""
    release = threading.Event()
    calls = []

    def slow(i):
        calls.append(i)
        if i == 1:
            release.wait(ANSWER_S)
        return i

    srv = ChannelServer(str(tmp_path / "n.sock"), {"slow": slow},
                        arg_types={"slow": Signature((int,))})
    client = ChannelClient(srv.path, timeout_s=0.5)
    t = time.monotonic()
    with pytest.raises(DeadlineExceededError, match="did not answer slow within 0.5 s"):
        client.call("slow", 1)
    took = time.monotonic() - t
    assert 0.5 <= took < ANSWER_S
    release.set()
    assert client.call("slow", 2) == 2
    assert client.call("slow", 3) == 3
    client.close()
    srv.close()


SERVER = textwrap.dedent("""
    import sys
    from raykv.cache_actors.channel_codec import Signature
    from raykv.cache_actors.node.channel_server import ChannelServer
    runs = []
    srv = ChannelServer(sys.argv[1], {"record": lambda: runs.append(1) or len(runs),
                                      "runs": lambda: len(runs)},
                        arg_types={"record": Signature(()), "runs": Signature(())})
    print("ready", flush=True)
    sys.stdin.read()
""")


def test_a_request_past_its_deadline_is_not_run(tmp_path):
    """The node actor is stopped (SIGSTOP) while a call waits: the call ends at its
    deadline; once the actor runs again (SIGCONT) it reads that request but does not
    run it."""
    path = str(tmp_path / "n.sock")
    proc = subprocess.Popen([sys.executable, "-c", SERVER, path], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        client = ChannelClient(path, timeout_s=0.5)
        assert client.call("runs") == 0
        stop_process(proc.pid)  # every thread stopped, for sure
        try:
            with pytest.raises(DeadlineExceededError):
                client.call("record")
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        end = time.monotonic() + 2.0
        while time.monotonic() < end:  # time for the actor to read the stale request
            assert client.call("runs") == 0
            time.sleep(0.1)
        assert client.call("record") == 1  # a fresh one runs
        client.close()
    finally:
        proc.kill()
        proc.wait()


def test_a_server_answers_a_stale_request_with_deadline_exceeded(server):
    peer = RawPeer(server.path)
    ok, error = peer.call("echo", 1, [], {}, deadline=time.monotonic() - 1)
    assert not ok and isinstance(error, DeadlineExceededError)
    assert peer.call("echo", 2, [], {}) == (True, [2, [], {}])
    peer.close()


# ---------------------------------------------------------------- who may talk
def test_a_peer_of_another_version_gets_both_versions_named(server):
    """A rank of another wire: the server answers its own hello and closes; a client
    meeting a node actor of another wire raises ChannelVersionError naming both."""
    peer = RawPeer(server.path, greet=False)
    peer.sock.sendall(codec.encode([codec.MAGIC, codec.PROTOCOL + 1, "9.9.9"]))
    assert codec.decode(peer.frame()) == [codec.MAGIC, codec.PROTOCOL, codec.RAYKV_VERSION]
    assert closed_by_peer(peer.sock, ANSWER_S)
    peer.close()

    fake = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    fake_path = server.path + ".fake"
    fake.bind(fake_path)
    fake.listen(1)

    def answer() -> None:
        conn, _ = fake.accept()
        conn.recv(1 << 16)
        conn.sendall(codec.encode([codec.MAGIC, codec.PROTOCOL + 1, "9.9.9"]))
        conn.close()

    threading.Thread(target=answer, daemon=True).start()
    with pytest.raises(ChannelVersionError, match=r"node actor runs raykv 9\.9\.9.*this "
                                                  rf"process raykv {codec.RAYKV_VERSION}"):
        ChannelClient(fake_path)
    fake.close()


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to connect as another uid")
def test_a_peer_of_another_uid_is_refused(tmp_path):
    """Even with the socket file opened up to everyone, a process of another uid is
    closed at once (SO_PEERCRED)."""
    folder = tempfile.mkdtemp()
    os.chmod(folder, 0o755)
    srv = ChannelServer(os.path.join(folder, "n.sock"), {"echo": lambda: 1},
                        arg_types={"echo": Signature(())})
    os.chmod(srv.path, 0o666)
    probe = textwrap.dedent(f"""
        import socket
        s = socket.socket(socket.AF_UNIX)
        s.connect({srv.path!r})
        s.settimeout({ANSWER_S!r})
        try:
            s.sendall({codec.hello()!r})
            print(repr(s.recv(100)))
        except (ConnectionResetError, BrokenPipeError):
            print(repr(b""))
    """)
    out = subprocess.run(["/usr/bin/python3", "-c", probe], user=65534, capture_output=True,
                         text=True, timeout=60)
    assert out.stdout.strip() == "b''", out
    client = ChannelClient(srv.path)  # its own uid: served
    assert client.call("echo") == 1
    client.close()
    srv.close()
    os.rmdir(folder)


def test_a_peer_that_never_says_hello_is_closed(server, monkeypatch):
    """A connection that sends nothing would hold a connection slot and a thread: it is
    closed ``HELLO_TIMEOUT_S`` after it was accepted; one that said hello may stay idle."""
    monkeypatch.setattr(channel_server, "HELLO_TIMEOUT_S", 0.5)
    silent = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    silent.connect(server.path)
    peer = RawPeer(server.path)
    assert closed_by_peer(silent, ANSWER_S)
    time.sleep(1.0)  # well past the hello timeout
    assert peer.call("echo", 1, [], {}) == (True, [1, [], {}])
    silent.close()
    peer.close()


def test_connections_over_the_limit_are_closed_at_once(tmp_path):
    srv = ChannelServer(str(tmp_path / "n.sock"), {"echo": lambda: 1},
                        arg_types={"echo": Signature(())}, max_connections=4)
    clients = [ChannelClient(srv.path) for _ in range(4)]
    extra = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    extra.connect(srv.path)
    assert closed_by_peer(extra, ANSWER_S)
    extra.close()
    clients.pop().close()
    assert settle(lambda: _served(srv.path))
    for c in clients:
        assert c.call("echo") == 1
        c.close()
    srv.close()


def _served(path: str) -> bool:
    try:
        c = ChannelClient(path, timeout_s=1.0)
    except (ChannelClosedError, DeadlineExceededError):
        return False
    ok = c.call("echo") == 1
    c.close()
    return ok


def test_a_connection_is_served_as_the_owner_it_claimed(tmp_path):
    """With ``bind``, every connection's first request may claim an owner: handlers and
    async handlers are given that connection's caller. A refused claim is the caller's
    ``ValueError`` and ends that connection; a claim after the first request drops it.
    Control: a connection that claims nothing is served as a caller without one."""
    from raykv.controllers.ownership import OwnerClaim

    def bind(claim: OwnerClaim) -> OwnerClaim:
        if claim.deployment_id == "intruder":
            raise ValueError("claim refused: another proof")
        return claim

    def whoami(claim=None):
        return None if claim is None else claim.deployment_id

    def group(reply, claim=None):
        reply(None if claim is None else claim.tenant, None)

    srv = ChannelServer(str(tmp_path / "n.sock"), {"whoami": whoami},
                        arg_types={"whoami": Signature(()), "group": Signature(())},
                        async_handlers={"group": group}, bind=bind)
    try:
        claim = OwnerClaim("dep-a", "team-a", "0" * 64, "a_")
        owned = ChannelClient(srv.path, async_ops=frozenset({"group"}), bind=claim)
        assert owned.call("whoami") == "dep-a" and owned.call("group") == "team-a"
        assert ChannelClient(srv.path).call("whoami") is None  # control: no claim
        with pytest.raises(ValueError, match="claim refused"):
            ChannelClient(srv.path, bind=OwnerClaim("intruder"))
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(srv.path)
        sock.sendall(codec.hello())
        sock.sendall(codec.request("whoami", time.monotonic() + ANSWER_S, []))
        sock.sendall(codec.request(codec.BIND_OP, time.monotonic() + ANSWER_S, [claim]))
        assert closed_by_peer(sock, ANSWER_S)  # a claim after the first request
        sock.close()
        assert owned.call("whoami") == "dep-a"  # others are served on
    finally:
        srv.close()
