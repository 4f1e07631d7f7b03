"""``raykv sim`` against a real cluster: the same requests of the conversation trace
replayed on a real embedded two-node cluster (real Ray, ``mooncake_master``, node
actors) and in the simulator, the blocks each tier served compared per tier. Two
replays: through the nodes' L2 pools (their ``L2Index``, write-behind and Mooncake
placement, driven with the L2 ops of vLLM's connector: this module) and through the
example engine (its own host pool and L3: ``sim_check_engine``).

Run: ``python -m raykv_lab.bench.sim_check [--requests 300] [--l2-pages 256]
[--host-pages 256] [--replays l2,example] [--trace FILE] [--seed 0] [--out FILE]`` (a
two-node embedded cluster of its own; Ray must not be running in this process). Prints
both sides per tier of each replay and writes a JSON.

**The L2 replay.** One engine per node, as vLLM's connector with ``l2_blocks`` drives
its node's L2 (``integrations.vllm.l2_blocks``), made by hand: a ``CacheClient`` on the
node (the driver's process; node 1 over Ray) with the node's L2 pool of ``--l2-pages``
pages of 1 KiB (vLLM layout, 4 tokens a block). Each trace block is one page; its page
hash is the trace's hash id (the trace's ids are prefix-chained, as page hashes are).
Per request, on node ``i`` modulo 2: what the node holds is asked as a router asks it
(``residency``: the leading blocks ready in its L2, nothing leased; ``locate``: the
segment of each of the next blocks L3 holds, leading run), which gives the request's
*found* blocks per tier (L2, L3 on the node's own segment, L3 on the other's); the
load then acquires them with ``fill`` (``L2Link.acquire``: the node reads the L3 ones
into L2 pages), which gives its *loaded* blocks (the leading pages the node handed
over); the save reserves a page for every block of the request and commits the new
ones (``reserve``, ``commit``: the node's write-behind puts them to L3); the replay
waits until the node's write-behind ended (its L2 stats: ``l3_put`` + ``l3_put_failed``
reach ``l3_put_submitted``) before the next request. Counts come from the calls'
answers and the node actors' own stats; the product has no hook for this.

**Its simulated side** (``sim_check_compare``): ``ClusterSim`` on the same requests,
two nodes of one engine each with no GPU cache, the same L2 pages and the segment's
bytes in pages per node, placement ``own``, round robin (the ``i``-th request on engine
``i`` modulo 2, as the real side), requests ``GAP_S`` apart so each starts on a cluster
at rest.

**Made comparable**: one request at a time in trace order on both sides, the same node
for each; the write-behind ended before the next request on both; no lease in force
across requests (leases run in seconds: the real replay takes about 15 ms a request,
so it makes no ``lookup``, whose lease would keep the last ten seconds of requests'
pages from eviction; the simulator's requests are 1,000 s apart,
its leases long over); segments far larger than the sample (Mooncake's own eviction
never runs: checked, every block put is still in L3 at the end); L2 larger than any
request's blocks (no ``FULL`` answer: the simulator puts such blocks to L3, as vLLM's
connector does when it saves on the step, but with ``async_transfers`` it drops them;
counted). The sample is whole conversations
(``conversation_sample``): the trace's first few hundred requests are mostly first
turns and reuse little (8 % of blocks in the first 300, against 31 % in the default
sample).

**What differs**: the simulator counts every found block as loaded. On the real side
a load gets the leading pages the node hands over, and a node's fill from L3
(``L2Pools.acquire`` with ``fill``) ends at the first block its L2 holds after one it
lacks, so a load could get fewer blocks than were found (vLLM's worker recomputes the
rest); ``short_loads`` counts the blocks found but not loaded (0 with ``lru``, 32 of
one request with ``s3fifo`` in the recorded runs: benchmarks.md). The check is on
*found*; *loaded* is compared too. Time is not compared: the
simulator's TTFTs are its cost model's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import ray
from raykv.controllers import StorageConfig
from raykv.controllers.contract import PoolName
from raykv.controllers.pool_layout import PoolLayout
from raykv.controllers.result_codes import FULL, WRITING
from raykv_lab.bench.sim_check_compare import (
    MAX_DIFF_PP,
    TIERS,
    compare,
    conversation_sample,
    layout,
    simulate,
    tally,
)
from raykv_lab.sim.trace import Request, read_trace

TRACE = Path(__file__).resolve().parents[2] / "tests" / "data" / "traces" / \
    "conversation_trace.jsonl"
PAGE = PoolLayout.vllm(page_size=4, size=4, layer_num=2, head_num=1, head_dim=64,
                       dtype="bfloat16", itemsize=2)
"""One trace block as one L2 page and one L3 object: 4 tokens of a 2-layer model, 1 KiB."""
FLUSH_WAIT_S = 30.0
NODES = 2


class NodeEngine:
    """Engine ``index`` on ``node_id`` of ``cluster``: a ``CacheClient`` of ``config``
    there and its node's L2 pool of ``pages`` pages (``ValueError`` if the node gives
    fewer). Called from one thread."""

    def __init__(self, cluster, index: int, node_id: str, config: StorageConfig,
                 pages: int) -> None:
        from raykv.cache_actors.rank.client import CacheClient

        self.index, self.node_id = index, node_id
        self.client = CacheClient(config, node_id=node_id)
        self.actor = cluster.node_actors[node_id]
        self.l2 = self.client.l2()
        pool = self.l2.open(PAGE, pages)
        if pool is None or pool.layout.num_pages != pages:
            raise ValueError(f"node {node_id} gave an L2 pool of "
                             f"{None if pool is None else pool.layout.num_pages} pages, "
                             f"not {pages}")
        self.pool = pool.name
        self.segment = self.client.health()["segment"]
        scheme = self.client.key_scheme
        (self._suffix,) = scheme.suffixes(PoolName.KV, "vllm", ["kv"])
        self._prefix = scheme.prefix
        self.full = 0

    def keys(self, hashes: Sequence[str]) -> list[str]:
        """The object keys of ``hashes`` (L2's and L3's alike; no tenant)."""
        return [self._prefix + h + self._suffix for h in hashes]

    def serve(self, hashes: Sequence[str]) -> dict:
        """One request's lookup, load and save (module docstring): its ``found`` and
        ``loaded`` blocks per tier of ``TIERS``, once the write-behind ended."""
        keys = self.keys(hashes)
        claim = self.client.owner_claim
        res = ray.get(self.actor.residency.remote(keys, 1, claim(self.node_id, "residency",
                                                                 keys, 1)))
        rest = keys[res.l2:]
        where = ray.get(self.actor.locate.remote(rest, claim(self.node_id, "locate", rest))) \
            if rest else []
        in_l3 = ([bool(w) for w in where] + [False]).index(False)
        own = [self.segment in w for w in where[:in_l3]]
        found = {"l2": res.l2, "l3_own": sum(own), "l3_remote": in_l3 - sum(own)}
        n = res.l2 + in_l3
        got = len(self.l2.acquire(self.pool, hashes[:n], True)) if n else 0
        l3 = own[:max(0, got - res.l2)]
        loaded = {"l2": min(got, res.l2), "l3_own": sum(l3), "l3_remote": len(l3) - sum(l3)}
        unique = list(dict.fromkeys(hashes))
        pages = self.l2.reserve(self.pool, unique)
        mine = [i for i, p in enumerate(pages) if p >= 0]
        self.full += sum(p in (FULL, WRITING) for p in pages)
        if mine:
            self.l2.commit(self.pool, [unique[i] for i in mine], [pages[i] for i in mine],
                           [True] * len(mine))
        self._flushed()
        return {"node": self.index, "found": found, "loaded": loaded}

    def _flushed(self) -> None:
        """Wait until every object the node's write-behind was handed has been put (or
        given up on); ``TimeoutError`` after ``FLUSH_WAIT_S``."""
        end = time.monotonic() + FLUSH_WAIT_S
        while True:
            s = self.client.stats().l2
            if s.l3_put + s.l3_put_failed >= s.l3_put_submitted:
                return
            if time.monotonic() > end:
                raise TimeoutError(f"node {self.node_id}'s write-behind did not end: {s}")
            time.sleep(0.002)

    def counters(self) -> dict:
        """The node's L2 pool counters and write-behind counts (its stats)."""
        s = self.client.stats().l2
        pool = s.pools[self.pool]
        return {"pages": pool.pages, "hits": pool.hits, "misses": pool.misses,
                "evicted": pool.evicted, "full": pool.full, "filled": s.filled,
                "fill_failed": s.fill_failed, "l3_put": s.l3_put,
                "l3_put_failed": s.l3_put_failed}

    def missing(self, hashes: Sequence[str]) -> int:
        """How many of ``hashes`` L3 holds no replica of (nothing leased)."""
        keys = self.keys(hashes)
        where = ray.get(self.actor.locate.remote(keys, self.client.owner_claim(
            self.node_id, "locate", keys)))
        return sum(not w for w in where)

    def close(self) -> None:
        self.client.close()


