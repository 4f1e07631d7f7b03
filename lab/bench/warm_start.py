"""A new node's first minute: the share of its prefix tokens served from L2, from L3 and
computed, with the L2 warm-up off and on.

Run: ``python -m raykv_lab.bench.warm_start [--trace FILE ...] [--before-s 180]
[--after-s 60] [--l2-pages 2048] [--warm-pages 512 2048] [--out FILE]`` (Ray must not
be running in this process; 3-4 minutes on 2 cores with the defaults: Mooncake's
conversation and synthetic traces, three settings each).

Per trace and setting (the warm-up off, then with each budget of ``--warm-pages``; a
fresh cluster each, the same requests): ``start_local`` with two nodes; a rank of one
deployment on the first node opens an L2 pool of ``l2_pages`` pages and serves the
trace's first ``before_s`` seconds of requests as a vLLM worker does through L2 (a
lookup, an ``acquire`` that fills from L3 what L2 lacks, then ``reserve`` and
``commit`` of the blocks computed: the write-behind puts them to L3, and the node's
touch journal notes every put and every L3 read); once every dirty page reached L3 a
node joins (``add_node``), a rank of the same deployment opens its L2 pool of the same
size there, the warm-up (``l2_warm_bytes``: the budget's pages) reads what it chose and
ends before the first request (an engine loads its model meanwhile), and the rank
serves the next ``after_s`` seconds of the trace. Requests are served one after another
as fast as the machine goes, not at the trace's times. Every page a rank acquires is
checked against the bytes its block was saved with (``wrong_pages``).

Workload: ``warm_workload`` (one page per 512-token block of the trace). Writes JSON:
the command, date, machine and load, the settings; per trace its stretches, what the
best cache could give the joined node (``reachable``) and the best warm-up of each
budget (``best_warm``); per setting the joined node's shares per tier (``shares``) over
its whole stretch and per 10 s of trace, its warm-up (seconds, pages and bytes read,
why it stopped), its L2 counters, blocks not saved for want of an L2 page.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path

import torch
from raykv import local_settings, start_local
from raykv.cache_actors.rank.client import CacheClient
from raykv.controllers import StorageConfig
from raykv.controllers.node_records import NodeStats, as_dict
from raykv.controllers.pool_layout import MiB, PoolLayout
from raykv.controllers.result_codes import PRESENT
from raykv_lab.bench.toolkit import machine_info
from raykv_lab.bench.warm_workload import (
    Request,
    Served,
    best_warm,
    by_slice,
    reachable,
    read_trace,
    shares,
    stretches,
)

TRACES = [Path(__file__).resolve().parents[2] / "tests" / "data" / "traces" / name
          for name in ("conversation_trace.jsonl", "synthetic_trace.jsonl")]
LAYOUT = PoolLayout.vllm(page_size=16, size=16, layer_num=2, head_num=2, head_dim=32,
                         dtype="bfloat16", itemsize=2)
"""One page: a small stand-in for a 512-token block (its bytes do not change the counts)."""
SLICE_S = 10.0
WAIT_S = 120.0


def page_value(block: int) -> int:
    """The byte every byte of ``block``'s page holds (so a read page can be checked)."""
    return (block * 2654435761) % 251


class Rank:
    """A rank of ``conf``'s deployment on ``node_id`` serving requests through its node's
    L2 as a vLLM worker does (module docstring)."""

    def __init__(self, conf: StorageConfig, node_id: str, pages: int) -> None:
        self.client = CacheClient(conf, node_id=node_id)
        self.client.register_mem_pool_host(self.client.create_host_pool(LAYOUT))
        self.link = self.client.l2()
        self.pool = self.link.open(LAYOUT, pages)
        if self.pool is None:
            raise RuntimeError(f"no L2 room for {pages} pages on {node_id[:12]}")
        self.buf = self.pool.kv_buffer.view(torch.uint8).view(self.pool.layout.num_pages, -1)
        self.wrong = self.unsaved = 0

    def serve(self, request: Request) -> Served:
        """One request: its leading blocks from L2, then from L3 through L2, the rest
        computed and saved (blocks L2 had no page for are counted ``unsaved``)."""
        keys = [f"b{b}" for b in request.blocks]
        in_l2 = self.link.lookup(keys, 1)
        got = self.link.acquire(self.pool.name, keys, True)
        if got:
            want = torch.tensor([page_value(b) for b in request.blocks[:len(got)]],
                                dtype=torch.uint8)
            self.wrong += int((~(self.buf[got] == want[:, None]).all(dim=1)).sum())
        rest = list(range(len(got), len(keys)))
        if rest:
            pages = self.link.reserve(self.pool.name, [keys[i] for i in rest])
            mine = [(i, p) for i, p in zip(rest, pages, strict=True) if p >= 0]
            self.unsaved += sum(p < 0 and p != PRESENT for p in pages)
            for i, p in mine:
                self.buf[p] = page_value(request.blocks[i])
            if mine:
                self.link.commit(self.pool.name, [keys[i] for i, _ in mine],
                                 [p for _, p in mine], [True] * len(mine))
        return Served(min(in_l2, len(got)), max(0, len(got) - in_l2))

    def stats(self) -> NodeStats:
        return self.client.stats()


