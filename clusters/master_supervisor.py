"""``MasterSupervisor``: runs ``mooncake_master`` and its metadata server on the head node
(``MooncakeMaster``) and restarts either if it dies, on the same ports, so clients'
addresses stay valid."""

from __future__ import annotations

import logging
import threading

import ray
from raykv.clusters.mooncake_master import MooncakeMaster

log = logging.getLogger(__name__)


@ray.remote(num_cpus=0, max_restarts=-1)
class MasterSupervisor:
    """Owns one master process (on ``rpc_port`` and ``http_port``, 0: free ones); checks
    it every ``period_s`` seconds."""

    def __init__(self, host: str, extra_args: list[str] | None = None,
                 period_s: float = 1.0, rpc_port: int = 0, http_port: int = 0) -> None:
        self._master = MooncakeMaster(host, extra_args=extra_args, rpc_port=rpc_port,
                                      http_port=http_port).start()
        self.restarts = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, args=(period_s,), daemon=True)
        self._thread.start()

    def _watch(self, period_s: float) -> None:
        while not self._stop.wait(period_s):
            if not self._master.alive():
                log.warning("mooncake_master or its metadata server exited; restarting it "
                            "on the same ports")
                self._master.restart()
                self.restarts += 1

    def addresses(self) -> dict:
        """``master_address``, ``metadata_server``, the pids of the master and of the
        metadata server, the restart count and ``exposed``: each listening socket of
        theirs bound beyond where it should be (``MooncakeMaster.check_doors``), as
        ``"process address:port"``, at the last start."""
        master = self._master
        return {"master_address": master.master_address,
                "metadata_server": master.metadata_server,
                "pid": master.proc.pid if master.proc else None,
                "metadata_pid": master.metadata_proc.pid if master.metadata_proc else None,
                "restarts": self.restarts,
                "exposed": [f"{name} {x}" for name, x in master.exposed]}

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self._master.stop()
