"""The local channel's server, run by the node actor: ``ChannelServer`` (what the channel
is and whom it trusts: ``cache_actors.channel_socket``; its wire: ``channel_codec``).

Owners. A server given ``bind`` serves each connection as the owner it claimed: a
connection whose first request is ``BIND_OP`` with an ``OwnerClaim`` is bound to what
``bind(claim)`` returns (the node actor checks the claim; a refused claim is answered
with its error and the connection closed); a connection that sends no claim is served
as a caller without one (None). Every handler is then given its connection's
``claim=`` (the checked claim, or None). A second ``BIND_OP`` on a connection is a
malformed request.

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
sends its replies); a data op sent on such a connection runs on one of
``POOL_THREADS`` pool threads. A request whose deadline has passed when it would start
(the actor was stopped or overloaded) is not run: it is answered with
``DeadlineExceededError``, which its caller has stopped waiting for. Handlers of
``deadline_ops`` (put, get) are handed the deadline, to stop waiting in the node actor
when it passes.

Limits and threads. At most ``max_connections`` (``MAX_CONNECTIONS``) connections; a
new one over it is closed at once. Their partial frames draw on one budget
(``channel_codec.BufferBudget``, ``max_buffered`` bytes beyond ``FREE_BUFFERED`` each):
a connection that would buffer more than is left is dropped. Threads: one accept
thread, one I/O thread (``channel_io.ChannelIO``), one per data connection (so at most
``max_connections``), ``POOL_THREADS``. Every connection's socket is closed and its
thread ends when its peer goes or misbehaves. The accept thread survives every error
(out of file descriptors, buffers or memory: it backs off from ``ACCEPT_PAUSE_S`` to
``ACCEPT_PAUSE_MAX_S`` and goes on); only ``close`` ends it.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor

from raykv.cache_actors.channel_codec import (
    BIND_OP,
    MAX_BUFFERED,
    BufferBudget,
    ChannelVersionError,
    FrameReader,
    Signature,
    WireError,
    check_hello,
    decode,
    error_name,
    error_reply,
    hello,
    parse_request,
    reply,
)
from raykv.cache_actors.channel_socket import ChannelClosedError, peer_uid, timeval
from raykv.cache_actors.errors import DeadlineExceededError
from raykv.cache_actors.node.channel_io import ChannelIO, Conn
from raykv.cache_actors.throttled_log import ThrottledLog
from raykv.controllers.ownership import OwnerClaim

log = logging.getLogger(__name__)

MAX_CONNECTIONS = 1024
"""Connections a server holds at most; one more is closed as soon as it is accepted."""
POOL_THREADS = 4
"""Threads that run data ops sent on async connections."""
SEND_TIMEOUT_S = 2.0
"""A reply that cannot be written for this long (the peer does not read) ends its
connection. An honest peer is reading: it waits for that one reply."""
HELLO_TIMEOUT_S = 10.0
"""A connection that has not sent its hello this long after it was accepted is closed
(it would hold a connection and a thread for nothing)."""
ACCEPT_PAUSE_S, ACCEPT_PAUSE_MAX_S = 0.1, 1.0
_WARN_EVERY_S = 10.0


def _recv_frame(sock: socket.socket, reader: FrameReader) -> bytes | memoryview:
    """The next frame's body from a blocking ``sock``; ``ChannelClosedError`` at EOF,
    ``WireError`` for a header over ``MAX_FRAME``."""
    while (body := reader.next()) is None:
        data = sock.recv(reader.want())
        if not data:
            raise ChannelClosedError("the peer closed the channel")
        reader.feed(data)
    return body


class ChannelServer:
    """Serves requests on a Unix socket at ``path`` until ``close`` (see the module
    docstring): ``handlers[op](*args)`` in the connection's thread, and
    ``async_handlers[op](reply, *args)``, which must not block and calls
    ``reply(value, None)`` or ``reply(None, error)`` exactly once, now or later.
    ``arg_types[op]`` gives every op's argument types; a request that does not match
    them never reaches a handler. The handlers of ``deadline_ops`` are also given the
    caller's deadline, ``deadline=`` (``time.monotonic()`` seconds). With ``bind``
    (``bind(claim) -> checked claim``, raising to refuse), connections may claim an owner and
    every handler is given ``claim=`` (see the module docstring). A handler's
    exception of a ``passthrough`` type goes back to the caller as itself; any other is
    logged and reported as a ``RuntimeError``; the server keeps serving in every case."""

    def __init__(self, path: str, handlers: Mapping[str, Callable], *,
                 arg_types: Mapping[str, Signature],
                 passthrough: tuple[type[BaseException], ...] = (ValueError,),
                 async_handlers: Mapping[str, Callable[..., None]] | None = None,
                 deadline_ops: frozenset[str] = frozenset(),
                 max_connections: int = MAX_CONNECTIONS,
                 max_buffered: int = MAX_BUFFERED,
                 bind: Callable[[OwnerClaim], object] | None = None) -> None:
        self.path = path
        self._handlers = dict(handlers)
        self._async = dict(async_handlers or {})
        missing = {*self._handlers, *self._async} - set(arg_types)
        if missing:
            raise ValueError(f"no argument types for channel ops {sorted(missing)}")
        self._signatures = {op: arg_types[op] for op in {*self._handlers, *self._async}}
        self._bind = bind
        if bind is not None:
            self._signatures[BIND_OP] = Signature((OwnerClaim,))
        self._passthrough = (*passthrough, DeadlineExceededError)
        self._deadline_ops = deadline_ops
        self._max_connections = max_connections
        self._uid = os.getuid()
        self._warn = ThrottledLog(log, _WARN_EVERY_S)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # left by a previous incarnation of the actor
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)
        try:
            self._sock.bind(path)
        finally:
            os.umask(old)
        self._sock.listen(socket.SOMAXCONN)
        self._stop = threading.Event()
        self._conns: set[Conn] = set()
        self._buffered = BufferBudget(max_buffered)  # every connection's, together
        self._conns_lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None  # data ops sent on an async conn
        self._io = ChannelIO(path, self._process, self._drop, self._warn,
                             send_timeout_s=SEND_TIMEOUT_S)
        threading.Thread(target=self._accept, name="raykv-channel", daemon=True).start()

    @property
    def buffered(self) -> int:
        """Bytes its connections buffer now beyond ``FREE_BUFFERED`` each (at most
        ``max_buffered``)."""
        return self._buffered.used

    # ------------------------------------------------------------- accepting
    def _accept(self) -> None:
        """The accept thread: admit connections until ``close``, whatever fails."""
        pause = 0.0
        while not self._stop.is_set():
            try:
                sock, _ = self._sock.accept()
            except OSError as e:
                if self._stop.is_set():
                    return
                pause = min(ACCEPT_PAUSE_MAX_S, pause * 2 or ACCEPT_PAUSE_S)
                resource = e.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS,
                                       errno.ENOMEM)
                self._warn.warn("accept", "channel %s: accept failed (%s%s); retrying in "
                                "%.1f s", self.path, e, ", out of resources" if resource else "",
                                pause)
                self._stop.wait(pause)
                continue
            pause = 0.0
            try:
                self._admit(sock)
            except Exception as e:  # one connection's failure, never the accept thread's
                self._warn.warn("admit", "channel %s: could not take a connection: %s",
                                self.path, e)
                sock.close()

    def _admit(self, sock: socket.socket) -> None:
        uid = peer_uid(sock)
        if uid != self._uid:
            self._warn.warn("uid", "channel %s: refused a peer of uid %d (serving uid %d only)",
                            self.path, uid, self._uid)
            sock.close()
            return
        conn = Conn(sock, self._buffered)
        with self._conns_lock:
            full = len(self._conns) >= self._max_connections
            if not full:
                self._conns.add(conn)
        if full:
            self._warn.warn("full", "channel %s: %d connections open, refused one more",
                            self.path, self._max_connections)
            sock.close()
            return
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval(SEND_TIMEOUT_S))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval(HELLO_TIMEOUT_S))
        try:
            threading.Thread(target=self._serve, args=(conn,), name="raykv-channel-conn",
                             daemon=True).start()
        except BaseException:
            self._drop(conn)
            raise

    # ------------------------------------------------------ connection threads
    def _serve(self, conn: Conn) -> None:
        """A connection's own thread: the hello, then requests until the connection
        closes or its first request is async (then the I/O thread reads it)."""
        adopted = False
        try:
            check_hello(decode(_recv_frame(conn.sock, conn.reader)), "rank")
            conn.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval(0))
            conn.send(hello())
            first, claimable = True, True
            while not conn.dead:
                parsed = self._parse(conn, _recv_frame(conn.sock, conn.reader))
                if parsed is None:
                    continue
                op, deadline, args = parsed
                if op == BIND_OP:
                    if not claimable:
                        raise WireError("an owner claim after the connection's first request")
                    if not self._claim(conn, args[0]):
                        return
                    claimable = False
                    continue
                claimable = False
                conn.busy = True
                if first and op in self._async:
                    conn.io = self._io  # its reply may come once the I/O thread reads it
                    self._dispatch(conn, op, deadline, args)
                    self._io.adopt(conn)
                    adopted = True
                    return
                self._dispatch(conn, op, deadline, args)
                first = False
        except ChannelVersionError as e:
            conn.send(hello())  # the rank then names both versions too
            self._warn.warn("version", "channel %s: %s", self.path, e)
        except (ChannelClosedError, OSError):
            pass  # the peer went
        except WireError as e:
            self._warn.warn("bad", "channel %s: dropped a connection: %s", self.path, e)
        except Exception:
            log.exception("channel %s: connection failed", self.path)
        finally:
            if not adopted:
                self._drop(conn)

    def _claim(self, conn: Conn, claim: OwnerClaim) -> bool:
        """Bind ``conn`` to ``claim`` and answer; False (answered with the error) if
        ``bind`` refused it: the caller then closes the connection."""
        try:
            conn.claim = self._bind(claim)
        except Exception as e:  # refused: the rank sees why, the connection ends
            conn.send(self._encode(BIND_OP, None, e))
            return False
        conn.send(reply(None))
        return True

    def _drop(self, conn: Conn) -> None:
        with self._conns_lock:
            self._conns.discard(conn)
        conn.close()

    # ------------------------------------------------------------ I/O thread
    def _process(self, conn: Conn) -> None:
        """The I/O thread's: start every whole request buffered on ``conn``;
        ``WireError`` (the connection is dropped) if one comes before the reply to the
        previous one was written whole."""
        while (body := conn.reader.next()) is not None:
            if conn.busy or conn.sending:
                raise WireError("a request sent before the reply to the previous one")
            parsed = self._parse(conn, body)
            if parsed is None:
                continue
            op, deadline, args = parsed
            if op == BIND_OP:  # only ever a connection's first request (its own thread)
                raise WireError("an owner claim after the connection's first request")
            conn.busy = True
            if op in self._async:
                self._dispatch(conn, op, deadline, args)
                continue
            if self._pool is None:  # a data op here: never block the I/O thread
                self._pool = ThreadPoolExecutor(POOL_THREADS,
                                                thread_name_prefix="raykv-channel-op")
            self._pool.submit(self._dispatch, conn, op, deadline, args)

    # -------------------------------------------------------------- requests
    def _parse(self, conn: Conn, body: bytes | memoryview) -> tuple[str, float, list] | None:
        """The request in ``body``; None if it is malformed (not msgpack, ill-typed, an
        unknown op): that is answered with a ``ValueError`` on ``conn``, which serves on
        (the frame was whole, so the next one is found)."""
        try:
            return parse_request(body, self._signatures)
        except WireError as e:
            self._warn.warn("malformed", "channel %s: answered a malformed request: %s",
                            self.path, e)
            conn.send(error_reply("ValueError", f"a malformed channel request: {e}"))
            return None

    def _dispatch(self, conn: Conn, op: str, deadline: float, args: tuple) -> None:
        done = threading.Lock()  # a reply is sent once

        def respond(value: object, error: BaseException | None = None) -> None:
            if not done.acquire(blocking=False):
                return
            conn.busy = False  # before the send: the next request follows the reply
            conn.send(self._encode(op, value, error))

        if time.monotonic() > deadline:
            respond(None, DeadlineExceededError(
                f"{op} reached the node actor after its deadline; it was not run"))
            return
        start = self._async.get(op)
        kw = {} if self._bind is None else {"claim": conn.claim}
        try:
            if start is not None:
                start(respond, *args, **kw)
            elif op in self._deadline_ops:
                respond(self._handlers[op](*args, deadline=deadline, **kw))
            else:
                respond(self._handlers[op](*args, **kw))
        except Exception as e:  # reported to the caller; the server keeps going
            respond(None, e)

    def _encode(self, op: str, value: object, error: BaseException | None) -> bytes:
        if error is None:
            try:
                return reply(value)
            except (TypeError, ValueError, OverflowError) as e:
                error = e
        name = error_name(error) if isinstance(error, self._passthrough) else None
        if name is not None:
            return error_reply(name, str(error))
        log.error("channel op %s failed", op, exc_info=error)
        return error_reply("RuntimeError", f"{op} failed in the node actor: "
                                           f"{type(error).__name__}: {error}")

    def close(self) -> None:
        """Stop serving, drop every connection and remove the socket file."""
        self._stop.set()
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes the accept thread
        self._sock.close()
        self._io.close()
        with self._conns_lock:
            conns = list(self._conns)
        for conn in conns:
            conn.shutdown()  # each one's reader drops it
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