def waited(what: str, rank: Rank, done: Callable[[NodeStats], bool]) -> NodeStats:
    """``rank``'s node stats once ``done(stats)`` holds (``TimeoutError`` after
    ``WAIT_S``)."""
    deadline = time.monotonic() + WAIT_S
    while not done(s := rank.stats()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: {s.warmup} {s.l2}")
        time.sleep(0.2)
    return s


def one_setting(first: Sequence[Request], then: Sequence[Request], before_s: float,
                l2_pages: int, warm_pages: int) -> dict:
    """One fresh cluster: the first stretch on node 0, a node joins, the next stretch on
    it, with a warm-up of ``warm_pages`` pages (0: off) (module docstring); what the
    joined node served and counted."""
    warm = warm_pages > 0
    pool_bytes = l2_pages * LAYOUT.object_bytes
    segment = max(64 * MiB, 2 * LAYOUT.object_bytes * len({b for r in first for b in r.blocks}))
    with start_local(settings=local_settings(global_segment_size=segment, l2_bytes=pool_bytes + MiB,
                                             l2_warm_bytes=warm_pages * LAYOUT.object_bytes),
                     num_nodes=2, log_to_driver=False) as c:
        conf = StorageConfig(model_name="org/warm-start")
        old = Rank(conf, c.node_ids[0], l2_pages)
        old.client.register_deployment()  # as its scheduler's first group query does
        ranks = [old]
        try:
            t = time.perf_counter()
            for r in first:
                old.serve(r)
            first_s = time.perf_counter() - t
            waited("write-behind", old, lambda s: s.l2.l3_put_pending == 0)
            t = time.perf_counter()
            node = c.add_node()
            join_s = time.perf_counter() - t
            t = time.perf_counter()
            new = Rank(conf, node, l2_pages)
            ranks.append(new)
            s = waited("warm-up", new, lambda s: not warm or (
                bool(s.warmup.warmups) and not s.warmup.running))
            ready_s = time.perf_counter() - t
            before = s.l2
            t = time.perf_counter()
            served = [new.serve(r) for r in then]
            then_s = time.perf_counter() - t
            after = new.stats()
            warmups = list(after.warmup.warmups.values())
            (pool,) = after.l2.pools.values()
            return {
                "warm_pages": warm_pages, "first_served_s": first_s, "join_s": join_s,
                "open_to_ready_s": ready_s, "then_served_s": then_s,
                "shares": shares(then, served),
                "by_slice": by_slice(then, served, before_s, SLICE_S),
                "warmup": as_dict(warmups[0]) if warmups else None,
                "l2": {"filled": after.l2.filled - before.filled,
                       "warmed": after.l2.warmed, "hits": pool.hits,
                       "evicted": pool.evicted},
                "old_unsaved": old.unsaved, "unsaved": new.unsaved,
                "wrong_pages": old.wrong + new.wrong,
                "load_avg": list(os.getloadavg())}
        finally:
            for rank in ranks:
                rank.client.close()


def one_trace(trace: Path, before_s: float, after_s: float, l2_pages: int,
              warm_pages: Sequence[int]) -> dict:
    """The warm-up off, then with each budget of ``warm_pages``, on one trace's requests
    (module docstring); ``runs`` and ``best_warm`` by budget (``"0"``: off)."""
    first, then = stretches(read_trace(trace), before_s, after_s)
    return {"first_requests": len(first), "then_requests": len(then),
            "first_pages": sum(len(r.blocks) for r in first),
            "first_distinct_pages": len({b for r in first for b in r.blocks}),
            "reachable": reachable(first, then),
            "best_warm": {str(n): best_warm(first, then, n) for n in warm_pages},
            "runs": {str(n): one_setting(first, then, before_s, l2_pages, n)
                     for n in (0, *warm_pages)}}


def run(traces: Sequence[Path], before_s: float, after_s: float, l2_pages: int,
        warm_pages: Sequence[int]) -> dict:
    """Every trace, both settings (module docstring); the JSON's content."""
    load = list(os.getloadavg())
    started = time.perf_counter()
    result = {t.stem: one_trace(t, before_s, after_s, l2_pages, warm_pages) for t in traces}
    return {
        "command": "python -m raykv_lab.bench.warm_start " + shlex.join(sys.argv[1:]),
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "seconds": time.perf_counter() - started,
        "machine": machine_info() | {"load_avg_start": load,
                                     "load_avg_end": list(os.getloadavg())},
        "settings": {"before_s": before_s, "after_s": after_s, "l2_pages": l2_pages,
                     "warm_pages": list(warm_pages), "page_bytes": LAYOUT.object_bytes,
                     "slice_s": SLICE_S},
        "traces": result}


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", type=Path, nargs="+", default=TRACES)
    p.add_argument("--before-s", type=float, default=180.0,
                   help="trace seconds served on the first node")
    p.add_argument("--after-s", type=float, default=60.0,
                   help="trace seconds served on the joined node")
    p.add_argument("--l2-pages", type=int, default=2048, help="pages of each L2 pool")
    p.add_argument("--warm-pages", type=int, nargs="+", default=[512, 2048],
                   help="the warm-up's budgets, one run each (and one with it off)")
    p.add_argument("--out", type=Path, default=Path("raykv-out/warm_start.json"))
    a = p.parse_args(argv)
    if not all(0 < n <= a.l2_pages for n in a.warm_pages):
        p.error("--warm-pages must be in 1 .. --l2-pages")
    result = run(a.trace, a.before_s, a.after_s, a.l2_pages, a.warm_pages)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=2) + "\n")
    for trace, t in result["traces"].items():
        for name, r in t["runs"].items():
            s = r["shares"]
            print(f"{trace}, warm-up of {name} pages: L2 {s['l2']['share']:.1%}, L3 "
                  f"{s['l3']['share']:.1%}, computed {s['missed']['share']:.1%} of prefix "
                  f"tokens; warm-up {r['warmup']}")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
