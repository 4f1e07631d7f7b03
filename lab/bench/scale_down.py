"""A scale-down in the middle of a workload, on emulated hosts: the hit rate after vs
before, with the leaving node's drain on and off, and what a drain moves per second.

``run_scale_down_bench`` runs, per link rate of ``links`` and drain mode of ``modes``,
one cluster of three emulated hosts (``start_hosts(3)``, root only; every host's
link shaped to the rate; node actors on every host, ``LifecycleSettings.fixed`` with
``drain`` on or off and a drain timeout of ``DRAIN_TIMEOUT_S``):

1. *Write*: a rank of the deployment on host 1 and one on host 2 each write half of
   ``prefixes`` prefixes (``prefix_pages`` pages of ``PAGE_BYTES``, a K and a V object
   of 1 MiB each: one 16-token block of a Llama-3-8B-shaped model, fp16), with the
   default ``own`` placement: each host's segment holds its own pages;
2. *Before*: ranks on hosts 0 and 1 (the hosts that stay) replay ``requests`` seeded
   requests (``scale_down_workload.workload``: Zipf over the prefixes), in turn; each
   reads its prefix with ``batch_get_v1`` and checks every page served byte for byte
   (a page with other bytes fails the run);
3. *Scale-down*: host 2's rank ends (its engine scaled away) and the reconciler is told
   that host 2 leaves (``NodeReconciler.drain``, what ``raykv drain`` calls): drain on,
   its node actor drains within the timeout and stops; drain off, it stops at once. The
   reconciler passes the drain no room bound; the remaining segments are sized so all
   of host 2's pages fit below the store's high watermark, and the room the master's
   metrics give (``StoreUsage.room_without``) is recorded beside what moved;
4. *After*: the same requests again. Hit rate: pages served over pages asked
   (``hit_rate``); the goal is after >= 0.95x before when the remaining hosts have room;
5. *Drain rate* (drain on only): host 1's node actor is drained directly
   (``NodeCacheActor.drain`` with the room from the master's metrics, then ``undrain``)
   after its rank wrote ``sweep`` more bytes per object size: its segment's workload
   pages and those go to host 0. Each drain's report gives bytes and objects moved over
   its seconds (``drain_rates``); ``drain_model_s`` turns the measured object rate into
   seconds per GiB by the model said there.

The figures and the machine's load go to ``scale_down.json`` in ``out_dir``. What the
emulation shows and cannot: docs/benchmarks.md, *Scale-down*.
"""

from __future__ import annotations

import datetime
import json
import os
import statistics
import time
import uuid
import zlib
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import ray
import torch
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
from raykv.cache_actors.rank.client import CacheClient
from raykv.clusters.node_lifecycle import LifecycleSettings
from raykv.clusters.store_usage import read_store_usage
from raykv.controllers.contract import StorageConfig
from raykv.controllers.pool_layout import GiB, MiB
from raykv_lab.bench.scale_down_workload import (
    after_vs_before,
    drain_model_s,
    drain_rates,
    hit_rate,
    leading,
    workload,
)
from raykv_lab.bench.toolkit import human_bytes, right_table
from raykv_lab.host_plan import parse_rate
from rich.console import Console

DEFAULT_LINKS = ("1gbit", "10gbit")
MODES = ("on", "off")
PAGE_TOKENS = 16
LAYERS = 32
HEADS = 8
HEAD_DIM = 128
PAGE_BYTES = 2 * PAGE_TOKENS * LAYERS * HEADS * HEAD_DIM * 2
"""2 MiB: K and V of one 16-token block, 32 layers of 8 heads of 128, fp16."""
DEFAULT_SWEEP = ((1 * MiB, 256 * MiB), (4 * MiB, 512 * MiB))
"""(object bytes, bytes written) of the drain-rate drains of host 1."""
SEGMENTS = (2 * GiB, 1 * GiB, 512 * MiB)
"""Each host's segment: host 0 takes what hosts 2 and 1 drain."""
DRAIN_TIMEOUT_S = 120.0
TIMEOUT_S = 60.0
"""Deadline of each rank's raykv calls, in seconds."""
SEED = 51
START_ATTEMPTS = 2
"""Tries at starting one cluster (a loaded machine sometimes brings a host's Ray node up
too late)."""


