"""The local channel's client, run by a rank (what the channel is and whom it trusts:
``cache_actors.channel_socket``; its wire: ``channel_codec``).

``ChannelClient`` (given ``bind``: its owner claim, or a callable that makes a fresh one
for each connection, sent as the first request of every connection it opens) checks a
connection out of a small free list for each call and back in after it (one list per
kind: data ops, async ops), so calls from concurrent threads run on separate
connections, the caller's thread does all the I/O (no thread switch), and the
connections open are at most the calls in flight plus ``MAX_IDLE`` idle ones per kind,
whatever threads come and go (a connection per thread would hold a socket, and a server
thread, for every thread that ever called, until a finalizer ran). Each call has a
deadline (``timeout_s``, kept by the socket's kernel timeouts, at most ``_SLACK_S``
late); when it passes, that connection is closed (a late reply can never be read by a
later call) and the call raises ``DeadlineExceededError``. One request at a time per
connection, so replies never interleave.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable

from raykv.cache_actors.channel_codec import (
    BIND_OP,
    FrameReader,
    WireError,
    check_hello,
    decode,
    hello,
    parse_reply,
    request,
)
from raykv.cache_actors.channel_socket import (
    ChannelClosedError,
    RequestNotSentError,
    peer_uid,
    timeval,
)
from raykv.cache_actors.errors import DeadlineExceededError
from raykv.controllers.contract import DEFAULT_TIMEOUT_S
from raykv.controllers.ownership import OwnerClaim

MAX_IDLE = 16
"""Idle connections a client keeps per kind."""


def _check_server(sock: socket.socket, path: str) -> None:
    """``ConnectionRefusedError`` unless the process serving ``sock`` (a connected Unix
    socket) runs as this process's uid: keys and owner claims go to no other user's
    socket, whoever created the file at ``path``."""
    uid, mine = peer_uid(sock), os.getuid()
    if uid != mine:
        raise ConnectionRefusedError(f"the socket {path} is served by uid {uid}, not by "
                                     f"this process's uid {mine}: not a node actor of "
                                     "this user; refused")


_SMALL = 1 << 16
"""A request this small is never waited on by ``send``: the peer read every byte sent
before it (it answered them), so the socket's buffer is empty."""
_SLACK_S = 0.01
"""How far past its deadline a receive may wait rather than pay a ``setsockopt``."""


class _Link:
    """A client's connection: its socket and the bytes of a reply not yet whole. The
    socket blocks; its kernel timeouts (``SO_RCVTIMEO``, ``SO_SNDTIMEO``) enforce the
    deadline. They stay at the full ``timeout_s`` while a call's time left is within
    ``_SLACK_S`` of it (the usual case: a call that found an idle connection and sent a
    small request), so a call costs no extra syscall; otherwise they are set to the time
    left (a Python socket timeout would cost two ``ioctl``s and a ``poll`` per send and
    per receive)."""

    def __init__(self, path: str, timeout_s: float, deadline: float,
                 bind: OwnerClaim | None = None) -> None:
        """Connect to ``path``, exchange hellos and send the owner claim ``bind`` (if
        any) by ``deadline``; raises as ``exchange``, ``ChannelVersionError``, and the
        node actor's error (``ValueError``) if it refused the claim."""
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.reader = FrameReader()
        self._full = timeout_s
        self._limits = {socket.SO_RCVTIMEO: 0.0, socket.SO_SNDTIMEO: 0.0}  # 0: none set
        try:
            self._limit(socket.SO_SNDTIMEO, deadline)  # connect waits on a full backlog
            try:
                self.sock.connect(path)
            except BlockingIOError as e:
                raise TimeoutError("the node actor's backlog stayed full") from e
            _check_server(self.sock, path)
            check_hello(decode(self.exchange(hello(), deadline)), "node actor")
            if bind is not None:
                ok, value = parse_reply(self.exchange(request(BIND_OP, deadline, [bind]),
                                                      deadline))
                if not ok:
                    raise value
        except BaseException:
            self.sock.close()
            raise

    def _limit(self, option: int, deadline: float) -> None:
        """Make ``option``'s timeout end by ``deadline`` (``_SLACK_S`` late at most)."""
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("deadline passed")
        now = self._limits[option]
        if left <= now <= left + _SLACK_S:
            return
        if left >= self._full - _SLACK_S:
            left = self._full  # back to the full timeout: the usual calls need no syscall
        self.sock.setsockopt(socket.SOL_SOCKET, option, timeval(max(left, 1e-6)))
        self._limits[option] = left

    def exchange(self, data: bytes, deadline: float) -> bytes:
        """Send ``data``, return the next frame's body. ``TimeoutError`` when
        ``deadline`` (monotonic seconds) passes, ``RequestNotSentError`` when the
        connection broke before ``data`` was written whole, ``ChannelClosedError`` at
        EOF, other ``OSError``s and ``WireError`` as they come."""
        sock, reader = self.sock, self.reader
        try:
            if len(data) > _SMALL:
                self._limit(socket.SO_SNDTIMEO, deadline)
            try:
                sock.sendall(data)
            except (BlockingIOError, TimeoutError):
                raise
            except OSError as e:  # EPIPE, ECONNRESET: the peer was gone before it read it
                raise RequestNotSentError(f"the request was not sent: {e}") from e
            while (body := reader.next()) is None:
                self._limit(socket.SO_RCVTIMEO, deadline)
                chunk = sock.recv(reader.want())
                if not chunk:
                    raise ChannelClosedError("the node actor closed the channel")
                reader.feed(chunk)
        except BlockingIOError as e:  # SO_RCVTIMEO / SO_SNDTIMEO ran out
            raise TimeoutError("deadline passed") from e
        return body

    def close(self) -> None:
        self.sock.close()


