"""``NodeRoute``: a rank's route to the raykv actors, as its parts use it.

``NodeLink`` is the one product implementation (data ops over the local channel when
the node actor runs on this node, else through Ray; control calls through Ray); the
client's parts (``PoolLifecycle``, ``GroupRegistration``, ``L2Link``, ``PointerCalls``)
see only this Protocol, and the unit tests hand them the shared fake
(tests/unit/fakes.py), which a unit test keeps in step with it. Any thread of the rank
may call; every call has a deadline and fails with a ``NodeUnavailableError`` (retryable:
``DeadlineExceededError``, ``CircuitOpenError``, ...) when the actor cannot answer.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from raykv.cache_actors.data_ops import DataOp
    from raykv.cache_actors.rank.rank_owner import RankOwner
    from raykv.controllers.ownership import OwnerClaim


class NodeRoute(Protocol):
    """The route of one client to its node's actor (``node_id``), other nodes' actors
    and the controller. ``owner``: the client's owner (None: no claims). ``stale``: the
    actors were looked up again since the client last re-mapped its pools (the next
    ``call`` re-maps first; ``ask`` does not)."""

    node_id: str
    owner: RankOwner | None
    stale: bool

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Control ``method`` of this node's actor (pools, health, stats), re-mapping
        first if ``stale``."""
        ...

    def ask(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Control ``method`` of this node's actor without re-mapping first."""
        ...

    def data(self, op: DataOp, *args: Any, node_id: str | None = None) -> Any:
        """Data op ``op`` on the actor of ``node_id`` (default: this node's) within the
        client's data deadline: a put or get (an ``ObjectBatch``) answers one code per
        object (``controllers.result_codes``) and is final when it returns; a lookup of
        names answers one code per name."""
        ...

    def claim(self, node_id: str | None, method: str, *args: object) -> OwnerClaim | None:
        """The owner claim for one call of ``method`` with positional ``args`` to the
        actor of ``node_id`` (None: this node's); None without an owner."""
        ...

    def bounded(self, limit_s: float, what: str) -> contextlib.AbstractContextManager[float]:
        """Run the block's calls within ``limit_s`` seconds (less where the thread's
        budget or the call around them ends sooner); yields the seconds granted."""
        ...

    def ask_at(self, node_id: str, method: str, *args: Any) -> Any:
        """Control ``method`` of the actor of ``node_id`` (this node's or another)."""
        ...

    def prepare(self, node_id: str) -> None:
        """Open the route of data ops to the actor of ``node_id`` now (its channel, or
        its handle and owner session), so that the first one is one round trip."""
        ...

    def ask_controller(self, method: str, *args: Any) -> Any:
        """``method`` of the controller."""
        ...

    @property
    def controller_attached(self) -> bool:
        """False until the controller was reached, and again after a re-attach."""
        ...

    def close(self) -> None:
        """Close the channel (the next local data op opens it again)."""
        ...
