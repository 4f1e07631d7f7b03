"""Runs in each node actor: the node's pools, its Mooncake client, the transfer
merger, group queries, and the actor shell over them."""
