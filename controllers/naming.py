"""Every name raykv processes share: the Ray namespace, the named actors, and the
shared-memory files (pools, their metadata, the local channel's socket, the
``mooncake_client`` record) under ``SHM_DIR``."""

NAMESPACE = "raykv"
CONTROLLER_NAME = "raykv-controller"
RECONCILER_NAME = "raykv-reconciler"
SUPERVISOR_NAME = "raykv-master"  # supervises the mooncake_master raykv runs

SHM_DIR = "/dev/shm"
CHANNEL_SOCKET = "sock"  # a node's local channel: <node shm prefix>sock
CLIENT_RECORD = "@mooncake_client"  # "@" never occurs in a pool name, so never in its files


def node_actor_name(node_id: str) -> str:
    """Name of the node actor of the Ray node ``node_id`` (hex) in ``NAMESPACE``."""
    return f"raykv-node-{node_id}"


def cluster_shm_prefix(cluster_tag: str) -> str:
    """Prefix of every shared-memory file of one raykv cluster."""
    return f"raykv.{cluster_tag}."


def node_shm_prefix(cluster_tag: str, node_id: str) -> str:
    """Prefix of every shared-memory file of one node actor of one raykv cluster: its
    pools ``<prefix><pool>``, their metadata ``<prefix><pool>.json``, the channel's
    socket and the ``mooncake_client`` record. The whole node id: two nodes on one
    machine whose ids share a head (Ray's fake multi-node provider numbers its nodes
    ``ffff...0001``, ``ffff...0002``) must not share files (a channel socket unlinked by
    one node actor's shutdown was the other's)."""
    return f"{cluster_shm_prefix(cluster_tag)}{node_id}."
