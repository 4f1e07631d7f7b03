"""Finding the Ray cluster a ``raykv`` command joins, in seconds, before ``ray.init``.

``ray.init`` against an address where no Ray cluster answers does not fail fast: a
closed port or a port of some other service waits out Ray's GCS connect retries (over
30 s, minutes for an address that drops packets) and then raises a ConnectionError
amid C++ log lines. Ray's knobs for that wait (``RAY_gcs_rpc_server_*_timeout_s``)
also govern the driver's GCS reconnects once connected, and at a few seconds they end
the process from C++ instead of raising. So ``check_gcs`` asks the GCS itself first:
one ``GetClusterId`` gRPC call (what Ray's own GCS client sends first) with a deadline
of ``CONNECT_TIMEOUT_S``; a refused port fails in milliseconds.
"""

from __future__ import annotations

import os
import socket

CONNECT_TIMEOUT_S = 5.0
HINT = ("start one with `ray start --head`, or give its address (host:port of the head's "
        "GCS) with --address or RAY_ADDRESS")


class RayUnreachableError(ConnectionError):
    """No Ray cluster answers at the address a command was given; the message says
    where it looked and how to start or name one (one line)."""


def gcs_address(address: str) -> str | None:
    """The ``host:port`` that ``ray.init(address=address)`` connects to: ``auto``
    (``RAY_ADDRESS``, else the last ``ray start`` on this machine, else a running GCS
    found here) resolved and ``127.0.0.1`` replaced by this node's IP as Ray does;
    ``ray://host:port`` (a Ray client address) as is, without the scheme. None for
    ``local`` (``ray.init`` starts a new cluster). Raises ``RayUnreachableError`` if
    ``auto`` finds no cluster."""
    if "://" in address:
        return address.split("://", 1)[1]
    # The same resolution ray.init runs (a private helper of Ray's, with its semantics).
    from ray._private.services import canonicalize_bootstrap_address

    try:
        return canonicalize_bootstrap_address(address)
    except ConnectionError:
        raise RayUnreachableError(f"no running Ray cluster found (--address {address}, "
                                  f"RAY_ADDRESS unset): {HINT}") from None


def _split(host_port: str) -> tuple[str, int]:
    host, _, port = host_port.rpartition(":")
    return host.strip("[]"), int(port)


def _shown(address: str, target: str) -> str:
    """``target`` and where it came from, for a message."""
    if address == "auto":
        env = os.environ.get("RAY_ADDRESS")
        origin = "--address auto" if not env else (
            "RAY_ADDRESS" if env == target else f"RAY_ADDRESS={env}")
        return f"{target} ({origin})"
    return target if target == address else f"{target} (--address {address})"


def check_gcs(address: str, timeout_s: float = CONNECT_TIMEOUT_S) -> None:
    """Return if a Ray GCS (or, for ``ray://``, a Ray client server) answers at the
    address ``ray.init(address=address)`` would use, within ``timeout_s`` seconds;
    raise ``RayUnreachableError`` otherwise. ``local`` is not checked."""
    target = gcs_address(address)
    if target is None:
        return
    shown = _shown(address, target)
    if "://" in address:
        try:
            socket.create_connection(_split(target), timeout=timeout_s).close()
        except OSError as e:
            raise RayUnreachableError(f"no Ray client server at {shown}: "
                                      f"{e.strerror or e}; {HINT}") from None
        return
    import grpc
    from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc

    # No proxy: a GCS is reached directly, as Ray's own client reaches it.
    with grpc.insecure_channel(target, options=[("grpc.enable_http_proxy", 0)]) as channel:
        stub = gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel)
        try:
            stub.GetClusterId(gcs_service_pb2.GetClusterIdRequest(), timeout=timeout_s)
        except grpc.RpcError as e:
            code = e.code()
            if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
                return  # a GCS that wants credentials: ray.init has them, or says so
            if code == grpc.StatusCode.UNAVAILABLE:
                raise RayUnreachableError(f"no Ray cluster reachable at {shown}: {HINT}"
                                          ) from None
            if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise RayUnreachableError(f"no answer from a Ray cluster at {shown} within "
                                          f"{timeout_s:g} s: {HINT}") from None
            raise RayUnreachableError(f"{shown} is not a Ray cluster's GCS ({code.name}): "
                                      f"{HINT}") from None
