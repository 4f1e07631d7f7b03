"""Runs a real ``mooncake_master`` (with its HTTP metadata server) as a child process."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from raykv.cache_actors.local_ports import free_port, listening

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


class MooncakeMaster:
    """One ``mooncake_master`` on ``host``, in its own process group.

    ``master_address`` is ``host:rpc_port``; ``metadata_server`` is the URL clients pass
    to ``setup``. ``rpc_port`` and ``http_port`` (its HTTP metadata server) are the ports
    it listens on, 0: a free one each (its metrics port is always a free one).
    ``extra_args`` are passed through (e.g. ``["-default_kv_lease_ttl=500"]``).
    """

    def __init__(self, host: str = "127.0.0.1", extra_args: list[str] | None = None,
                 log_dir: str | None = None, rpc_port: int = 0, http_port: int = 0) -> None:
        self.host = host
        self.extra_args = list(extra_args or [])
        self.log_path = Path(log_dir or tempfile.mkdtemp(prefix="raykv-master-")) / "master.log"
        self.proc: subprocess.Popen | None = None
        self._ports = (rpc_port, http_port)
        self.rpc_port = self.http_port = 0

    @property
    def master_address(self) -> str:
        return f"{self.host}:{self.rpc_port}"

    @property
    def metadata_server(self) -> str:
        return f"http://{self.host}:{self.http_port}/metadata"

    def start(self, timeout_s: float = 30.0, attempts: int = 3) -> MooncakeMaster:
        """Start and wait until both ports accept; free ports are picked again when one
        was taken meanwhile (given ports are tried once)."""
        if all(self._ports):
            attempts = 1
        for _ in range(attempts):
            self.rpc_port, self.http_port = (port or free_port(self.host)
                                             for port in self._ports)
            if self._launch(timeout_s):
                return self
        raise RuntimeError(f"mooncake_master did not start on {self.host} ports "
                           f"{self.rpc_port}, {self.http_port}; see {self.log_path}")

    def restart(self, timeout_s: float = 30.0) -> None:
        """Start again on the same ports (after the process died)."""
        self.stop()
        if not self._launch(timeout_s):
            raise RuntimeError(f"mooncake_master did not restart; see {self.log_path}")

    def _launch(self, timeout_s: float) -> bool:
        cmd = [master_binary(), f"-rpc_port={self.rpc_port}", f"-rpc_address={self.host}",
               "-enable_http_metadata_server=true",
               f"-http_metadata_server_host={self.host}",
               f"-http_metadata_server_port={self.http_port}",
               f"-metrics_port={free_port(self.host)}", *self.extra_args]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True,
                                         preexec_fn=_die_with_parent)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.proc.poll() is None:
            if listening(self.host, self.rpc_port) and listening(self.host, self.http_port):
                return True
            time.sleep(0.05)
        self.stop()
        return False

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout_s: float = 5.0) -> None:
        """SIGTERM the master's process group, SIGKILL after ``timeout_s``."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.proc = None
