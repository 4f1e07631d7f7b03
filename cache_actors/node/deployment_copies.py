"""The node actor's copies of deployments, for the group queries it answers (pure).

A home node answers a group's queries from its copy of the group's ``Deployment``; a
query that names a newer version than the copy (or a deployment not copied yet) has
it fetched from the controller first. A rank's registration has it fetched before
(the node actor's ``copy_deployment``), so the group's first query finds it. Single-key
reads and writes of a dict, atomic under the GIL: any thread may call; a missing or
older copy only costs a fetch.
"""

from __future__ import annotations

from collections.abc import Callable

from raykv.cache_actors.errors import DeadlineExceededError
from raykv.controllers.deployments import Deployment


class DeploymentCopies:
    """Copies of deployments by id. ``fetch(id)``: the controller's current copy
    (``ValueError`` if it does not know it, ``TimeoutError`` if it does not answer in
    time); ``on_fetch()`` is told of each fetch that answered."""

    def __init__(self, fetch: Callable[[str], Deployment],
                 on_fetch: Callable[[], None] = lambda: None) -> None:
        self._fetch = fetch
        self._on_fetch = on_fetch
        self._copies: dict[str, Deployment] = {}

    def known(self, deployment_id: str, version: int) -> Deployment | None:
        """The copy here of the deployment, if it is at ``version`` or later."""
        dep = self._copies.get(deployment_id)
        return dep if dep is not None and dep.version >= version else None

    def get(self, deployment_id: str, version: int) -> Deployment:
        """The deployment at ``version`` or later, fetched when the copy here is missing
        or older; ``ValueError`` if the controller does not know it,
        ``DeadlineExceededError`` if it does not answer in time."""
        dep = self.known(deployment_id, version)
        if dep is None:
            try:
                dep = self._fetch(deployment_id)
            except TimeoutError:
                raise DeadlineExceededError(
                    f"the controller did not hand over deployment {deployment_id!r} in "
                    "time") from None
            self._on_fetch()
            self._copies[deployment_id] = dep
        return dep
