"""The local channel's connections, and the one I/O thread that serves the async ones.

``Conn`` is one accepted connection: its socket, its bytes not yet parsed, whether a
request awaits its reply, and a reply not yet written. A reply is written without
waiting (``MSG_DONTWAIT``); what the socket does not take at once is finished by the
connection's own thread while it serves the connection (it waits only for its own
peer, ``SO_SNDTIMEO`` at most), and by the I/O thread once the I/O thread serves it
(``ChannelIO``). So no thread that serves other peers ever waits on one peer's send: a
peer that does not read its replies stalls nobody else's group queries or data ops.

``ChannelIO`` is that I/O thread: it waits on every connection handed to it at once
(``selectors``), reads what arrives and hands each connection with bytes to the server's
``process``; it writes pending replies as their sockets take them, and drops a
connection whose reply stays unwritten ``send_timeout_s`` after it was queued (the peer
does not read). A pending reply is at most one reply: a request that arrives before the
previous reply was written whole is a peer sending without reading (an honest rank reads
the whole reply first), which ``process`` refuses (``Conn.sending``).
"""

from __future__ import annotations

import contextlib
import logging
import selectors
import socket
import threading
import time
from collections.abc import Callable

from raykv.cache_actors.channel_codec import BufferBudget, FrameReader, WireError
from raykv.cache_actors.throttled_log import ThrottledLog

log = logging.getLogger(__name__)

_PAUSE_S = 0.1  # after a failed select: never spin on it


class Conn:
    """One accepted connection (see the module docstring), its reader drawing on the
    server's ``budget`` (``channel_codec.BufferBudget``). Its reader is used by one
    thread at a time (its own, then the I/O thread's); ``send`` by any thread."""

    def __init__(self, sock: socket.socket, budget: BufferBudget | None = None) -> None:
        self.sock = sock
        self.reader = FrameReader(budget)  # given back in ``close``
        self.send_lock = threading.Lock()
        self.busy = False
        self.dead = False
        self.claim: object = None  # what the server's ``bind`` made of its claim (checked)
        self.io: ChannelIO | None = None  # set before the I/O thread may send on it
        self._out: memoryview | None = None  # a reply's bytes the socket has not taken

    @property
    def sending(self) -> bool:
        """Whether a reply is not yet written whole."""
        return self._out is not None

    def send(self, data: bytes) -> None:
        """Write one reply without waiting for the peer; the rest (if the socket takes
        only part) is written by this connection's own thread (``self.io`` None: it
        waits, at most the socket's ``SO_SNDTIMEO``) or later by the I/O thread. On
        failure shut the connection, which its reader then drops."""
        with self.send_lock:
            if self.dead:
                return
            try:
                sent = self.sock.send(data, socket.MSG_DONTWAIT)
            except BlockingIOError:
                sent = 0
            except OSError:
                self.shutdown()
                return
            if sent == len(data):
                return
            rest = memoryview(data)[sent:]
            if self.io is None:
                try:
                    self.sock.sendall(rest)
                except OSError:  # its peer does not read: SO_SNDTIMEO ran out
                    self.shutdown()
                return
            self._out = rest
        self.io.want_write(self)

    def flush(self) -> bool:
        """Write what the socket takes of the pending reply without waiting; True once
        nothing is pending (written, or the connection failed and was shut)."""
        with self.send_lock:
            if self._out is None or self.dead:
                return True
            try:
                sent = self.sock.send(self._out, socket.MSG_DONTWAIT)
            except BlockingIOError:
                return False
            except OSError:
                self.shutdown()
                return True
            rest = self._out[sent:]
            self._out = rest if len(rest) else None
            return self._out is None

    def shutdown(self) -> None:
        """Wake whatever thread reads or writes it; its reader drops it."""
        self.dead = True
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        """Shut and close it, and give its buffered bytes back to the server's budget
        (called once no thread reads it any more: the server's ``_drop``)."""
        self.shutdown()
        with self.send_lock:
            self._out = None
            self.sock.close()
        self.reader.release()


