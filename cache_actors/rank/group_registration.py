"""A rank's registration with the controller, and the group hit query it enables.

The controller keeps every deployment's ranks and pools; registering hands the rank
its key scheme and names the group's *home node*, whose node actor answers the group's
existence queries (``cache_actors.node.group_queries``). A rank registers again whenever its
registered pools changed or the link re-attached (the controller or the home node may
have moved).

Registering also readies the rank's lookup home for the group's first query: that
node's actor copies the deployment from the controller now (``copy_deployment``) and
the route to it is opened (``NodeRoute.prepare``), so the first query, like every
later one, is one data op and no controller call. An engine that registers when it
starts (``CacheClient.register_deployment``) keeps all of it off its requests' path.
"""

from __future__ import annotations

import logging

from raykv.cache_actors.data_ops import DataOp
from raykv.cache_actors.errors import NodeUnavailableError
from raykv.cache_actors.rank.node_route import NodeRoute
from raykv.controllers.contract import PoolTransferResult, StorageConfig
from raykv.controllers.deployments import PoolQuery, PoolSpec, Registration
from raykv.controllers.keys import KeyScheme

log = logging.getLogger(__name__)


class GroupRegistration:
    """The registration of one rank (``config``, on ``link``'s node). ``key_scheme``:
    the rank's key scheme, from its config until a registration hands back the
    controller's."""

    def __init__(self, link: NodeRoute, config: StorageConfig) -> None:
        self._link = link
        self.config = config
        self.key_scheme = KeyScheme.from_config(config)
        self._current: tuple[Registration, tuple[PoolSpec, ...]] | None = None

    def register(self, specs: tuple[PoolSpec, ...]) -> Registration:
        """Register this rank with pools ``specs``; ``ValueError`` if the rank
        contradicts what its group registered (parallel sizes, MLA flag, pool kinds), or
        its tenant's owner key is not the one the controller bound. A tenant's rank
        signs the controller's fresh challenge first (``RankOwner.registration_proof``).
        Then the lookup home is readied (module docstring): best effort, a home that
        cannot be reached now (``NodeUnavailableError``) is logged and left to the first
        query."""
        owner = self._link.owner
        proof = None if owner is None else owner.registration_proof(self._link.ask_controller)
        reg = self._link.ask_controller("register_rank", self.config, list(specs),
                                        self._link.node_id, proof)
        self._current = (reg, specs)
        self.key_scheme = reg.key_scheme
        try:  # ready the lookup home; one that cannot be reached now is by the query
            self._link.ask_at(reg.home_node, "copy_deployment", reg.deployment_id,
                              reg.version)
            self._link.prepare(reg.home_node)
        except NodeUnavailableError as e:
            log.info("raykv: the lookup home %s is not ready for group queries (%s); the "
                     "first one readies it", reg.home_node[:12], e)
        return reg

    def outdated(self, specs: tuple[PoolSpec, ...]) -> bool:
        """Whether a group query must register first: never registered, the link
        re-attached since, or the registered pools are not ``specs``."""
        return (not self._link.controller_attached or self._current is None
                or self._current[1] != specs)

    def exists(self, keys: list[str], queries: list[PoolQuery]) -> PoolTransferResult:
        """The group's hit for page ``keys`` and extra pools ``queries``, answered by the
        home node's actor (call after ``register``; see ``outdated``)."""
        assert self._current is not None, "register before a group query"
        reg = self._current[0]
        return self._link.data(DataOp.GROUP_EXISTS, reg.deployment_id, reg.version,
                               (self.config.tp_rank, self.config.pp_rank),
                               self.config.engine_id or "", keys, queries,
                               node_id=reg.home_node)
