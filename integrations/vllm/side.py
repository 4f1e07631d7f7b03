"""What both sides of raykv's vLLM connector share (no vLLM import): the options, the
engine geometry, the counters, and this process's raykv client with its registered
host pool, attached at start-up or, when raykv was not reachable then, in the
background, which no call of vLLM's scheduler or step waits for."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

from raykv.cache_actors.errors import NodeUnavailableError
from raykv.cache_actors.throttled_log import ThrottledLog
from raykv.controllers.contract import StorageConfig
from raykv.controllers.deployments import deployment_id
from raykv.integrations.ray_join import join_ray
from raykv.integrations.vllm.connector_metrics import ConnectorMetrics
from raykv.integrations.vllm.connector_stats import ConnectorStats
from raykv.integrations.vllm.load_times import LoadTimes
from raykv.integrations.vllm.options import ConnectorOptions

if TYPE_CHECKING:
    from raykv.cache_actors.host_pools import HostPool
    from raykv.cache_actors.rank.client import CacheClient

log = logging.getLogger("vllm." + __name__)  # shows up with vLLM's own log lines

ATTACH_RETRY_S = 5.0
"""The least time between two background attaches (``ConnectorSide._cache``): a join
that fails at once is not retried on every step."""


class ConnectorSide(ABC):
    """One side of the connector in one process: the scheduler side (one per engine) or
    the worker side (one per TP rank). Subclasses say what they register as the KV pool
    (``_register``). Every method runs on the vLLM thread that calls the connector,
    except ``_attach_in_background``, on the attach thread ``_cache`` starts."""

    ROLE = "side"
    """The side's ``role`` label of its Ray metric (``connector_metrics``)."""

    def __init__(self, opts: ConnectorOptions, *, block_size: int, tp_rank: int, tp_size: int,
                 pp_rank: int, pp_size: int) -> None:
        self.opts = opts
        self.block_size = block_size  # tokens per vLLM block
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.pp_rank, self.pp_size = pp_rank, pp_size
        self.stats = ConnectorStats()  # this side's counters, counted on vLLM's threads
        self.loads = LoadTimes()  # the worker's loads, exported with the counters
        self._warn = ThrottledLog(log)  # once per kind per WARN_EVERY_S (30 s)
        self._client: CacheClient | None = None
        self._pool: HostPool | None = None
        self._attaching: threading.Thread | None = None
        self._attach_error: Exception | None = None
        self._next_attach = 0.0  # time.monotonic() from which _cache may attach again
        self._metrics: ConnectorMetrics | None = None
        self._closed = False  # shut down: an attach that ends later lets go of its client
        self._publish = threading.Lock()  # an attach's publication against ``shutdown``

    @abstractmethod
    def _register(self, client: CacheClient, name: str) -> HostPool | None:
        """Register this side's KV pool with ``client``: the host pool it made for it
        (named ``name``; ``shutdown`` destroys it), or None where it registered a
        geometry alone."""

    def _storage_config(self) -> StorageConfig:
        return self.opts.storage_config(tp_rank=self.tp_rank, tp_size=self.tp_size,
                                        pp_rank=self.pp_rank, pp_size=self.pp_size)

    def _attach(self) -> None:
        """Make this process's ``CacheClient`` and its registered pool (raises what the
        client raises). Its calls to the node actor are control calls (deadline
        ``CONTROL_TIMEOUT_S``, 120 s), so this runs at start-up (the scheduler's
        construction, ``register_kv_caches``) or on ``_cache``'s background thread,
        never on vLLM's step. One that ends after ``shutdown`` destroys its pool, closes
        its client and raises ``NodeUnavailableError``: nothing outlives the side."""
        from raykv.cache_actors.rank.client import CacheClient

        node_id = join_ray(self.opts.ray_address, self.opts.namespace)
        client = CacheClient(self._storage_config(), node_id=node_id,
                             namespace=self.opts.namespace)
        try:
            pool = self._register(client, f"vllm-{uuid.uuid4().hex[:12]}")
        except BaseException:
            client.close()
            raise
        with self._publish:
            closed = self._closed
            if not closed:
                self._pool = pool  # first: a caller that sees the client uses the pool
                self._client = client
                if self._metrics is None:  # in the Ray cluster now: its counters exported
                    self._metrics = ConnectorMetrics(self.stats, {
                        "role": self.ROLE, "tp_rank": str(self.tp_rank),
                        "model": self.opts.model_name}, owner={
                        "tenant": self.opts.tenant or "(none)",
                        "deployment": deployment_id(self._storage_config())},
                        loads=self.loads)
        if closed:  # ``shutdown`` ran meanwhile: nobody would destroy or close them
            if pool is not None:
                with contextlib.suppress(Exception):
                    client.destroy_host_pool(pool)
            with contextlib.suppress(Exception):
                client.close()
            raise NodeUnavailableError("the connector shut down while it attached to raykv")

    def _attach_at_start(self) -> None:
        try:
            self._attach()
        except Exception as e:  # raykv may come up later: retried on first use
            self._warn.warn("attach", "RayKVConnector: raykv not reachable yet (%s); "
                            "lookups miss, loads fail and saves are skipped until it is", e)

    def _attach_in_background(self) -> None:
        try:
            self._attach()
        except Exception as e:
            self._attach_error = e

    def _cache(self) -> CacheClient:
        """This process's ``CacheClient``; ``NodeUnavailableError`` at once while there
        is none (callers turn it into misses, failed loads and skipped saves). If
        start-up did not attach, a background thread attaches (one at a time, started at
        most once per ``ATTACH_RETRY_S``) and no call waits for it: a join that fails or
        hangs (a cluster that refuses this process's Ray credentials, an address where
        no Ray answers, a stopped node actor) costs vLLM's requests misses, never a
        stalled scheduler or step. The first call after it attached uses the client.
        After ``shutdown`` no attach starts."""
        if self._client is not None:
            return self._client
        now = time.monotonic()
        idle = self._attaching is None or not self._attaching.is_alive()
        if idle and now >= self._next_attach and not self._closed:
            self._attach_error = None
            self._next_attach = now + ATTACH_RETRY_S
            self._attaching = threading.Thread(target=self._attach_in_background,
                                               name="raykv-attach", daemon=True)
            self._attaching.start()
        if self._client is not None:
            return self._client
        raise NodeUnavailableError(
            f"raykv is not attached yet ({self._attach_error or 'attaching'}); "
            "attaching in the background")

    def settle(self) -> None:
        """End what this side runs behind vLLM's steps and count it (the worker: its
        last step's L2 save); nothing on the scheduler side."""
        return None

    def shutdown(self) -> None:
        """Destroy this side's pool, close its client and export its counters a last
        time (never raises)."""
        with self._publish:  # an attach that ends from now on lets go of what it made
            self._closed = True
            client, pool = self._client, self._pool
            self._client = self._pool = None
        if self._metrics is not None:
            with contextlib.suppress(Exception):
                self._metrics.close()
        if client is None:
            return
        if pool is not None:
            with contextlib.suppress(Exception):
                client.destroy_host_pool(pool)
        with contextlib.suppress(Exception):
            client.close()
