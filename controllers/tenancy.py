"""Tenants: who may compute a tenant's keys and claim its pools (pure: no Ray, no Mooncake).

A *tenant* is a name (``StorageConfig.tenant``) plus a *tenant secret* that only that
tenant's processes are given, in the environment variable ``RAYKV_TENANT_SECRET`` or in
the file that ``RAYKV_TENANT_SECRET_FILE`` names (what to hand Ray Serve replicas: Ray
shows every job a runtime environment's variables, but not a file's contents). The
secret never leaves the rank process: ranks send the node actor *keyed page hashes*
(``keyed_page_hash``: HMAC-SHA256 of the page hash under the secret's page-hash sub-key)
and prove they own the tenant's pools by signing fresh challenges with the tenant's
*owner key*, derived from the secret's owner-key sub-key (``controllers.owner_keys``),
never by showing the secret or anything that could be shown again. Each use of the
secret has its own *sub-key* (``sub_key``, HKDF-SHA256 with the use in its info), and no
use is keyed with the secret itself: a keyed page hash of any string the caller chooses
is never another use's key. A process without the secret can neither name the tenant's
objects nor prove it owns the tenant's pools. With no tenant, none of this applies and
keys are as without tenancy.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import stat
from collections.abc import Mapping

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

TENANT_SECRET_ENV = "RAYKV_TENANT_SECRET"
"""The environment variable that holds the secret of the process's tenant."""
TENANT_SECRET_FILE_ENV = "RAYKV_TENANT_SECRET_FILE"
"""The environment variable naming a file that holds it (used when the other is unset)."""
MAX_SECRET_FILE_BYTES = 4096
"""Largest secret file read."""
OTHERS_READ_WRITE = 0o066
"""Mode bits a secret file must not have: read or write for its group or for others."""
MIN_SECRET_BYTES = 16
"""Shortest accepted secret (UTF-8 bytes): 128 bits if drawn at random, e.g. ``openssl
rand -hex 32``."""
TENANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
"""A tenant name: 1-64 characters, letters, digits, ``.``, ``_`` and ``-``, not starting
with a symbol (it appears in metrics labels, quotas and ``raykv status``)."""


def check_tenant(tenant: object) -> str | None:
    """``tenant`` if it is None or a valid tenant name, else ``ValueError``."""
    if tenant is None:
        return None
    if not isinstance(tenant, str) or not TENANT_NAME.fullmatch(tenant):
        raise ValueError(f"tenant must be 1-64 letters, digits, '.', '_' or '-' (starting "
                         f"with a letter or digit), got {tenant!r}")
    return tenant


def tenant_secret(tenant: str, environ: Mapping[str, str] = os.environ) -> bytes:
    """The secret of ``tenant`` from ``environ[RAYKV_TENANT_SECRET]``, or else from the
    file ``environ[RAYKV_TENANT_SECRET_FILE]`` names (its bytes less trailing
    whitespace; a regular file of at most ``MAX_SECRET_FILE_BYTES`` that other users,
    its group's included, can neither read nor write); ``ValueError`` naming the fix
    when it is missing, unfit or shorter than ``MIN_SECRET_BYTES``."""
    secret = environ.get(TENANT_SECRET_ENV, "").encode()
    where = f"${TENANT_SECRET_ENV}"
    if not secret and environ.get(TENANT_SECRET_FILE_ENV):
        where = f"the file ${TENANT_SECRET_FILE_ENV} names"
        secret = _secret_file(tenant, environ[TENANT_SECRET_FILE_ENV])
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(
            f"tenant {tenant!r} needs its secret in {where} (at least {MIN_SECRET_BYTES} "
            f"bytes, e.g. `openssl rand -hex 32`), given to this tenant's processes only; "
            f"it is {'too short' if secret else 'not set'}")
    return secret


def _secret_file(tenant: str, path: str) -> bytes:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise ValueError(f"tenant {tenant!r}: cannot open ${TENANT_SECRET_FILE_ENV} "
                         f"({e.strerror})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_SECRET_FILE_BYTES:
            raise ValueError(f"tenant {tenant!r}: ${TENANT_SECRET_FILE_ENV} must name a "
                             f"regular file of at most {MAX_SECRET_FILE_BYTES} bytes")
        if st.st_mode & OTHERS_READ_WRITE:
            raise ValueError(f"tenant {tenant!r}: ${TENANT_SECRET_FILE_ENV} names a file "
                             f"of mode {stat.S_IMODE(st.st_mode):o}, which other users can "
                             "read or write (its group's included): make it its owner's "
                             "alone, e.g. `chmod 0400`")
        return os.read(fd, MAX_SECRET_FILE_BYTES + 1).rstrip()
    finally:
        os.close(fd)


PAGE_HASHES = "page-hashes"
"""The use of the sub-key that keys page hashes (``page_key``)."""
OWNER_KEY = "owner-key"
"""The use of the sub-key that seeds the owner key (``owner_keys.OwnerKey.of_secret``)."""
_SUB_KEY_INFO = "raykv/tenant-sub-key/v2/"


def sub_key(secret: bytes, use: str) -> bytes:
    """The 32-byte sub-key of the tenant secret for ``use`` (``PAGE_HASHES`` or
    ``OWNER_KEY``): HKDF-SHA256 of ``secret`` (no salt) with ``_SUB_KEY_INFO + use`` as
    its info, so each use has a key of its own and none can be computed from another's
    outputs. ``ValueError`` for another use."""
    if use not in (PAGE_HASHES, OWNER_KEY):
        raise ValueError(f"a tenant secret's sub-key is for {PAGE_HASHES!r} or "
                         f"{OWNER_KEY!r}, got {use!r}")
    return HKDF(hashes.SHA256(), 32, None, (_SUB_KEY_INFO + use).encode()).derive(secret)


def page_key(secret: bytes) -> bytes:
    """The key of a tenant's page hashes: the secret's ``PAGE_HASHES`` sub-key."""
    return sub_key(secret, PAGE_HASHES)


def keyed_page_hash(key: bytes, page_hash: str) -> str:
    """The page hash a tenant's keys are made of: HMAC-SHA256 of ``page_hash`` under
    ``key`` (``page_key`` of the tenant secret), 64 hex digits (fixed length, so a key
    still parses unambiguously)."""
    return hmac.new(key, page_hash.encode(), hashlib.sha256).hexdigest()
