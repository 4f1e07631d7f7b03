"""Standalone mode: the node's ``mooncake_client`` process, supervised by its node actor.

In standalone mode the node's L3 segment lives in a ``mooncake_client`` process, not in
the node actor, so it survives a crash of the actor. The actor starts the process in its
own session and not as its child (through a shell that exits at once: Ray kills a
worker's children when it kills the worker, ``ray.kill`` included), records ``pid``, ``port`` and
the kernel's start time (JSON) in the 0600 file ``/dev/shm/<node prefix>@mooncake_client``
(written atomically, never through what lies there) and restarts it on the same port
whenever it exits. A restarted actor reads the record only if it is its own
(``read_record``: a FIFO, a link or another user's file there is ignored at once) and
adopts the running process when ``/proc/<pid>`` is still that process (same start time,
``mooncake_client`` on the recorded port, this uid's); otherwise it starts a new one. The process is
stopped only when the actor is stopped for good (``stop``) or the cluster that made it is
torn down (``stop_recorded``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from raykv.cache_actors.local_ports import free_port, listening
from raykv.cache_actors.node.own_files import read_own_file, write_own_file
from raykv.cache_actors.processes import ProcessIdentity
from raykv.cache_actors.shared_memory import SHM_DIR, shm_path
from raykv.controllers.naming import CLIENT_RECORD
from raykv.controllers.node_records import ClientProcess

log = logging.getLogger(__name__)

BINARY = "mooncake_client"
RECORD_MAX_BYTES = 4096
"""A ``mooncake_client`` record larger than this is not read (a real one has ~60 bytes)."""


def client_binary() -> str:
    """Path of the ``mooncake_client`` executable shipped inside the mooncake wheel."""
    import mooncake

    path = Path(mooncake.__file__).parent / BINARY
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: install mooncake-transfer-engine-non-cuda "
                                "(CPU) or mooncake-transfer-engine (CUDA)")
    return str(path)


def _cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except (FileNotFoundError, ProcessLookupError):
        return []


def _own_process(pid: int) -> bool:
    try:
        return os.stat(f"/proc/{pid}").st_uid == os.getuid()
    except OSError:
        return False


@dataclass(frozen=True)
class ClientRecord:
    """What identifies a running ``mooncake_client``: pid, port, kernel start time."""

    pid: int
    port: int
    start_ticks: int

    def exists(self) -> bool:
        """True while ``pid`` is this very process (not a zombie, not a reused pid),
        whether or not it has exec'd ``mooncake_client`` yet."""
        return ProcessIdentity(self.pid, self.start_ticks).alive()

    def running(self) -> bool:
        """True if ``pid`` is this very process, runs ``mooncake_client`` on ``port`` and
        belongs to this process's uid."""
        if not self.exists() or not _own_process(self.pid):
            return False
        args = _cmdline(self.pid)
        return bool(args) and Path(args[0]).name == BINARY and f"-port={self.port}" in args


