"""Runs in each node actor: the node's pools, its Mooncake client, the transfer
merger, group queries, the local channel's server, and the actor shell over them."""
