"""The local channel: a same-node Unix socket between ranks and their node actor. What
both ends share is here; the node actor's end is ``node.channel_server``, the rank's
``rank.channel_client``, the wire (frames, messages, errors, what can be decoded)
``channel_codec``.

A Ray actor call costs ~1 ms on these machines, more than a small Mooncake batch. Ranks
on the node of their node actor therefore send data calls (exists, put, get, group
hits) over a Unix stream socket that the actor serves from its own threads; Ray still
creates, finds, supervises and restarts the actor, and remote callers still use Ray.
Like a Ray call, a request carries keys, offsets and results only, never page bytes.

Trust. The socket file is mode 0600 in ``/dev/shm`` and the server accepts only peers
of its own uid (``SO_PEERCRED``): processes that could map the pools anyway; a client
likewise refuses a socket served by another uid (keys and owner claims go to no other
user's process). Even so, nothing a peer sends can hurt other connections: a header
over ``MAX_FRAME`` closes the connection before anything is allocated for it; bytes are
buffered only as they arrive; decoding a frame builds at most ``MAX_DECODED`` values
(``channel_codec``). A whole frame that is no valid request (not msgpack, wrong shape
or types, unknown op, over the decoding budget) is answered with a ``ValueError`` on
the same connection, which serves on (one throttled log line). A second request before
the reply to the first was written whole closes that connection. Replies are written
without waiting (``node.channel_io``): a peer that does not read stalls no thread that
serves others; a reply it does not read for ``SEND_TIMEOUT_S``, or a hello not sent
within ``HELLO_TIMEOUT_S`` (``node.channel_server``) of connecting, closes its connection.
"""

from __future__ import annotations

import socket
import struct

_TIMEVAL = struct.Struct("ll")


class ChannelClosedError(ConnectionError):
    """The actor's end of the channel is gone (actor dead or restarting)."""


class RequestNotSentError(ChannelClosedError):
    """The channel broke before a request was written whole (or before a connection
    for it was made): the actor never saw that request, so sending it again on a new
    connection cannot run it twice."""


def timeval(seconds: float) -> bytes:
    """``seconds`` as a ``struct timeval`` (0: no timeout)."""
    whole = int(seconds)
    return _TIMEVAL.pack(whole, int((seconds - whole) * 1e6))


def peer_uid(sock: socket.socket) -> int:
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[1]
