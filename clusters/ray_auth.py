"""Ray's token authentication for the clusters ``start_local`` starts (the driver's process).

Ray 2.60 turns token authentication on for a new local cluster unless ``RAY_AUTH_MODE``
says otherwise, and makes the token (``~/.ray/auth_token``) when none exists: it checks,
then writes. Each of the cluster's processes reads the mode and the token when it starts.
Two clusters started at once on a machine without a token (a fresh machine, two test
workers) can both find none and both write one, the second overwriting the first, and a
process that read the file in between holds a token the others no longer know; a
process started while the mode was still being decided can be on the other side of it.
``settle`` takes both decisions once, before anything starts: the mode (Ray's default,
``token``, unless the environment names one) in this process's environment, which every
process it starts inherits, and the token file made atomically (the first writer wins;
everyone else reads its token).
"""

from __future__ import annotations

import os
import secrets
import tempfile
from pathlib import Path

from raykv.cache_actors.ray_auth_mode import MODE_VAR, TOKEN_VAR, token_path, use_mode


def create_once(path: Path, token: str) -> bool:
    """Write ``token`` to ``path`` (mode 0600) unless a file is there; True if this call
    wrote it. Atomic: the token is written to a file of its own and linked in place, so
    concurrent callers never see a partial token and exactly one of them wins."""
    if path.exists():
        return False
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".auth_token.")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(token)
            f.flush()
            os.fsync(f.fileno())
        os.link(tmp, path)
        return True
    except FileExistsError:
        return False
    finally:
        os.unlink(tmp)


def settle() -> str:
    """Decide Ray's auth mode for the clusters this process starts and, in token mode,
    make sure the token exists (``create_once``; a token given in ``RAY_AUTH_TOKEN`` is
    used as it is). Returns the mode. Call before starting any Ray process; Ray's cached
    view of both in this process is refreshed (``use_mode``)."""
    mode = os.environ.get(MODE_VAR, "token")
    if mode.lower() == "token" and TOKEN_VAR not in os.environ:
        create_once(token_path(), secrets.token_hex(32))
    use_mode(mode)
    return mode
