"""Retryable errors a rank sees while its node's cache is (re)starting."""


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