class ChannelIO:
    """The I/O thread of a channel at ``path`` (see the module docstring): reads every
    connection handed over (``adopt``) and calls ``process(conn)`` after each read (it
    parses and starts the buffered requests; ``WireError`` drops the connection, with a
    throttled ``warn``); writes the replies ``Conn.send`` could not finish; ``drop(conn)``
    closes a connection it gives up. Runs until ``close``."""

    def __init__(self, path: str, process: Callable[[Conn], None],
                 drop: Callable[[Conn], None], warn: ThrottledLog, *,
                 send_timeout_s: float) -> None:
        self._path = path
        self._process = process
        self._drop = drop
        self._warn = warn
        self._send_timeout_s = send_timeout_s
        self._stop = threading.Event()
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_w.setblocking(False)
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        self._handed: list[Conn] = []  # adopted or with a reply pending, not yet looked at
        self._handed_lock = threading.Lock()
        self._sending: dict[Conn, float] = {}  # I/O thread only: reply pending -> deadline
        threading.Thread(target=self._loop, name="raykv-channel-io", daemon=True).start()

    def adopt(self, conn: Conn) -> None:
        """Serve ``conn`` from now on (its own thread no longer reads it). Set
        ``conn.io`` first, before the request whose reply may come from elsewhere."""
        self._hand(conn)

    def want_write(self, conn: Conn) -> None:
        """``conn`` has a reply pending (any thread)."""
        self._hand(conn)

    def _hand(self, conn: Conn) -> None:
        with self._handed_lock:
            self._handed.append(conn)
        with contextlib.suppress(OSError):  # full: a wake-up is pending anyway
            self._wake_w.send(b"a")

    def close(self) -> None:
        """End the thread; it drops every connection it serves."""
        self._stop.set()
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")

    # ------------------------------------------------------------- the thread
    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                events = self._selector.select(self._timeout())
            except OSError as e:  # not expected; never spin on it
                log.error("channel %s: select failed: %s", self._path, e)
                self._stop.wait(_PAUSE_S)
                continue
            for key, mask in events:
                if key.fileobj is self._wake_r:
                    self._take_handed()
                    continue
                conn = key.data
                try:
                    if mask & selectors.EVENT_WRITE:
                        self._flush(conn)
                    if mask & selectors.EVENT_READ and not conn.dead:
                        self._read(conn)
                except WireError as e:
                    self._warn.warn("bad", "channel %s: dropped a connection: %s",
                                    self._path, e)
                    self._unregister(conn)
                except Exception:
                    log.exception("channel %s: connection failed", self._path)
                    self._unregister(conn)
            self._expire()
        for key in list(self._selector.get_map().values()):
            if key.data is not None:
                self._drop(key.data)
        with self._handed_lock:
            for conn in self._handed:
                self._drop(conn)
        self._selector.close()
        self._wake_r.close()
        self._wake_w.close()

    def _timeout(self) -> float | None:
        """Seconds until the first pending reply's deadline; None: none pending."""
        if not self._sending:
            return None
        return max(0.0, min(self._sending.values()) - time.monotonic())

    def _take_handed(self) -> None:
        with contextlib.suppress(OSError):
            self._wake_r.recv(4096)
        with self._handed_lock:
            handed, self._handed = self._handed, []
        for conn in handed:
            try:
                if conn.sock.fileno() < 0 or conn.dead:
                    self._unregister(conn)
                    continue
                if self._selector.get_map().get(conn.sock) is None:
                    self._selector.register(conn.sock, selectors.EVENT_READ, conn)
                    self._process(conn)  # requests already buffered
                if conn.sending and conn not in self._sending:
                    self._sending[conn] = time.monotonic() + self._send_timeout_s
                    self._selector.modify(conn.sock, selectors.EVENT_READ |
                                          selectors.EVENT_WRITE, conn)
                    self._flush(conn)
            except (OSError, ValueError, KeyError) as e:  # WireError is a ValueError
                self._warn.warn("bad", "channel %s: dropped a connection: %s",
                                self._path, e)
                self._unregister(conn)

    def _flush(self, conn: Conn) -> None:
        if conn not in self._sending or not conn.flush():
            return
        del self._sending[conn]
        if conn.dead:
            self._unregister(conn)
        else:
            self._selector.modify(conn.sock, selectors.EVENT_READ, conn)

    def _expire(self) -> None:
        """Drop the connections whose reply is still unwritten past its deadline."""
        if not self._sending:
            return
        now = time.monotonic()
        for conn in [c for c, t in self._sending.items() if t <= now]:
            self._warn.warn("slow", "channel %s: dropped a connection that did not read "
                            "its reply for %.1f s", self._path, self._send_timeout_s)
            self._unregister(conn)

    def _unregister(self, conn: Conn) -> None:
        self._sending.pop(conn, None)
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(conn.sock)
        self._drop(conn)

    def _read(self, conn: Conn) -> None:
        try:
            data = conn.sock.recv(conn.reader.want(), socket.MSG_DONTWAIT)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:  # the rank closed its end (or died), or we shut it
            self._unregister(conn)
            return
        conn.reader.feed(data)
        self._process(conn)
