"""``sim_check`` through the example engine (``example_engine``): the same requests on
one example engine per node (a real model computing real KV, its own host pool, L3
through its node actor) against the simulator's per-engine host tier and L3.

The example engine keeps its host pool per engine with its own LRU index
(``HostIndex``: the simulator's ``host`` tier, a ``BlockLRU``), not the node's L2 pool,
and puts what it computed to L3 itself before it answers (no write-behind); so this
replay checks the host tier, L3 and placement ``own``, and ``sim_check``'s L2 replay
checks ``L2Index`` and the write-behind.

Each trace block is one page of ``PAGE_TOKENS`` tokens that spell its hash id in base
``VOCAB`` (distinct ids, distinct pages; the engine's chained page hashes are then
prefix-chained as the trace's ids are), and a prompt ends with one more token (the
engine always computes the last token, so every block can be restored). Per request,
before the engine runs: the leading blocks its host pool holds (``HostIndex.prefix``,
what the engine reads first) and the segment of each of the next blocks (``locate``,
nothing leased); after: the pages the engine restored (``Generation.hit_pages``). The
engine's host tier is what it found there; what it restored beyond that came from L3,
own segment or the other node's by ``locate``.
"""

from __future__ import annotations

from collections.abc import Sequence

import ray
from raykv.controllers import StorageConfig
from raykv.controllers.contract import PoolName
from raykv_lab.bench.sim_check_compare import compare, layout, simulate, tally
from raykv_lab.sim.trace import Request

PAGE_TOKENS = 4
VOCAB = 512
TIERS = ("host", "l3_own", "l3_remote")
"""The tiers of this replay (the simulator's names), nearest first."""


def prompt(blocks: Sequence[int]) -> list[int]:
    """The token ids of a request of ``blocks`` (hash ids below ``VOCAB ** PAGE_TOKENS``,
    else ``ValueError``): ``PAGE_TOKENS`` digits per block, then one token."""
    out = []
    for b in blocks:
        if not 0 <= b < VOCAB ** PAGE_TOKENS:
            raise ValueError(f"hash id {b} does not fit {PAGE_TOKENS} tokens")
        out += [(b // VOCAB ** k) % VOCAB for k in range(PAGE_TOKENS)]
    return out + [0]


def replay(cluster, requests: Sequence[Request], host_pages: int, tag: str,
           nodes: int) -> dict:
    """``requests`` one at a time, the ``i``-th on the engine of node ``i`` modulo
    ``nodes`` of ``cluster`` (each with ``host_pages`` pages of host pool, one TP rank,
    a one-layer model of width 64): per request its ``records`` (``node``, ``found``
    blocks per tier of ``TIERS``), ``l3_missing`` (distinct blocks L3 lost by the end),
    ``page_bytes`` (KV bytes of one page, both objects) and ``seconds``."""
    import time

    from raykv.cache_actors.rank.client import CacheClient
    from raykv.example_engine import Engine
    from raykv.example_engine.page_hashes import page_hashes
    from raykv.example_engine.presets import build

    longest = max(len(r.blocks) for r in requests)
    if longest >= host_pages:
        raise ValueError(f"{host_pages} host pages hold no request of {longest} blocks")
    target, _ = build("mha", f"org/sim-check-engine-{tag}", hidden=64, layers=1,
                      head_dim=32, vocab=VOCAB)
    max_tokens = PAGE_TOKENS * (longest + 2)
    node_ids = cluster.node_ids[:nodes]
    # the load guard off: this replay checks what is restorable, not whether a load pays
    engines = [Engine(target, n, page_size=PAGE_TOKENS, max_tokens=max_tokens,
                      host_pages=host_pages, tp_size=1, name=f"sim-check-{tag}-{i}",
                      load_guard="off")
               for i, n in enumerate(node_ids)]
    clients = [CacheClient(StorageConfig(model_name=target.name), node_id=n)
               for n in node_ids]
    try:
        scheme = clients[0].key_scheme
        suffix = scheme.suffixes(PoolName.KV, "mha", ["k", "v"])[0]
        own = [c.health()["segment"] for c in clients]

        def where(i: int, hashes: list[str]) -> list[list[str]]:
            keys = [scheme.prefix + h + suffix for h in hashes]
            if not keys:
                return []
            claim = clients[i].owner_claim(node_ids[i], "locate", keys)
            return ray.get(cluster.node_actors[node_ids[i]].locate.remote(keys, claim))

        records = []
        t = time.perf_counter()
        for i, r in enumerate(requests):
            e = i % nodes
            tokens = prompt(r.blocks)
            hashes = page_hashes(tokens, PAGE_TOKENS)
            host = engines[e].kv_index.prefix(hashes)
            segs = where(e, hashes[host:])
            gen = engines[e].generate(tokens, 1, speculate=False)
            from_l3 = [own[e] in s for s in segs[:gen.hit_pages - host]]
            records.append({"node": e, "found": {
                "host": min(host, gen.hit_pages), "l3_own": sum(from_l3),
                "l3_remote": len(from_l3) - sum(from_l3)}})
        seconds = time.perf_counter() - t
        distinct = sorted({h for r in requests for h in page_hashes(prompt(r.blocks),
                                                                    PAGE_TOKENS)})
        missing = sum(not s for s in where(0, distinct))
        return {"records": records, "l3_missing": missing, "seconds": round(seconds, 2),
                "page_bytes": engines[0].page_bytes["kv"]}
    finally:
        for c in clients:
            c.close()
        for eng in engines:
            for rank in eng.ranks:
                ray.kill(rank)


def check(cluster, requests: Sequence[Request], host_pages: int, segment_bytes: int,
          tag: str, nodes: int, sim_host_pages: Sequence[int] = ()) -> dict:
    """``replay`` on ``cluster`` (segments of ``segment_bytes``, placement ``own``) and
    the simulator on the same ``requests`` (``nodes`` engines with a host tier of
    ``host_pages`` each, no L2): both sides' figures, their ``compare``, and the
    simulator again at each of ``sim_host_pages`` (controls)."""
    real = replay(cluster, requests, host_pages, tag, nodes)
    l3_blocks = segment_bytes // real["page_bytes"]
    sim, sim_stats = simulate(requests, layout(nodes, 0, l3_blocks, host_blocks=host_pages))
    found = tally(requests, real["records"], nodes, "found")
    controls = {}
    for pages in sim_host_pages:
        other, _ = simulate(requests, layout(nodes, 0, l3_blocks, host_blocks=pages))
        controls[str(pages)] = compare(found, other, TIERS)
    return {"host_pages": host_pages, "l3_blocks_per_node": l3_blocks,
            "page_bytes": real["page_bytes"], "found": compare(found, sim, TIERS),
            "real": {"found": found, "l3_missing": real["l3_missing"],
                     "seconds": real["seconds"]},
            "sim": {**sim, "stats": sim_stats}, "sim_controls": controls}
