"""Runs a real ``mooncake_master`` and the HTTP metadata server of its clients as child
processes, each listening only where it should (``MooncakeMaster``)."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from raykv.cache_actors.listeners import Listener, addresses_of, exposed, listeners
from raykv.cache_actors.local_ports import free_port, listening

log = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In the child: get SIGTERM when the process that started it dies (Linux), so a
    crashed driver or supervisor never leaves a master behind."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def master_binary() -> str:
    """Path of the ``mooncake_master`` executable shipped inside the mooncake wheel."""
    import mooncake

    path = Path(mooncake.__file__).parent / "mooncake_master"
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: install mooncake-transfer-engine-non-cuda "
                                "(CPU) or mooncake-transfer-engine (CUDA)")
    return str(path)


DEFAULT_LEASE_TTL_S = 10.0  # mooncake_master's -default_kv_lease_ttl in 0.3.13
_UNITS = {"ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def lease_ttl_s(master_args: Sequence[str]) -> float:
    """The object lease (seconds) a master started with ``master_args`` grants:
    ``-default_kv_lease_ttl`` (raw milliseconds or a duration with ms/s/m/h), else
    Mooncake's default."""
    value = None
    for arg in master_args:
        name, _, v = arg.lstrip("-").partition("=")
        if name == "default_kv_lease_ttl":
            value = v.strip()
    if value is None:
        return DEFAULT_LEASE_TTL_S
    for unit, seconds in _UNITS.items():  # "ms" before "s" and "m"
        if value.endswith(unit) and value[:-len(unit)].replace(".", "", 1).isdigit():
            return float(value[:-len(unit)]) * seconds
    if value.isdigit():
        return int(value) / 1000
    raise ValueError(f"cannot read -default_kv_lease_ttl={value!r}")


def check_confirm_ttl(confirm_ttl_s: float, master_args: Sequence[str]) -> None:
    """``ValueError`` unless group queries would trust confirmations for less than
    the master's object lease (see ``controllers.confirmed_pages``)."""
    lease = lease_ttl_s(master_args)
    if confirm_ttl_s >= lease:
        raise ValueError(f"confirm_ttl_s={confirm_ttl_s} must be below the master's object "
                         f"lease ({lease} s, -default_kv_lease_ttl); lower it or 0 to turn "
                         "confirmations off")


METRICS_HOST = "127.0.0.1"
"""Where the master's metrics/admin HTTP server listens: it lists every key
(``/get_all_keys``) and answers for any (``/query_key``), so never beyond loopback."""