def replay(cluster, requests: Sequence[Request], l2_pages: int, tag: str) -> dict:
    """``requests`` one at a time on ``cluster``'s first two nodes (module docstring),
    deployment ``org/sim-check-<tag>``: per request its ``records``, per node its
    ``counters``, ``l3_missing`` (distinct blocks L3 lost by the end), ``full`` (blocks
    L2 had no page for) and ``seconds``."""
    config = StorageConfig(model_name=f"org/sim-check-{tag}")
    engines = [NodeEngine(cluster, i, n, config, l2_pages)
               for i, n in enumerate(cluster.node_ids[:NODES])]
    try:
        t = time.perf_counter()
        records = [engines[i % NODES].serve([str(b) for b in r.blocks])
                   for i, r in enumerate(requests)]
        seconds = time.perf_counter() - t
        distinct = sorted({str(b) for r in requests for b in r.blocks})
        return {"records": records, "counters": [e.counters() for e in engines],
                "l3_missing": engines[0].missing(distinct),
                "full": sum(e.full for e in engines), "seconds": round(seconds, 2)}
    finally:
        for e in engines:
            e.close()


def check(cluster, requests: Sequence[Request], l2_pages: int, segment_bytes: int,
          tag: str, sim_l2_pages: Sequence[int] = ()) -> dict:
    """``replay`` on ``cluster`` (its segments ``segment_bytes`` each, placement ``own``)
    and the simulator on the same ``requests``: both sides' figures (``found`` and
    ``loaded`` for the real one), ``compare`` of found against the simulator, and the
    simulator again at each of ``sim_l2_pages`` (controls: their ``compare`` with the
    same real run)."""
    real = replay(cluster, requests, l2_pages, tag)
    l3_blocks = segment_bytes // PAGE.object_bytes
    sim, sim_stats = simulate(requests, layout(NODES, l2_pages, l3_blocks))
    found = tally(requests, real["records"], NODES, "found")
    loaded = tally(requests, real["records"], NODES, "loaded")
    controls = {}
    for pages in sim_l2_pages:
        other, _ = simulate(requests, layout(NODES, pages, l3_blocks))
        controls[str(pages)] = compare(found, other)
    blocks = sum(len(r.blocks) for r in requests)
    return {
        "requests": len(requests), "blocks": blocks,
        "distinct_blocks": len({b for r in requests for b in r.blocks}),
        "nodes": NODES, "l2_pages": l2_pages, "l3_blocks_per_node": l3_blocks,
        "page_bytes": PAGE.object_bytes, "max_diff_pp": MAX_DIFF_PP,
        "found": compare(found, sim), "loaded": compare(loaded, sim),
        "short_loads": {"blocks": sum(found_blocks(x, "found") - found_blocks(x, "loaded")
                                      for x in real["records"]),
                        "requests": sum(found_blocks(x, "found") > found_blocks(x, "loaded")
                                        for x in real["records"])},
        "real": {"found": found, "loaded": loaded, "counters": real["counters"],
                 "l3_missing": real["l3_missing"], "full": real["full"],
                 "seconds": real["seconds"]},
        "sim": {**sim, "stats": sim_stats},
        "sim_controls": controls,
    }