def _signal_group(pid: int, sig: int) -> None:
    """Send ``sig`` to the process group of ``pid`` (the client's own group)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(os.getpgid(pid), sig)


def record_path(node_prefix: str) -> str:
    return shm_path(node_prefix + CLIENT_RECORD)


def read_record(path: str) -> ClientRecord | None:
    """The record in ``path``, or None if there is none or it is not to be trusted: not
    this uid's own regular file (``own_files.read_own_file``: a FIFO or a link is never
    opened to read), larger than ``RECORD_MAX_BYTES``, or not exactly a pid, port and
    start time (positive ints, the port below 65536). A refused record is logged."""
    try:
        data = read_own_file(path, "mooncake_client record", RECORD_MAX_BYTES)
        raw = json.loads(data)
        if not isinstance(raw, dict) or set(raw) != {"pid", "port", "start_ticks"}:
            raise ValueError(f"fields {sorted(raw) if isinstance(raw, dict) else raw!r}")
        record = ClientRecord(**raw)
        if not all(type(v) is int and v > 0 for v in asdict(record).values()) \
                or record.port > 65535:
            raise ValueError(f"values {asdict(record)}")
        return record
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        log.error("mooncake_client record %s is ignored: %s", path, e)
        return None


def stop_recorded(cluster_shm_prefix: str) -> list[int]:
    """SIGKILL every recorded, still running ``mooncake_client`` of a cluster (its whole
    process group); returns their pids. For tear-down after the actors are gone."""
    killed = []
    for path in Path(SHM_DIR).glob(f"{cluster_shm_prefix}*{CLIENT_RECORD}"):
        rec = read_record(str(path))
        if rec is not None and rec.running():
            _signal_group(rec.pid, signal.SIGKILL)
            killed.append(rec.pid)
        path.unlink(missing_ok=True)
    return killed


class MooncakeClientProcess:
    """The ``mooncake_client`` of one node: started or adopted, watched, restarted, stopped.

    ``segment_size`` bytes are what the process contributes to the store. ``watch`` runs a
    thread that restarts the process on the same port when it exits and then calls
    ``on_restart`` (the dummy reconnects by itself; buffers registered before must be
    allocated and registered again).
    """

    def __init__(self, node_prefix: str, *, host: str, master_address: str,
                 metadata_server: str, segment_size: int, protocol: str = "tcp",
                 rdma_devices: str = "") -> None:
        self._path = record_path(node_prefix)
        self._log = Path(tempfile.gettempdir()) / f"{node_prefix}mooncake_client.log"
        self.host = host
        self._args = [f"-host={host}", f"-master_server_address={master_address}",
                      f"-metadata_server={metadata_server}",
                      f"-global_segment_size={segment_size}", f"-protocol={protocol}"]
        if rdma_devices:
            self._args.append(f"-device_names={rdma_devices}")
        self.record: ClientRecord | None = None
        self.adopted = False
        self.restarts = 0
        self.down = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def address(self) -> str:
        """``host:port`` a dummy client connects to."""
        return f"{self.host}:{self.record.port}"

    def start_or_adopt(self, timeout_s: float = 30.0) -> MooncakeClientProcess:
        """Adopt the recorded process if it still runs, else start one on a free port."""
        rec = read_record(self._path)
        if rec is not None and rec.running():
            self.record, self.adopted = rec, True
            log.info("adopted mooncake_client pid %s on port %s", rec.pid, rec.port)
            return self
        self._launch(free_port(self.host), timeout_s)
        return self

    def _launch(self, port: int, timeout_s: float) -> None:
        env = dict(os.environ, RAYKV_CLIENT_LOG=str(self._log))
        env["MC_TCP_BIND_ADDRESS"] = self.host  # never one inherited (a driver's loopback)
        shell = subprocess.run(
            ["/bin/sh", "-c", '"$0" "$@" </dev/null >>"$RAYKV_CLIENT_LOG" 2>&1 & echo $!',
             client_binary(), f"-port={port}", *self._args],
            env=env, stdout=subprocess.PIPE, check=True, start_new_session=True)
        pid = int(shell.stdout)
        me = ProcessIdentity.of(pid)
        self.record = ClientRecord(pid, port, me.start_ticks if me else -1)
        self.adopted = False
        write_own_file(self._path, json.dumps(asdict(self.record)).encode())
        deadline = time.monotonic() + timeout_s
        while not listening(self.host, port):
            # exists(), not running(): the launching shell may not have exec'd yet
            if not self.record.exists() or time.monotonic() > deadline:
                self._kill()
                raise RuntimeError(f"mooncake_client did not start on {self.host}:{port}; "
                                   f"see {self._log}")
            time.sleep(0.05)

    def alive(self) -> bool:
        """True while the process runs."""
        return self.record is not None and self.record.running()

    def watch(self, on_restart: Callable[[], None], period_s: float = 0.5) -> None:
        """Start the supervising thread (see the class docstring)."""
        self._thread = threading.Thread(target=self._watch, args=(on_restart, period_s),
                                        name="raykv-mooncake-client", daemon=True)
        self._thread.start()

    def _watch(self, on_restart: Callable[[], None], period_s: float) -> None:
        while not self._stop.wait(period_s):
            if not self.alive():
                self.down.set()
                log.warning("mooncake_client pid %s exited; restarting it on port %s",
                            self.record.pid, self.record.port)
                try:
                    self._launch(self.record.port, 30.0)
                except Exception:
                    log.exception("restarting mooncake_client failed; trying again")
                    continue
                self.restarts += 1
            if self.down.is_set():
                try:
                    on_restart()
                except Exception:
                    log.exception("re-registering the pools failed; trying again")
                    continue
                self.down.clear()

    def _kill(self) -> None:
        """Stop the recorded process group (also one still between fork and exec)."""
        if self.record is not None and self.record.exists():
            _signal_group(self.record.pid, signal.SIGTERM)
            deadline = time.monotonic() + 5.0
            while self.record.exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            if self.record.exists():
                _signal_group(self.record.pid, signal.SIGKILL)

    def stop(self) -> None:
        """Stop supervising, stop the process group, remove the record (for good)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._kill()
        Path(self._path).unlink(missing_ok=True)

    def info(self) -> ClientProcess:
        """The process as the node's stats show it."""
        return ClientProcess(pid=self.record.pid if self.record else None,
                             port=self.record.port if self.record else None,
                             adopted=self.adopted, restarts=self.restarts,
                             alive=not self.down.is_set() and self.alive())