class MooncakeMaster:
    """One ``mooncake_master`` on ``host`` and the HTTP metadata server its clients use,
    each in its own process group.

    ``master_address`` is ``host:rpc_port``; ``metadata_server`` is the URL clients pass
    to ``setup``. ``rpc_port`` and ``http_port`` (the metadata server's) are the ports
    they listen on, 0: a free one each. ``extra_args`` are passed to the master (e.g.
    ``["-default_kv_lease_ttl=500"]``).

    Doors: the master's RPC port and the metadata server listen on ``host`` alone, the
    master's metrics/admin server (a free port, ``metrics_port``) on ``METRICS_HOST``.
    The master's own HTTP metadata server stays off: Mooncake 0.3.13 binds it to every
    interface whatever ``-http_metadata_server_host`` says; Mooncake's Python metadata
    server (``mooncake.http_metadata_server``, same wheel, same protocol) runs instead,
    bound to ``host``. After each start, ``exposed`` lists every listening socket of
    either process bound beyond that (one warning each, naming the port).
    """

    def __init__(self, host: str = "127.0.0.1", extra_args: list[str] | None = None,
                 log_dir: str | None = None, rpc_port: int = 0, http_port: int = 0) -> None:
        self.host = host
        self.extra_args = list(extra_args or [])
        log_dir = Path(log_dir or tempfile.mkdtemp(prefix="raykv-master-"))
        self.log_path = log_dir / "master.log"
        self.metadata_log_path = log_dir / "metadata.log"
        self.proc: subprocess.Popen | None = None
        self.metadata_proc: subprocess.Popen | None = None
        self._ports = (rpc_port, http_port)
        self.rpc_port = self.http_port = self.metrics_port = 0
        self.exposed: list[tuple[str, Listener]] = []

    @property
    def master_address(self) -> str:
        return f"{self.host}:{self.rpc_port}"

    @property
    def metadata_server(self) -> str:
        return f"http://{self.host}:{self.http_port}/metadata"

    def start(self, timeout_s: float = 30.0, attempts: int = 3) -> MooncakeMaster:
        """Start both and wait until their ports accept, each listened on by its own
        process; free ports are picked again when one was taken meanwhile (given ports
        are tried once)."""
        if all(self._ports):
            attempts = 1
        for _ in range(attempts):
            self.rpc_port, self.http_port = (port or free_port(self.host)
                                             for port in self._ports)
            self.metrics_port = free_port(METRICS_HOST)
            if self._launch(timeout_s):
                return self
        raise RuntimeError(f"mooncake_master did not start on {self.host} ports "
                           f"{self.rpc_port}, {self.http_port}; see {self.log_path} and "
                           f"{self.metadata_log_path}")

    def restart(self, timeout_s: float = 30.0) -> None:
        """Start again, on the same ports, whichever of the two processes died."""
        if not self._launch(timeout_s):
            raise RuntimeError(f"mooncake_master did not restart; see {self.log_path} and "
                               f"{self.metadata_log_path}")

    def master_command(self) -> list[str]:
        """The master's command line (``extra_args`` last, so they win)."""
        return [master_binary(), f"-rpc_port={self.rpc_port}", f"-rpc_address={self.host}",
                "-enable_http_metadata_server=false", f"-metrics_host={METRICS_HOST}",
                f"-metrics_port={self.metrics_port}", *self.extra_args]

    @property
    def metrics_url(self) -> str:
        """Where the master serves its Prometheus text (on ``METRICS_HOST``: its own
        machine alone reads it)."""
        return f"http://{METRICS_HOST}:{self._metrics_port()}/metrics"

    def _metrics_port(self) -> int:
        """The master's metrics port: ``metrics_port``, or the one ``extra_args`` give."""
        port = self.metrics_port
        for arg in self.extra_args:
            name, _, value = arg.lstrip("-").partition("=")
            if name == "metrics_port" and value.isdigit():
                port = int(value)
        return port

    def metadata_command(self) -> list[str]:
        return [sys.executable, "-m", "mooncake.http_metadata_server", "--host", self.host,
                "--port", str(self.http_port), "--log-level", "WARNING"]

    def _launch(self, timeout_s: float) -> bool:
        if not _running(self.proc):
            self.proc = _spawn(self.master_command(), self.log_path)
        if not _running(self.metadata_proc):
            self.metadata_proc = _spawn(self.metadata_command(), self.metadata_log_path)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.alive():
            if self._serving():
                self.exposed = self.check_doors()
                return True
            time.sleep(0.05)
        self.stop()
        return False

    def _serving(self) -> bool:
        """Whether each port accepts connections and is listened on by its own process
        (the RPC and metrics ports by the master, the HTTP port by the metadata server),
        not by another process holding it while ours failed to bind."""
        for proc, host, port in ((self.proc, self.host, self.rpc_port),
                                 (self.proc, METRICS_HOST, self._metrics_port()),
                                 (self.metadata_proc, self.host, self.http_port)):
            if not listening(host, port):
                return False
            try:
                if port not in {x.port for x in listeners(proc.pid)}:
                    return False
            except OSError:  # it exited meanwhile
                return False
        return True

    def check_doors(self) -> list[tuple[str, Listener]]:
        """Every listening socket of the master or the metadata server bound beyond
        where it should be (the metrics port: ``METRICS_HOST``; the others: ``host``, or
        loopback), as (process, listener); a warning names each."""
        near = addresses_of(self.host) | {METRICS_HOST}
        wide = []
        for name, proc in (("mooncake_master", self.proc),
                           ("metadata server", self.metadata_proc)):
            for x in listeners(proc.pid):
                metrics = proc is self.proc and x.port == self._metrics_port()
                if exposed([x], {METRICS_HOST} if metrics else near):
                    wide.append((name, x))
                    log.warning("%s (pid %s) listens on %s, beyond %s: whoever reaches this "
                                "machine on port %s can list, read or remove the store's "
                                "keys; bind it narrower or firewall that port "
                                "(docs/deploy.md, Ports)", name, proc.pid, x,
                                METRICS_HOST if metrics else self.host, x.port)
        return wide

    def alive(self) -> bool:
        """True while both processes run."""
        return _running(self.proc) and _running(self.metadata_proc)

    def stop(self, timeout_s: float = 5.0) -> None:
        """SIGTERM both process groups, SIGKILL after ``timeout_s``."""
        for proc in (self.proc, self.metadata_proc):
            if proc is not None:
                _stop(proc, timeout_s)
        self.proc = self.metadata_proc = None


def _running(proc: subprocess.Popen | None) -> bool:
    return proc is not None and proc.poll() is None


def _spawn(cmd: list[str], log_path: Path) -> subprocess.Popen:
    """``cmd`` in a session of its own that dies with this process, logging to
    ``log_path``."""
    with open(log_path, "ab") as log_file:
        return subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True,
                                preexec_fn=_die_with_parent)


def _stop(proc: subprocess.Popen, timeout_s: float) -> None:
    """SIGTERM ``proc``'s process group, SIGKILL after ``timeout_s``."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
