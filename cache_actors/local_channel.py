"""A same-node request channel between ranks and their node actor (a Unix socket).

A Ray actor call costs ~1 ms on these machines, more than a small Mooncake batch. Ranks
on the node of their cache actor therefore send data calls (exists, put, get, group
hits) over a Unix stream socket that the actor serves from its own threads; Ray still
creates, finds, supervises and restarts the actor, and remote callers still use Ray.
Like a Ray call, a request carries keys, offsets and results only, never page bytes.

Wire format: each message is a 4-byte big-endian length and a pickle. A request is
``(op, args)``; a reply is ``(True, value)`` or ``(False, error)``: an exception of one
of the server's ``passthrough`` types travels as itself and is raised again on the
caller's side; any other becomes a ``RuntimeError`` naming it. The socket file is mode
0600 in ``/dev/shm``: only processes of the same user, which could map the pools
anyway, can connect (pickle trusts its peer).

Serving, two kinds of connection. A connection starts with its own thread, which reads
each request and runs the handler itself: no thread switch lies between a request and
its handler, and requests on different connections run in parallel (data ops: exists,
put, get). A connection whose first request is an *async* op (group hits) is handed to
one I/O thread that waits on all such connections at once (``selectors``) and starts
each async op there: a burst of queries from many ranks costs one wake-up, not one per
query, and no thread per caller waits (measured here: twice the hit queries/s of a
thread per connection, while a selector in front of data ops doubled their round
trip). An async op is given a ``reply(value, error)`` callable that it calls later,
once, from any thread (a group query joins a batch; the thread that completes the batch
sends its replies). ``ChannelClient`` keeps one connection of each kind per thread. A
client sends one request at a time per connection, so replies never interleave.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import selectors
import socket
import struct
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from raykv.cache_actors.errors import DeadlineExceededError

log = logging.getLogger(__name__)

_LEN = struct.Struct("!I")


class ChannelClosedError(ConnectionError):
    """The actor's end of the channel is gone (actor dead or restarting)."""


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ChannelClosedError("the node actor closed the channel")
        got += k
    return bytes(buf)


def _send(sock: socket.socket, obj) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    sock.sendall(_LEN.pack(len(data)) + data)


def _recv(sock: socket.socket):
    (n,) = _LEN.unpack(_recv_exact(sock, _LEN.size))
    return pickle.loads(_recv_exact(sock, n))


