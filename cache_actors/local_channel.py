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

Serving: one I/O thread waits on every connection at once (``selectors``) and reads
whatever requests are ready, so a burst of requests from many ranks costs one wake-up,
not one thread switch each. An op that may block (a store call) runs on a worker pool;
an *async* op is started in the I/O thread itself and given a ``reply(value, error)``
callable that it calls later, once, from any thread (group hits: the query joins a
batch and its answer is sent by whichever thread completes the batch). A client sends
one request at a time per connection, so replies never interleave.
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


Reply = Callable[[object, BaseException | None], None]


class _Conn:
    """One accepted connection: bytes read but not yet parsed, and a send lock."""

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
    docstring): ``handlers[op](*args)`` on a pool of up to ``workers`` threads, and
    ``async_handlers[op](reply, *args)`` in the I/O thread (it must not block; it calls
    ``reply(value, None)`` or ``reply(None, error)`` exactly once, now or later). A
    handler's exception of a ``passthrough`` type goes back to the caller as itself;
    any other is logged and reported as a ``RuntimeError``; the server keeps serving in
    every case."""

    def __init__(self, path: str, handlers: dict[str, Callable],
                 passthrough: tuple[type[BaseException], ...] = (ValueError,),
                 async_handlers: dict[str, Callable[..., None]] | None = None,
                 workers: int = 16) -> None:
        self.path = path
        self._handlers = handlers
        self._async = async_handlers or {}
        self._passthrough = passthrough
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="raykv-channel-op")
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
        self._wake_r, self._wake_w = socket.socketpair()
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._sock, selectors.EVENT_READ)
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        threading.Thread(target=self._loop, name="raykv-channel", daemon=True).start()

    def _loop(self) -> None:
        try:
            while not self._closed:
                for key, _ in self._selector.select():
                    if key.fileobj is self._sock:
                        self._accept()
                    elif key.data is not None:
                        self._read(key.data)
        except (OSError, ValueError):  # closed under us
            if not self._closed:
                log.exception("channel I/O loop stopped")
        finally:
            self._selector.close()

    def _accept(self) -> None:
        conn, _ = self._sock.accept()
        self._conns.add(conn)
        self._selector.register(conn, selectors.EVENT_READ, _Conn(conn))

    def _read(self, conn: _Conn) -> None:
        try:
            data = conn.sock.recv(1 << 16)
        except OSError:
            data = b""
        if not data:  # the rank closed its end (or died)
            self._selector.unregister(conn.sock)
            self._conns.discard(conn.sock)
            conn.sock.close()
            return
        conn.buf += data
        for op, args in conn.messages():
            self._dispatch(conn, op, args)

    def _dispatch(self, conn: _Conn, op: str, args: tuple) -> None:
        done = threading.Lock()  # a reply is sent once

        def reply(value: object, error: BaseException | None = None) -> None:
            if not done.acquire(blocking=False):
                return
            self._send(conn, (True, value) if error is None else (False, self._error(op, error)))

        start = self._async.get(op)
        if start is not None:
            try:
                start(reply, *args)
            except Exception as e:  # refused at once (bad input): reported to the caller
                reply(None, e)
            return
        self._pool.submit(self._run, op, args, reply)

    def _run(self, op: str, args: tuple, reply: Reply) -> None:
        try:
            handler = self._handlers[op]
            value = handler(*args)
        except Exception as e:  # reported to the caller; the server keeps going
            reply(None, e)
            return
        reply(value, None)

    def _error(self, op: str, error: BaseException) -> BaseException:
        if isinstance(error, self._passthrough):
            return error
        log.error("channel op %s failed", op, exc_info=error)
        return RuntimeError(f"{op} failed in the node actor: {type(error).__name__}: {error}")

    def _send(self, conn: _Conn, reply: tuple) -> None:
        with conn.send_lock, contextlib.suppress(OSError):  # a dead rank: nobody to tell
            _send(conn.sock, reply)

    def close(self) -> None:
        """Stop serving, drop every connection and remove the socket file."""
        self._closed = True
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        for s in (self._sock, *list(self._conns)):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()
        self._wake_w.close()
        self._pool.shutdown(wait=False, cancel_futures=True)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


class ChannelClient:
    """The rank's end: ``call(op, *args)`` blocks for the reply. Thread-safe: each
    calling thread gets its own connection, so concurrent callers do not queue behind
    one another. Raises ``ChannelClosedError`` when the actor is unreachable."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._local = threading.local()
        self._all: list[socket.socket] = []
        self._lock = threading.Lock()
        self._conn()  # fail now, not at the first data call, if nobody listens

    def _conn(self) -> socket.socket:
        sock = getattr(self._local, "sock", None)
        if sock is None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.connect(self.path)
            except OSError as e:
                sock.close()
                raise ChannelClosedError(f"cannot reach the node actor at {self.path}: "
                                         f"{e}") from e
            self._local.sock = sock
            with self._lock:
                self._all.append(sock)
        return sock

    def call(self, op: str, *args):
        sock = self._conn()
        try:
            _send(sock, (op, args))
            ok, value = _recv(sock)
        except OSError as e:
            self._local.sock = None
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