def _pattern(key: str, shape: torch.Size) -> torch.Tensor:
    """The int64 words of ``key``'s page: its CRC in the high half, a counter below."""
    n = shape.numel()
    return (torch.arange(n, dtype=torch.int64) + (zlib.crc32(key.encode()) << 32)).view(shape)


@ray.remote(num_cpus=0)
class ScaleRank:
    """One rank of ``model``: an MHA host pool of ``pages`` pages whose objects (a K and
    a V each) are ``object_bytes`` bytes; writes pages whose bytes derive from their
    keys and reads them back checked."""

    def __init__(self, model: str, pages: int, object_bytes: int) -> None:
        head_dim = object_bytes // (PAGE_TOKENS * LAYERS * HEADS * 2)
        self._client = CacheClient(StorageConfig(model_name=model,
                                                 extra_config={"timeout_s": TIMEOUT_S}))
        self._pool = self._client.create_host_pool(
            "mha", size=pages * PAGE_TOKENS, page_size=PAGE_TOKENS, layer_num=LAYERS,
            head_num=HEADS, head_dim=head_dim, dtype=torch.float16)
        self._client.register_mem_pool_host(self._pool)
        self._pages = pages

    def node_id(self) -> str:
        return self._client.node_id

    def _page(self, i: int) -> torch.Tensor:
        return self._pool.kv_buffer[:, i * PAGE_TOKENS:(i + 1) * PAGE_TOKENS].view(torch.int64)

    def _slots(self, n: int) -> torch.Tensor:
        return torch.arange(n * PAGE_TOKENS)

    def write(self, keys: list[str]) -> int:
        """Put each key's page, a pool's worth a call: pages stored."""
        stored = 0
        for start in range(0, len(keys), self._pages):
            chunk = keys[start:start + self._pages]
            for i, key in enumerate(chunk):
                page = self._page(i)
                page.copy_(_pattern(key, page.shape))
            stored += sum(self._client.batch_set_v1(chunk, self._slots(len(chunk))))
        return stored

    def read(self, keys: list[str]) -> dict:
        """Read one prefix (at most a pool's worth): ``served`` (leading pages got),
        ``wrong`` (of those, pages whose bytes differ) and ``s`` (seconds of the get)."""
        for i in range(len(keys)):
            self._page(i).zero_()
        t0 = time.perf_counter()
        got = self._client.batch_get_v1(keys, self._slots(len(keys)))
        seconds = time.perf_counter() - t0
        served = leading(got)
        wrong = sum(not torch.equal(self._page(i), _pattern(k, self._page(i).shape))
                    for i, k in enumerate(keys[:served]))
        return {"served": served, "wrong": wrong, "s": seconds}

    def close(self) -> None:
        self._client.close()


