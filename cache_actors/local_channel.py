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
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import socket
import struct
import threading
from collections.abc import Callable

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


class ChannelServer:
    """Serves ``handlers[op](*args)`` on a Unix socket at ``path``, one thread per
    connection, until ``close``. A handler's exception of a ``passthrough`` type goes
    back to the caller as itself; any other is logged and reported as a
    ``RuntimeError``; the server keeps serving in every case."""

    def __init__(self, path: str, handlers: dict[str, Callable],
                 passthrough: tuple[type[BaseException], ...] = (ValueError,)) -> None:
        self.path = path
        self._handlers = handlers
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
        threading.Thread(target=self._accept, name="raykv-channel", daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            self._conns.add(conn)
            threading.Thread(target=self._serve, args=(conn,), name="raykv-channel-conn",
                             daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            while True:
                try:
                    op, args = _recv(conn)
                except (ChannelClosedError, OSError):
                    break
                try:
                    reply = (True, self._handlers[op](*args))
                except self._passthrough as e:
                    reply = (False, e)
                except Exception as e:  # reported to the caller; the server keeps going
                    log.exception("channel op %s failed", op)
                    reply = (False, RuntimeError(f"{op} failed in the node actor: "
                                                 f"{type(e).__name__}: {e}"))
                try:
                    _send(conn, reply)
                except OSError:
                    break
        self._conns.discard(conn)

    def close(self) -> None:
        """Stop accepting, drop every connection and remove the socket file."""
        self._closed = True
        for s in (self._sock, *list(self._conns)):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()
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