class ChannelClient:
    """The rank's end: ``call(op, *args)`` blocks for the reply, ``timeout_s`` at most
    (then ``DeadlineExceededError``, retryable). Thread-safe: concurrent calls use
    separate connections from a free list; ops in ``async_ops`` use connections of
    their own (see the module docstring). ``bind``: the owner claim every connection
    starts with (None: none), or a callable that makes one per connection (a tenant's
    call proof is good for one connection). Raises ``ChannelClosedError`` when the actor is
    unreachable (``RequestNotSentError`` when it is certain that it never saw the
    request), ``ChannelVersionError`` when it runs another wire, ``ValueError`` when it
    refused the claim. The first connection is opened here, by ``deadline`` (monotonic
    seconds; default ``timeout_s`` from now)."""

    def __init__(self, path: str, async_ops: frozenset[str] = frozenset(),
                 timeout_s: float = DEFAULT_TIMEOUT_S, max_idle: int = MAX_IDLE,
                 bind: OwnerClaim | Callable[[], OwnerClaim | None] | None = None,
                 deadline: float | None = None) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.path = path
        self._bind = bind
        self.timeout_s = timeout_s
        self._async_ops = async_ops
        self._max_idle = max_idle
        self._idle: dict[bool, list[_Link]] = {False: [], True: []}
        self._lock = threading.Lock()
        self._generation = 0  # close() starts a new one; links of older ones are closed
        # fail now, not at the first data call, if nobody (or another wire) listens
        if deadline is None:
            deadline = time.monotonic() + timeout_s
        self._release(False, self._open(deadline), 0)

    def call(self, op: str, *args, timeout_s: float | None = None):
        """``op``'s reply value, or the error the node actor raised, within
        ``timeout_s`` (default: the client's). ``TypeError`` for an argument the channel
        cannot carry (nothing is sent)."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        data = request(op, deadline, args)
        kind = op in self._async_ops
        with self._lock:
            generation = self._generation
            idle = self._idle[kind]
            link = idle.pop() if idle else None
        if link is None:
            link = self._open(deadline)
        try:
            body = link.exchange(data, deadline)
            ok, value = parse_reply(body)
        except TimeoutError:
            link.close()  # a late reply must never reach a later call
            raise DeadlineExceededError(
                f"the node actor did not answer {op} within {timeout_s:.3g} s "
                f"(channel {self.path}): retry the call") from None
        except (OSError, WireError) as e:
            link.close()
            if isinstance(e, RequestNotSentError):
                raise
            raise ChannelClosedError(f"channel to the node actor broke during {op}: "
                                     f"{e}") from e
        self._release(kind, link, generation)
        if ok:
            return value
        raise value

    def warm(self, op: str, deadline: float) -> None:
        """Open a connection of ``op``'s kind by ``deadline`` (monotonic seconds) and
        keep it idle, unless one is idle already: the next such call opens none."""
        kind = op in self._async_ops
        with self._lock:
            if self._idle[kind]:
                return
            generation = self._generation
        self._release(kind, self._open(deadline), generation)

    def _open(self, deadline: float) -> _Link:
        try:
            bind = self._bind() if callable(self._bind) else self._bind
            return _Link(self.path, self.timeout_s, deadline, bind)
        except TimeoutError:
            raise DeadlineExceededError(f"the node actor at {self.path} did not accept a "
                                        "connection by the call's deadline") from None
        except (OSError, WireError) as e:  # before any request: none was sent
            raise RequestNotSentError(f"cannot reach the node actor at {self.path}: "
                                      f"{e}") from e

    def _release(self, kind: bool, link: _Link, generation: int) -> None:
        if not link.reader.pending:  # else bytes nobody asked for: do not reuse
            with self._lock:
                idle = self._idle[kind]
                if generation == self._generation and len(idle) < self._max_idle:
                    idle.append(link)
                    return
        link.close()

    def close(self) -> None:
        """Close the idle connections, and those in use once their call ends; later
        calls open new ones."""
        with self._lock:
            self._generation += 1
            links = self._idle[False] + self._idle[True]
            self._idle = {False: [], True: []}
        for link in links:
            link.close()
