"""``MasterSupervisor``: runs ``mooncake_master`` and its metadata server on the head node
(``MooncakeMaster``) and restarts either if it dies, on the same ports, so clients'
addresses stay valid. A restart that fails (a port still taken, a start too slow) is
tried again with bounded exponential back-off (``restart_backoff``), never given up;
``addresses`` says which state the supervisor is in, as ``raykv status`` shows. The
ports it chose are recorded in the GCS (``ports_key``): when the supervisor itself dies
(its master dies with it) and Ray restarts it, the new master listens on the same ports,
so the node actors' master address stays valid."""

from __future__ import annotations

import json
import logging
import threading

import ray
from ray.experimental import internal_kv
from raykv.clusters.mooncake_master import MooncakeMaster
from raykv.clusters.restart_backoff import RestartBackoff

log = logging.getLogger(__name__)

RUNNING = "running"
RESTARTING = "restarting"


def ports_key(namespace: str) -> str:
    """Where the supervisor of ``namespace`` records its master's RPC and HTTP ports."""
    return f"raykv/{namespace}/master_ports"


@ray.remote(num_cpus=0, max_restarts=-1)
class MasterSupervisor:
    """Owns one master process (on ``rpc_port`` and ``http_port``, 0: free ones); checks
    it every ``period_s`` seconds; after a failed restart it tries again after the
    back-off's wait (``first_s`` doubling up to ``cap_s``) instead. Without ports given,
    a supervisor Ray restarted takes the ones recorded (``ports_key``); each start
    records the ones in use. A restarted supervisor whose master cannot start on them
    yet (the master of the one that died still holds them) comes up ``restarting`` and
    retries as after any failed restart; a first start that fails raises."""

    def __init__(self, host: str, extra_args: list[str] | None = None,
                 period_s: float = 1.0, rpc_port: int = 0, http_port: int = 0,
                 first_s: float = 1.0, cap_s: float = 30.0) -> None:
        key = ports_key(ray.get_runtime_context().namespace)
        recorded = internal_kv._internal_kv_get(key)
        restarted = recorded is not None and not (rpc_port or http_port)
        if restarted:
            rpc_port, http_port = json.loads(recorded)
        self.restarts = 0
        self.state = RUNNING
        self._backoff = RestartBackoff(first_s, cap_s)
        self._master = MooncakeMaster(host, extra_args=extra_args, rpc_port=rpc_port,
                                      http_port=http_port)
        wait = period_s
        try:
            self._master.start()
        except RuntimeError as e:
            if not restarted:  # a first start (raykv up): fail loudly
                raise
            # Ray restarted this supervisor, and the master of the one that died may
            # still hold the recorded ports: raising here would end supervision for good
            # (Ray never restarts an actor whose constructor raised), so the watch retries
            self.state = RESTARTING
            wait = self._backoff.failed(f"{type(e).__name__}: {e}")
            log.warning("starting mooncake_master on its recorded ports failed: %s; trying "
                        "again in %.0f s", e, wait)
        internal_kv._internal_kv_put(
            key, json.dumps([self._master.rpc_port, self._master.http_port]), overwrite=True)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, args=(period_s, wait),
                                        daemon=True)
        self._thread.start()

    def _watch(self, period_s: float, wait: float) -> None:
        """Every ``period_s`` (the first look after ``wait``): restart the master if it
        is not alive, after a failed restart again once the back-off's wait passed."""
        while not self._stop.wait(wait):
            wait = period_s
            if self._master.alive():
                continue
            if self.state == RUNNING:
                log.warning("mooncake_master or its metadata server exited; restarting it "
                            "on the same ports")
                self.state = RESTARTING
            try:
                self._master.restart()
            except Exception as e:  # noqa: BLE001 - whatever it was, try again later
                wait = self._backoff.failed(f"{type(e).__name__}: {e}")
                log.warning("restarting mooncake_master failed (%d in a row): %s; trying "
                            "again in %.0f s", self._backoff.attempts, e, wait)
                continue
            self._backoff.succeeded()
            self.state = RUNNING
            self.restarts += 1

    def addresses(self) -> dict:
        """``master_address``, ``metadata_server``, the pids of the master and of the
        metadata server (None while down), the restart count, ``exposed``: each
        listening socket of theirs bound beyond where it should be
        (``MooncakeMaster.check_doors``), as ``"process address:port"``, at the last
        start; and the supervisor's ``state`` (``running``, or ``restarting`` from the
        moment it found a process dead until a restart worked), ``attempts`` (failed
        restarts in a row, 0 once one worked) and ``last_error`` (of the last failed
        restart, None if none failed); ``metrics_url``: the master's Prometheus text,
        readable on the head node alone."""
        master = self._master
        proc, metadata_proc = master.proc, master.metadata_proc
        return {"master_address": master.master_address,
                "metadata_server": master.metadata_server,
                "metrics_url": master.metrics_url,
                "pid": proc.pid if proc else None,
                "metadata_pid": metadata_proc.pid if metadata_proc else None,
                "restarts": self.restarts,
                "exposed": [f"{name} {x}" for name, x in master.exposed],
                "state": self.state, "attempts": self._backoff.attempts,
                "last_error": self._backoff.last_error}

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self._master.stop()
