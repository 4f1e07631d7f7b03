"""Runs in the driver's process (``raykv sim``): a trace-driven simulator of a raykv
cluster, pure logic (no Ray, no Mooncake, no torch), on simulated time.

It replays a request trace (Mooncake's JSONL: ``trace``) through raykv's own policy
code: the node's L2 index (``cache_actors.node.l2_index``: LRU, leases, holds,
write-behind's dirty pages), the request router's ranking and spread
(``integrations.serve.ranking``, ``sent_keys``), placement ``own`` / ``any``; the L3
store is a model of Mooncake's documented eviction (``l3_store``), its disk tier one of
Mooncake's SSD offload (``disk``). ``costs`` holds the cost model and where each
default comes from, ``cluster`` the event loop (engines, tiers), ``links`` the queues
bytes wait in, ``scaling`` and ``node_changes`` a node leaving (raykv's drain plan) or
joining (raykv's warm plan), ``bounds`` the untimed references (one global LRU,
unbounded, Belady), ``compare`` the comparisons of one run and its JSON.
"""