def found_blocks(record: dict, what: str) -> int:
    """Blocks a request's record has under ``what``, every tier together."""
    return sum(record[what][t] for t in TIERS)


def table(section: dict, tiers: Sequence[str], control: str) -> str:
    """One replay's sides per tier of ``tiers``, blocks and tokens (percent of all),
    its real loads if it has them, its controls (the simulator at another ``control``),
    as text."""
    loaded = section.get("loaded")
    lines = [f"{'tier':<10} {'real blocks':>12} {'sim blocks':>11} {'diff pp':>8} "
             f"{'real tokens':>12} {'sim tokens':>11} {'diff pp':>8}"
             + (f" {'real loaded':>12}" if loaded else "")]
    for tier in (*tiers, "computed"):
        b, t = (section["found"]["tiers"][tier][w] for w in ("block", "token"))
        lines.append(f"{tier:<10} {b['real']:>12.2f} {b['sim']:>11.2f} {b['diff_pp']:>8.2f} "
                     f"{t['real']:>12.2f} {t['sim']:>11.2f} {t['diff_pp']:>8.2f}"
                     + (f" {loaded['tiers'][tier]['block']['real']:>12.2f}" if loaded else ""))
    lines.append(f"largest difference {section['found']['max_diff_pp']:.2f} pp"
                 + (f"; loaded against the simulator {loaded['max_diff_pp']:.2f} pp"
                    if loaded else ""))
    for pages, c in section["sim_controls"].items():
        lines.append(f"control: the simulator with {pages} {control} is "
                     f"{c['max_diff_pp']:.2f} pp off")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=300, help="requests of the sample")
    ap.add_argument("--l2-pages", type=int, default=256, help="L2 pages per node")
    ap.add_argument("--host-pages", type=int, default=256,
                    help="host pool pages per example engine")
    ap.add_argument("--replays", default="l2,example",
                    help="l2 (the nodes' L2 as vLLM's connector drives it), example (the "
                    "example engine), or both (comma-separated)")
    ap.add_argument("--trace", type=Path, default=TRACE)
    ap.add_argument("--seed", type=int, default=0, help="seeds the sample's draw")
    ap.add_argument("--out", type=Path, default=Path("sim_check.json"))
    a = ap.parse_args(argv)
    replays = set(a.replays.split(","))
    if not replays or replays - {"l2", "example"}:
        raise SystemExit(f"--replays: l2, example or both, got {a.replays!r}")
    from raykv import local_settings, start_local
    from raykv_lab.bench import sim_check_engine

    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    requests = conversation_sample(read_trace(a.trace), a.requests, a.seed)
    segment = 256 << 20
    tag = os.urandom(4).hex()
    result: dict = {
        "command": "python -m raykv_lab.bench.sim_check " +
                   " ".join(argv if argv is not None else sys.argv[1:]),
        "trace": a.trace.name, "seed": a.seed, "requests": len(requests),
        "blocks": sum(len(r.blocks) for r in requests),
        "distinct_blocks": len({b for r in requests for b in r.blocks}),
        "nodes": NODES, "segment_bytes": segment, "max_diff_pp": MAX_DIFF_PP}
    t = time.perf_counter()
    with start_local(settings=local_settings(global_segment_size=segment, placement="own"),
                     num_nodes=NODES, log_to_driver=False) as cluster:
        if "l2" in replays:
            result["l2"] = check(cluster, requests, a.l2_pages, segment, tag,
                                 (0, 4 * a.l2_pages))
            print("L2 replay (the nodes' L2 pools, vLLM's L2 ops)")
            print(table(result["l2"], TIERS, "L2 pages per node"))
        if "example" in replays:
            result["example_engine"] = sim_check_engine.check(
                cluster, requests, a.host_pages, segment, tag, NODES, (0, 4 * a.host_pages))
            print("example engine replay (its host pool, L3)")
            print(table(result["example_engine"], sim_check_engine.TIERS,
                        "host pages per engine"))
    result |= {"elapsed_s": round(time.perf_counter() - t, 1),
               "recorded": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    a.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
