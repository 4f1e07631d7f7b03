"""Runs in each node's cache actor: the node's pools, its Mooncake client, the transfer
merger, group queries, and the actor shell over them."""
