"""Names shared by every raykv process: the Ray namespace and the named actors."""

NAMESPACE = "raykv"
CONTROLLER_NAME = "raykv-controller"


def node_actor_name(node_id: str) -> str:
    """Name of the cache actor of the Ray node ``node_id`` (hex) in ``NAMESPACE``."""
    return f"raykv-node-{node_id}"
