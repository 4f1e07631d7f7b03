"""The errors a rank sees from its node actor that it acts on by type: the retryable
ones while the node's cache is (re)starting, and a pool the node does not have."""


class UnknownPoolError(ValueError):
    """A call names a pool the node actor does not have: never created, destroyed, or
    gone with a restart of the actor (its host pools, zero-copy engine pools and L2
    pools live as long as it does). Not retryable as it is: the caller opens or adopts
    the pool again (vLLM's L2 reopens, SGLang's backend adopts its pools again)."""


class NodeUnavailableError(RuntimeError):
    """The node actor is down or restarting. Retryable: call again later."""


class StoreUnavailableError(NodeUnavailableError):
    """The node's ``mooncake_client`` (standalone mode) is down; its node actor restarts
    it. Retryable."""


class StalePoolsError(NodeUnavailableError):
    """The node actor allocated its pools anew (standalone mode, after a restart); the
    caller's mappings are of the old memory. The client re-maps; retry the call."""


class DeadlineExceededError(NodeUnavailableError):
    """A call to the node actor did not finish within its deadline (the actor is hung,
    stopped or overloaded, or a store call is stuck). Retryable: nothing was reported
    stored or read by that call."""


class CircuitOpenError(NodeUnavailableError):
    """The rank's circuit breaker on this node actor is open: its last data calls ran
    into their deadlines, so this one failed at once without reaching it (no wait). A
    probe watches the actor and lets calls through again once it answers. Retryable."""


class QuarantinedPagesError(NodeUnavailableError):
    """The staging pages this call needs are still named by an earlier put or get of
    this rank that returned at its deadline while its store call ran on (the node actor
    holds its ticket): the call failed at once, before any byte moved. Retryable once
    that store call ended (``cache_actors.rank.quarantine``)."""