def _rank(node_id: str, model: str, pages: int, object_bytes: int = PAGE_BYTES // 2):
    rank = ScaleRank.options(scheduling_strategy=NodeAffinitySchedulingStrategy(
        node_id, soft=False)).remote(model, pages, object_bytes)
    if ray.get(rank.node_id.remote()) != node_id:
        raise RuntimeError("a rank started on another node than its own")
    return rank


def _end(rank) -> None:
    ray.get(rank.close.remote())
    ray.kill(rank)


def replay(readers: list, keys: list[list[str]], requests: list[int]) -> dict:
    """The requests, each read by the next reader in turn: hit rate, pages asked and
    served, seconds; ``RuntimeError`` if a page served had other bytes."""
    served, asked, wrong = [], [], 0
    t0 = time.monotonic()
    for i, p in enumerate(requests):
        r = ray.get(readers[i % len(readers)].read.remote(keys[p]))
        served.append(r["served"])
        asked.append(len(keys[p]))
        wrong += r["wrong"]
    if wrong:
        raise RuntimeError(f"{wrong} pages read back with other bytes")
    return {"hit_rate": hit_rate(served, asked), "pages_asked": sum(asked),
            "pages_served": sum(served), "seconds": time.monotonic() - t0}


def _room(cluster, node_id: str) -> int | None:
    usage = read_store_usage(f"http://127.0.0.1:{cluster.master.metrics_port}/metrics")
    segment = ray.get(cluster.node_actors[node_id].health.remote())["segment"]
    return None if usage is None else usage.room_without(segment)


def rate_drains(cluster, node_id: str, model: str, sweep: Sequence[tuple[int, int]],
                link_bps: float | None, run_id: str) -> list[dict]:
    """Per (object bytes, bytes) of ``sweep``: a rank on ``node_id`` writes that many
    bytes in objects of that size, then that node's actor drains (room from the
    master's metrics) and is undrained; each drain's report and rates."""
    actor, rows = cluster.node_actors[node_id], []
    for object_bytes, nbytes in sweep:
        pages = nbytes // (2 * object_bytes)
        rank = _rank(node_id, model, min(pages, 16), object_bytes)
        keys = [f"sd-{run_id}-rate-{object_bytes}-{i}" for i in range(pages)]
        try:
            if ray.get(rank.write.remote(keys)) != pages:
                raise RuntimeError("host 1 did not store every page of a drain-rate batch")
        finally:
            _end(rank)
        room = _room(cluster, node_id)
        report = ray.get(actor.drain.remote(DRAIN_TIMEOUT_S, room, "bench"))
        ray.get(actor.undrain.remote())
        rows.append({"object_bytes": object_bytes, "written_bytes": pages * 2 * object_bytes,
                     "room_bytes": room, "report": report,
                     **drain_rates(report, link_bps)})
    return rows


def scale_down(link: str, drain: bool, prefixes: int, prefix_pages: int, requests: int,
               sweep: Sequence[tuple[int, int]], console: Console) -> dict:
    """One cluster, one link rate, one drain mode: the figures (module docstring)."""
    from raykv_lab.hosts import start_hosts

    run_id = uuid.uuid4().hex[:8]
    model = f"raykv-bench-scale-down-{run_id}"
    lifecycle = replace(LifecycleSettings.fixed(), drain=drain, drain_timeout_s=DRAIN_TIMEOUT_S)
    load = os.getloadavg()
    with console.status(f"{link}, drain {'on' if drain else 'off'}: starting 3 emulated "
                        "hosts"):
        for attempt in range(START_ATTEMPTS):
            try:
                cluster = start_hosts(3, segment_sizes=list(SEGMENTS), link=link, cpus_per_node=1,
                                      log_to_driver=False, lifecycle=lifecycle)
                break
            except RuntimeError as e:  # a host's Ray node did not come up: start again
                if attempt + 1 == START_ATTEMPTS:
                    raise
                console.print(f"starting the emulated hosts failed, again: {e}")
    with cluster:
        n0, n1, n2 = sorted(cluster.node_ids, key=cluster.ray_nodes.host_of)
        keys = [[f"sd-{run_id}-{p}-{i}" for i in range(prefix_pages)] for p in range(prefixes)]
        writers = {n1: _rank(n1, model, prefix_pages), n2: _rank(n2, model, prefix_pages)}
        with console.status("writing the prefixes on hosts 1 and 2"):
            for p, prefix in enumerate(keys):
                if ray.get(writers[(n1, n2)[p % 2]].write.remote(prefix)) != prefix_pages:
                    raise RuntimeError(f"prefix {p} was not stored whole")
        readers = [_rank(n0, model, prefix_pages), _rank(n1, model, prefix_pages)]
        asked = workload(SEED, prefixes, requests)
        with console.status("the workload before the scale-down"):
            before = replay(readers, keys, asked)
        _end(writers.pop(n2))
        room = _room(cluster, n2)
        with console.status("host 2 leaves"):
            t0 = time.monotonic()
            report = ray.get(cluster.reconciler.drain.remote(n2))
            leave_s = time.monotonic() - t0
        with console.status("the workload after the scale-down"):
            after = replay(readers, keys, asked)
        rates = []
        if drain:
            with console.status("drain rates: host 1 drains to host 0"):
                rates = rate_drains(cluster, n1, model, sweep, parse_rate(link), run_id)
        for rank in (*readers, *writers.values()):
            _end(rank)
    host2 = prefixes // 2 * prefix_pages * PAGE_BYTES
    out = {"link": link, "drain": drain, "before": before, "after": after,
           "after_vs_before": after_vs_before(after["hit_rate"], before["hit_rate"]),
           "host2_bytes": host2, "room_bytes": room, "leave_s": leave_s,
           "report": report, "rate_drains": rates, "load_before": list(load),
           "load_after": list(os.getloadavg())}
    if drain and report.get("bytes_moved"):
        out["drain_rates"] = drain_rates(report, parse_rate(link))
    return out


def run_scale_down_bench(links: Sequence[str] = DEFAULT_LINKS, modes: Sequence[str] = MODES,
                         prefixes: int = 16, prefix_pages: int = 16, requests: int = 64,
                         sweep: Sequence[tuple[int, int]] = DEFAULT_SWEEP,
                         out_dir: str | None = None, command: str = "",
                         console: Console | None = None) -> dict:
    """Run the benchmark (module docstring); print a table, write ``scale_down.json``
    into ``out_dir`` (default ``raykv-out/``; rewritten after each cluster, ``complete``
    once all ran), return the figures. Root only, Ray not
    initialised. ``ValueError`` for a bad link rate or mode, before anything starts."""
    console = console or Console()
    for link in links:
        parse_rate(link)
    if not modes or any(m not in MODES for m in modes):
        raise ValueError(f"modes are of {MODES}, got {list(modes)}")
    if prefixes < 2 or prefix_pages < 1 or requests < 1:
        raise ValueError("need prefixes >= 2, prefix_pages >= 1 and requests >= 1")
    t0 = time.monotonic()
    out = Path(out_dir or "raykv-out")
    out.mkdir(parents=True, exist_ok=True)
    runs: list[dict] = []
    for link in links:
        for mode in modes:
            runs.append(scale_down(link, mode == "on", prefixes, prefix_pages, requests,
                                   sweep, console))
            result = {"benchmark": "scale_down", "command": command,
                      "complete": len(runs) == len(links) * len(modes),
                      "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
                      "machine": {"cpus": os.cpu_count(),
                                  "memory_gib": round(os.sysconf("SC_PHYS_PAGES")
                                                      * os.sysconf("SC_PAGE_SIZE") / GiB, 1)},
                      "seconds": time.monotonic() - t0, "page_bytes": PAGE_BYTES,
                      "prefixes": prefixes, "prefix_pages": prefix_pages,
                      "requests": requests, "segments": list(SEGMENTS),
                      "drain_timeout_s": DRAIN_TIMEOUT_S, "runs": runs,
                      "model": drain_model(runs)}
            (out / "scale_down.json").write_text(json.dumps(result, indent=2))
    console.print(_table(runs))
    return result


def drain_model(runs: list[dict]) -> dict:
    """Per link: the median object rate of its drains of 1 MiB objects and the seconds
    one GiB of them needs by ``drain_model_s`` (a model from measured rates)."""
    model = {}
    for link in dict.fromkeys(r["link"] for r in runs):
        rates = [d["objects_per_s"] for r in runs if r["link"] == link and r["drain"]
                 for d in r["rate_drains"] if d["object_bytes"] == MiB]
        if rates:
            rate = statistics.median(rates)
            model[link] = {"objects_per_s": rate, "s_per_gib_of_1mib_objects":
                           drain_model_s(GiB // MiB, GiB, rate, parse_rate(link))}
    return model


def _table(runs: list[dict]):
    table = right_table("Scale-down: host 2 leaves mid-workload",
                        ["link", "drain", "hit before", "hit after", "after/before",
                         "moved", "drain s", "GB/s"],
                        caption="hit: pages served / asked by the same seeded requests")
    for r in runs:
        rep = r["report"]
        rates = r.get("drain_rates")
        table.add_row(r["link"], "on" if r["drain"] else "off",
                      f"{r['before']['hit_rate']:.3f}", f"{r['after']['hit_rate']:.3f}",
                      f"{r['after_vs_before']:.3f}",
                      human_bytes(rep.get("bytes_moved", 0)) if rep.get("bytes_moved") else "0",
                      f"{rep.get('seconds', 0):.1f}",
                      "-" if rates is None else f"{rates['gbps']:.3f}")
    return table