class _Conn:
    """One accepted connection: bytes read but not yet parsed (I/O thread only) and the
    lock that keeps replies from different threads whole."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = bytearray()
        self.send_lock = threading.Lock()

    def messages(self) -> list:
        """Every complete request in the buffer, removed from it."""
        out = []
        while len(self.buf) >= _LEN.size:
            (n,) = _LEN.unpack_from(self.buf)
            if len(self.buf) < _LEN.size + n:
                break
            out.append(pickle.loads(self.buf[_LEN.size:_LEN.size + n]))
            del self.buf[:_LEN.size + n]
        return out


class ChannelServer:
    """Serves requests on a Unix socket at ``path`` until ``close`` (see the module
    docstring): ``handlers[op](*args)`` in the connection's thread, and
    ``async_handlers[op](reply, *args)``, which must not block and calls
    ``reply(value, None)`` or ``reply(None, error)`` exactly once, now or later. A
    handler's exception of a ``passthrough`` type goes back to the caller as itself;
    any other is logged and reported as a ``RuntimeError``; the server keeps serving in
    every case."""

    def __init__(self, path: str, handlers: dict[str, Callable],
                 passthrough: tuple[type[BaseException], ...] = (ValueError,),
                 async_handlers: dict[str, Callable[..., None]] | None = None) -> None:
        self.path = path
        self._handlers = handlers
        self._async = async_handlers or {}
        self._passthrough = passthrough
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # left by a previous incarnation of the actor
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)
        try:
            self._sock.bind(path)
        finally:
            os.umask(old)
        self._sock.listen(64)
        self._closed = False
        self._conns: set[socket.socket] = set()
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        self._adopted: list[_Conn] = []  # handed over, not yet registered by the loop
        self._adopt_lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None  # data ops sent on an async conn
        threading.Thread(target=self._accept, name="raykv-channel", daemon=True).start()
        threading.Thread(target=self._loop, name="raykv-channel-io", daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            self._conns.add(conn)
            threading.Thread(target=self._serve, args=(conn,), name="raykv-channel-conn",
                             daemon=True).start()

    def _serve(self, sock: socket.socket) -> None:
        """A connection's own thread, until it closes or its first request is async."""
        conn = _Conn(sock)
        first = True
        while True:
            try:
                op, args = _recv(sock)
            except (ChannelClosedError, OSError):
                break
            self._dispatch(conn, op, args)
            if first and op in self._async:  # from now on the I/O thread reads it
                with self._adopt_lock:
                    self._adopted.append(conn)
                with contextlib.suppress(OSError):
                    self._wake_w.send(b"a")
                return
            first = False
        self._drop(conn)

    def _loop(self) -> None:
        """The I/O thread: read every adopted connection, start async ops here."""
        try:
            while not self._closed:
                for key, _ in self._selector.select():
                    if key.fileobj is self._wake_r:
                        self._wake_r.recv(4096)
                        with self._adopt_lock:
                            adopted, self._adopted = self._adopted, []
                        for conn in adopted:
                            self._selector.register(conn.sock, selectors.EVENT_READ, conn)
                    else:
                        self._read(key.data)
        except (OSError, ValueError):  # closed under us
            if not self._closed:
                log.exception("channel I/O thread stopped")

    def _read(self, conn: _Conn) -> None:
        try:
            data = conn.sock.recv(1 << 16)
        except OSError:
            data = b""
        if not data:  # the rank closed its end (or died)
            self._selector.unregister(conn.sock)
            self._drop(conn)
            return
        conn.buf += data
        for op, args in conn.messages():
            if op in self._async:
                self._dispatch(conn, op, args)
            else:  # a data op on this connection: never block the I/O thread
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(4, thread_name_prefix="raykv-channel-op")
                self._pool.submit(self._dispatch, conn, op, args)

    def _drop(self, conn: _Conn) -> None:
        self._conns.discard(conn.sock)
        conn.sock.close()

    def _dispatch(self, conn: _Conn, op: str, args: tuple) -> None:
        done = threading.Lock()  # a reply is sent once

        def reply(value: object, error: BaseException | None = None) -> None:
            if not done.acquire(blocking=False):
                return
            message = (True, value) if error is None else (False, self._error(op, error))
            with conn.send_lock, contextlib.suppress(OSError):  # a dead rank: nobody to tell
                _send(conn.sock, message)

        start = self._async.get(op)
        try:
            if start is not None:
                start(reply, *args)
            else:
                reply(self._handlers[op](*args))
        except Exception as e:  # reported to the caller; the server keeps going
            reply(None, e)

    def _error(self, op: str, error: BaseException) -> BaseException:
        if isinstance(error, self._passthrough):
            return error
        log.error("channel op %s failed", op, exc_info=error)
        return RuntimeError(f"{op} failed in the node actor: {type(error).__name__}: {error}")

    def close(self) -> None:
        """Stop serving, drop every connection and remove the socket file."""
        self._closed = True
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        for s in (self._sock, *list(self._conns)):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


class ChannelClient:
    """The rank's end: ``call(op, *args)`` blocks for the reply. Thread-safe: each
    calling thread gets its own connections, so concurrent callers do not queue behind
    one another; ops in ``async_ops`` go on a second connection of their own (see the
    module docstring). Raises ``ChannelClosedError`` when the actor is unreachable."""

    def __init__(self, path: str, async_ops: frozenset[str] = frozenset(),
                 timeout_s: float = 5.0) -> None:
        self.path = path
        self._timeout_s = timeout_s
        self._async_ops = async_ops
        self._local = threading.local()
        self._all: list[socket.socket] = []
        self._lock = threading.Lock()
        self._conn(False)  # fail now, not at the first data call, if nobody listens

    def _conn(self, kind: bool) -> socket.socket:
        socks = getattr(self._local, "socks", None)
        if socks is None:
            socks = self._local.socks = {}
        sock = socks.get(kind)
        if sock is None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(self._timeout_s)
            try:
                sock.connect(self.path)
            except OSError as e:
                sock.close()
                raise ChannelClosedError(f"cannot reach the node actor at {self.path}: "
                                         f"{e}") from e
            socks[kind] = sock
            with self._lock:
                self._all.append(sock)
        return sock

    def call(self, op: str, *args):
        kind = op in self._async_ops
        sock = self._conn(kind)
        try:
            _send(sock, (op, args))
            ok, value = _recv(sock)
        except TimeoutError as e:
            del self._local.socks[kind]
            sock.close()
            raise DeadlineExceededError(f"the node actor did not answer {op} within "
                                        f"{self._timeout_s:g} s") from e
        except OSError as e:
            del self._local.socks[kind]
            sock.close()
            raise ChannelClosedError(f"channel to the node actor broke during {op}: "
                                     f"{e}") from e
        if ok:
            return value
        raise value

    def close(self) -> None:
        with self._lock:
            for s in self._all:
                s.close()
            self._all.clear()
        self._local = threading.local()
