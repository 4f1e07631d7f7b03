"""Which objects clearing a deployment removes (pure: no Ray, no Mooncake).

SGLang's ``clear()`` asks a backend to drop what it stored. raykv clears the objects of
the caller's deployment only, named by one regular expression over object keys that the
store's master matches against every key (Mooncake's ``remove_by_regex``: ECMAScript,
``regex_search`` on the key's bytes). ``clear_pattern`` makes it from the caller's
checked owner claim (``controllers.ownership``), so that it can never match another
deployment's or tenant's key:

- **With a tenant**: ``^`` + the tenant key prefix. Tenant prefixes are prefix-free
  (self-delimiting fields, no ``_`` before the final one: ``controllers.keys``), so the
  pattern matches exactly the keys made under this identity. The claim must name the
  tenant the prefix encodes and the deployment it names (its proof was checked by the
  node actor), so no caller can clear a tenant it cannot prove.
- **Without a tenant**: SGLang's prefix is not prefix-free (``org-m_`` is the start of
  ``org-m_x_``, model ``org/m_x``), so the pattern also fixes the shape of the rest of
  the key: a page hash of 64 lowercase hex digits (SGLang's, a tenant's keyed page hash)
  and a suffix of at most ``MAX_SUFFIX`` characters of ``[0-9a-z_]`` starting with
  ``_`` (every scope and buffer suffix of ``controllers.keys``). Another deployment's key
  ``P`` + ``Q`` + hash + suffix cannot match: ``Q`` ends with ``_``, so it would have to
  start with 64 hex digits, and then its own 64-digit hash would have to fit in a
  suffix of at most ``MAX_SUFFIX`` characters. Objects stored under other keys (legacy
  pointer-API keys of another shape) are not cleared. The prefix must be the claim's
  deployment id and must not be a tenant prefix (a tag that spells one would otherwise
  clear that tenant's pages).
- A deployment without a key prefix (no tenant, model name or tag) cannot be cleared:
  its keys cannot be told apart from any other such deployment's.

Bytes of the prefix outside ``[A-Za-z0-9_]`` are written ``\\xHH`` (one per UTF-8 byte),
which ECMAScript and Python's ``re`` (on bytes) read alike.
"""

from __future__ import annotations

from raykv.controllers.keys import TENANT_PREFIX_VERSION, parse_prefix
from raykv.controllers.ownership import OwnerClaim

PAGE_HASH = "[0-9a-f]{64}"
"""A page hash as SGLang makes it (SHA-256, hex), and a tenant's keyed page hash."""
MAX_SUFFIX = 32
"""Longest suffix (``_{scope}_{buffer}``) a cleared key of a deployment without a tenant
may have; the longest raykv makes is far shorter."""
_WORD = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_")


def regex_literal(text: str) -> str:
    """A regular expression matching exactly the UTF-8 bytes of ``text``."""
    return "".join(chr(b) if b in _WORD else f"\\x{b:02X}" for b in text.encode())


def clear_pattern(claim: OwnerClaim | None) -> str:
    """The pattern of every key of ``claim``'s deployment (module docstring).
    ``ValueError`` naming why for a caller without a claim, a deployment without a key
    prefix, or a key prefix that does not belong to the claim's deployment or tenant."""
    if claim is None:
        raise ValueError("clearing objects needs an owner claim (a caller without one owns "
                         "no key prefix)")
    prefix = claim.key_prefix
    if not prefix:
        raise ValueError(f"deployment {claim.deployment_id!r} has no key prefix (no tenant, "
                         "model name or extra_backend_tag): its objects cannot be told apart "
                         "from another such deployment's, so they cannot be cleared")
    if claim.tenant is not None:
        try:
            tenant = parse_prefix(prefix).tenant
        except ValueError:
            tenant = None
        if tenant != claim.tenant or claim.deployment_id != prefix[:-1]:
            raise ValueError(f"the key prefix {prefix!r} is not the one of deployment "
                             f"{claim.deployment_id!r} of tenant {claim.tenant!r}")
        return "^" + regex_literal(prefix)
    if prefix != claim.deployment_id or _is_tenant_prefix(prefix):
        raise ValueError(f"the key prefix {prefix!r} is not the one of deployment "
                         f"{claim.deployment_id!r} (without a tenant)")
    return f"^{regex_literal(prefix)}{PAGE_HASH}_[0-9a-z_]{{0,{MAX_SUFFIX - 1}}}$"


def _is_tenant_prefix(prefix: str) -> bool:
    if not prefix.startswith(TENANT_PREFIX_VERSION):
        return False
    try:
        parse_prefix(prefix)
    except ValueError:
        return False
    return True
