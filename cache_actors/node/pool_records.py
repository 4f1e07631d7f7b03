"""The record a node actor keeps of each pool it made, so a restarted actor re-adopts it.

Each pool has a ``<prefix><name>.json`` record under ``SHM_DIR``: its name, its path and
layout, (for a pool of one engine process) the ``process`` it serves, and its ``owner``
(``controllers.ownership``: deployment, tenant and the tenant's public owner key, the
tenant digest; none: a legacy pool). Records of an older raykv name the process
``owner`` (a list): they are read as such, and their pools have no owner. Records are written
atomically (``own_files.write_own_file``). ``trusted`` trusts none of them blindly and
never blocks on one: a record is opened without following a link and without blocking
(``own_files.read_own_file``: a FIFO planted under a record's name is never read); one
that is not a regular file of this process's uid, or is group/world-writable, or larger
than ``RECORD_MAX_BYTES``, or does not parse, or names an invalid pool name, another
name than its file's, an invalid layout or another path than the one this node gives
that name, is logged and skipped (and, when it is this uid's regular file, renamed
aside to ``<file>.bad``); it never stops the actor from starting. Runs in the node
actor, under ``NodePools``' lock (not thread-safe on its own).
"""

from __future__ import annotations

import contextlib
import glob
import json
import logging
import os
import stat
from collections.abc import Iterator
from dataclasses import asdict, dataclass

from raykv.cache_actors.host_pools import HostPool, PoolHandle
from raykv.cache_actors.node.own_files import read_own_file, write_own_file
from raykv.cache_actors.processes import ProcessIdentity
from raykv.cache_actors.shared_memory import SHM_DIR, shm_path
from raykv.controllers.owner_keys import HEX64
from raykv.controllers.ownership import MAX_ID_CHARS, Owner
from raykv.controllers.pool_layout import PoolLayout, check_pool_name
from raykv.controllers.tenancy import check_tenant

log = logging.getLogger(__name__)

RECORD_MAX_BYTES = 64 << 10
"""A pool record larger than this is not read (a real one is well under 4 KiB)."""


@dataclass(frozen=True)
class PoolRecord:
    """What a record holds: the pool's handle, the process it serves (None: a shared
    pool), its owner (None: legacy) and its tenant's public owner key (None without a
    tenant)."""

    handle: PoolHandle
    process: ProcessIdentity | None = None
    owner: Owner | None = None
    owner_key: str | None = None


def _owner(raw: object) -> tuple[Owner | None, str | None]:
    """The owner and owner key of a record's ``owner`` field; ``ValueError``."""
    if raw is None:
        return None, None
    if not isinstance(raw, dict) or set(raw) != {"deployment", "tenant", "owner_key"}:
        raise ValueError(f"owner {str(raw)[:80]!r} is not an owner")
    dep, key = raw["deployment"], raw["owner_key"]
    tenant = check_tenant(raw["tenant"])
    if type(dep) is not str or not 0 < len(dep) <= MAX_ID_CHARS:
        raise ValueError(f"deployment {str(dep)[:80]!r} is not a deployment id")
    if (key is None) != (tenant is None) or (key is not None and not (
            type(key) is str and HEX64.fullmatch(key))):
        raise ValueError("its owner key is not a tenant digest (64 hex digits, with a "
                         "tenant only)")
    return Owner(dep, tenant), key


class PoolRecords:
    """The records of the pools of the node actor with file prefix ``prefix``, in
    ``mode`` (``"embedded"``: a recorded path must be this node's file for that name;
    ``"standalone"``: the path is never mapped, so it is not checked). ``prefix`` is
    also the prefix of the pools' own shared-memory files (embedded)."""

    def __init__(self, prefix: str, mode: str) -> None:
        self.prefix = prefix
        self._mode = mode

    def path(self, name: str) -> str:
        """The record file of pool ``name``."""
        return shm_path(self.prefix + name + ".json")

    def write(self, pool: HostPool, process: ProcessIdentity | None,
              owner: Owner | None = None, owner_key: str | None = None) -> None:
        """The pool's record, atomically. ``process`` is recorded so that a restarted
        actor still reaps the pool with its process; ``owner`` and its tenant's
        ``owner_key`` so that it still serves its owner alone."""
        record = {"name": pool.name, "path": pool.handle.path,
                  "layout": asdict(pool.handle.layout)}
        if process is not None:
            record["process"] = [process.pid, process.start_ticks]
        if owner is not None:
            record["owner"] = {"deployment": owner.deployment_id, "tenant": owner.tenant,
                               "owner_key": owner_key}
        write_own_file(self.path(pool.name), json.dumps(record).encode())

    def remove(self, name: str) -> None:
        """Delete pool ``name``'s record (none is fine)."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path(name))

    def read(self, path: str) -> PoolRecord:
        """The record in ``path``; ``ValueError`` naming what is wrong (see the module
        docstring for what is refused), ``OSError`` if it cannot be opened."""
        data = read_own_file(path, "pool record", RECORD_MAX_BYTES)
        try:
            raw = json.loads(data)
            name, recorded, layout_raw = raw["name"], raw["path"], raw["layout"]
            layout = PoolLayout(**layout_raw)
            owner_raw = raw.get("owner")
            if isinstance(owner_raw, list):  # an older raykv's name for the process
                process_raw, owner_raw = owner_raw, None
            else:
                process_raw = raw.get("process")
            process = None if process_raw is None else ProcessIdentity(*process_raw)
            owner, digest = _owner(owner_raw)
        except (ValueError, TypeError, KeyError, AttributeError) as e:
            raise ValueError(f"not a pool record: {type(e).__name__}: {e}") from None
        check_pool_name(name)
        if path != self.path(name):
            raise ValueError(f"it names pool {name!r}, whose record is another file")
        if json.loads(json.dumps(asdict(layout))) != layout_raw:
            raise ValueError("its layout is not one this node writes")
        if not isinstance(recorded, str):
            raise ValueError(f"path {recorded!r} is not a string")
        if self._mode == "embedded" and recorded != self.prefix + name:
            raise ValueError(f"path {recorded!r} is not this node's file for pool {name!r}")
        if process is not None and not all(type(v) is int for v in (process.pid,
                                                                      process.start_ticks)):
            raise ValueError(f"process {process_raw!r} is not a process identity")
        # standalone: the path is never mapped
        return PoolRecord(PoolHandle(name, recorded, layout), process, owner, digest)

    def trusted(self) -> Iterator[PoolRecord]:
        """Every record this node can trust, as ``read`` returns it, in name order; the
        others are logged and set aside (never raises for one)."""
        pattern = os.path.join(SHM_DIR, glob.escape(self.prefix) + "*.json")
        for path in sorted(glob.glob(pattern)):
            try:
                yield self.read(path)
            except (OSError, ValueError) as e:
                log.error("pool record %s is ignored: %s", path, e)
                _set_aside(path)


def _set_aside(path: str) -> None:
    """Rename a refused record of this uid to ``<file>.bad`` (left if not ours)."""
    with contextlib.suppress(OSError):
        st = os.lstat(path)
        if stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid():
            os.replace(path, path + ".bad")
