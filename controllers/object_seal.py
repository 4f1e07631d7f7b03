"""Seals: what lets a node actor vouch for an object it reads back from the store, from
memory or from disk (pure: no Ray, no Mooncake).

With a disk tier on, every object raykv puts is the page's bytes followed by a **seal**
of ``SEAL_BYTES`` (32): the magic ``b"RKS1"``, the page's length (8 bytes, little
endian) and a 20-byte keyed BLAKE3 MAC under the cluster's **seal key** over the object
key and the page. A get reads both and serves the page only if the seal verifies
(``check``); anything else (a flipped byte, a truncated or foreign file, an object of
another size, a seal made under another cluster's key) is ``SEAL_MISMATCH``, a miss.
The seal is raykv's own, not Mooncake's checksum, so it is kept with the object's bytes
through Mooncake's offload to disk and its re-scan after a restart.

The seal key is 32 random bytes, one per cluster, kept in a file (``read_seal_key``) on
the node that starts the cluster, so a cluster restarted on the same directories
verifies what it wrote before and nothing another cluster wrote. It guards against
damage and against files that are not the cluster's own; whoever can read the key file
can seal objects too.
"""

from __future__ import annotations

import os
import secrets
import stat
import struct
from pathlib import Path

import blake3

SEAL_BYTES = 32
MAGIC = b"RKS1"
_MAC_BYTES = SEAL_BYTES - len(MAGIC) - 8
KEY_BYTES = 32
SEAL_KEY_FILE = "raykv-seal.key"
"""The seal key's file in the disk directory of the node that starts the cluster."""


def check_seal_key(key_hex: str) -> bytes:
    """The 32-byte seal key written as 64 hex digits; ``ValueError`` otherwise."""
    try:
        key = bytes.fromhex(key_hex)
    except ValueError:
        key = b""
    if len(key) != KEY_BYTES:
        raise ValueError("a seal key is 64 hex digits (32 bytes)")
    return key


def _mac(seal_key: bytes, object_key: str, page: memoryview | bytes) -> bytes:
    name = object_key.encode()
    mac = blake3.blake3(struct.pack("<I", len(name)) + name + struct.pack("<Q", len(page)),
                        key=seal_key)
    mac.update(page)
    return mac.digest(_MAC_BYTES)


def seal(seal_key: bytes, object_key: str, page: memoryview | bytes) -> bytes:
    """The ``SEAL_BYTES`` seal of ``page`` stored under ``object_key``."""
    return MAGIC + struct.pack("<Q", len(page)) + _mac(seal_key, object_key, page)


def check(seal_key: bytes, object_key: str, page: memoryview | bytes,
          sealed: bytes) -> str | None:
    """None when ``sealed`` is the seal of ``page`` under ``object_key``; else why not:
    ``"format"`` (no seal there: not magic), ``"length"`` (sealed for another length)
    or ``"mac"`` (bytes changed, or another key sealed them)."""
    if len(sealed) != SEAL_BYTES or sealed[:len(MAGIC)] != MAGIC:
        return "format"
    if struct.unpack_from("<Q", sealed, len(MAGIC))[0] != len(page):
        return "length"
    if not secrets.compare_digest(sealed[len(MAGIC) + 8:], _mac(seal_key, object_key, page)):
        return "mac"
    return None


def read_seal_key(directory: str | os.PathLike) -> str:
    """The cluster's seal key (hex) kept in ``directory``'s ``SEAL_KEY_FILE``, made (32
    random bytes, mode 0600) when the file is absent. ``ValueError`` if the file holds
    no key or others than its owner may read it; ``OSError`` if it cannot be written."""
    path = Path(directory) / SEAL_KEY_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        if path.stat().st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise ValueError(f"{path} may be read by others than its owner: "
                             "chmod 600 it") from None
        key = path.read_text().strip()
        check_seal_key(key)
        return key
    with os.fdopen(fd, "w") as out:
        key = secrets.token_hex(KEY_BYTES)
        out.write(key + "\n")
    return key
