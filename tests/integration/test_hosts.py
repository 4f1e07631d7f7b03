"""A raykv cluster of emulated hosts (``start_hosts(2)``, ``lab.hosts``): two
network namespaces with addresses of their own on raykv's private subnet, a real Ray
node in each, a real ``mooncake_master`` on host 0. Bytes written by a rank on one host
are read by a rank on the other; every node's Mooncake endpoint is its host's address
(control: the single-host cluster's is loopback, ``test_doors``); from the other host
nothing of the master's that lists or removes keys answers while its RPC serves that
host's node actor (control: a master started with the wide flags answers
``/get_all_keys`` there); the cluster leaves nothing behind, after a normal exit and
after ``kill -9`` of its driver and ``raykv clean-hosts`` (control: before the clean-up
the namespaces are still there); ``raykv emulate-hosts`` runs with the node
options given and removes its hosts at SIGTERM; a prefix written through host 0's L2 loads from that
L2 with no store get and from L3 on both hosts byte for byte (control: L2 pages
scribbled over are found different), also with host 1's link slowed to 100 Mbit/s
mid-run and unshaped; the hosts' Ray alone is stopped and started again, as a failed
join does (the master stays; control: the probe sees Ray running before). Traffic goes
only to loopback and to the emulated hosts' addresses.

Root only (namespaces, links): skipped otherwise. ``RAYKV_SLOW_HOST_TESTS=1`` also runs
the slow ones (a link down for 20 s; vLLM engines on two hosts)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import ray
import torch
from raykv import local_settings
from raykv.clusters.mooncake_master import MooncakeMaster
from raykv.controllers import StorageConfig
from raykv.controllers.pool_layout import MiB
from raykv_lab.host_plan import HostPlan
from raykv_lab.hosts import WORKDIR, cluster_pids, leftovers, start_hosts

from tests.integration.ranks import indices, start_rank

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="emulated hosts need root")
SLOW = pytest.mark.skipif(os.environ.get("RAYKV_SLOW_HOST_TESTS") != "1",
                          reason="slow: set RAYKV_SLOW_HOST_TESTS=1")
ROOT = Path(__file__).resolve().parents[2]
STUCK_TRANSFER_S = 25.0
"""How long a Mooncake 0.3.13 TCP transfer to a cut-off peer may run before it fails
(10-20 s measured here), which a rank whose get is in that store call waits out."""


@pytest.fixture(scope="module")
def hosts():
    """Two emulated hosts, links shaped to 10 Gbit/s (host 0 runs the head and the
    master)."""
    with start_hosts(2, settings=local_settings(global_segment_size=64 * MiB), link="10gbit",
                     cpus_per_node=1, log_to_driver=False) as c:
        yield c


def cfg(uid: str, **kw) -> StorageConfig:
    return StorageConfig(model_name=f"hosts/{uid}", **kw)


def in_host(c, host: int, code: str, timeout: float = 30) -> subprocess.CompletedProcess:
    """Run python ``code`` on emulated host ``host`` (inside its namespace)."""
    return subprocess.run([*c.ray_nodes.plan.exec_prefix(host), sys.executable, "-c", code],
                          capture_output=True, text=True, timeout=timeout)


def answers(c, host: int, url: str) -> str:
    """What ``url`` answers from emulated host ``host``: the status line, or the error."""
    code = textwrap.dedent(f"""
        import urllib.request
        try:
            r = urllib.request.urlopen({url!r}, timeout=3)
            print("HTTP", r.status, r.read(200))
        except Exception as e:
            print("ERROR", type(e).__name__, e)
    """)
    return in_host(c, host, code).stdout.strip()


def nothing_left(index: int, tag: str) -> list[str]:
    """What emulated cluster ``index`` left behind: namespaces, links, processes, its
    folder, shared memory files."""
    plan = HostPlan(index, 1)
    out = [n for n in subprocess.run(["ip", "netns", "list"], capture_output=True,
                                     text=True).stdout.split() if n.startswith(plan.bridge + "-")]
    out += [n for n in subprocess.run(["ip", "-o", "link", "show"], capture_output=True,
                                      text=True).stdout.split()
            if n.rstrip(":").split("@")[0].startswith(plan.bridge)]
    out += [f"pid {p}" for p in cluster_pids(index)]
    out += [d for d in [WORKDIR.format(index=index)] if os.path.exists(d)]
    out += [str(p) for p in Path("/dev/shm").glob(f"raykv.{tag}.*")] if tag else []
    return out


def test_a_rank_on_one_host_reads_what_a_rank_on_another_wrote(hosts, uid):
    a, b = hosts.node_ids
    writer, reader = start_rank(a, cfg(uid)), start_rank(b, cfg(uid))
    ray.get(writer.fill.remote(7))
    keys = [f"{uid}-{i}" for i in range(4)]
    assert ray.get(writer.call.remote("batch_set_v1", keys, indices(0, 4))) == [True] * 4
    assert ray.get(reader.call.remote("batch_get_v1", keys, indices(16, 4))) == [True] * 4
    assert torch.equal(ray.get(reader.pages.remote(16, 4)), ray.get(writer.pages.remote(0, 4)))
    # each host's node actor tells Mooncake peers its host's address, never loopback
    for node_id, actor in hosts.node_actors.items():
        endpoint = ray.get(actor.stats.remote()).mooncake_endpoint
        net = hosts.ray_nodes
        assert endpoint.rpartition(":")[0] == net.address(net.host_of(node_id))
    assert hosts.master_address.startswith(hosts.ray_nodes.address(0) + ":")


def test_from_another_host_the_master_lists_and_removes_nothing(hosts):
    """Host 1 reaches the master's RPC (its node actor is served: it joined the store)
    and the metadata server, never the metrics server that lists every key."""
    head, master = hosts.ray_nodes.address(0), hosts.master
    probe = textwrap.dedent(f"""
        import socket
        for port in ({master.rpc_port}, {master.http_port}, {master.metrics_port}):
            s = socket.socket(); s.settimeout(3)
            print(port, s.connect_ex(({head!r}, port)) == 0)
    """)
    reach = dict(line.split() for line in in_host(hosts, 1, probe).stdout.split("\n") if line)
    assert reach == {str(master.rpc_port): "True", str(master.http_port): "True",
                     str(master.metrics_port): "False"}
    assert answers(hosts, 1, f"http://{head}:{master.metrics_port}/get_all_keys"
                   ).startswith("ERROR")
    node1 = hosts.node_actors[hosts.node_ids[1]]
    assert ray.get(node1.health.remote())["store_healthy"] is True
    # control: the flags raykv used to start the master with answer there with every key
    wide = MooncakeMaster(head, extra_args=["-metrics_host=0.0.0.0"]).start()
    try:
        assert answers(hosts, 1, f"http://{head}:{wide.metrics_port}/get_all_keys"
                       ).startswith("HTTP 200")
    finally:
        wide.stop()


def qdiscs(c, host: int) -> str:
    """``tc qdisc show`` of both ends of host ``host``'s link."""
    near, far = c.ray_nodes.plan.veth(host)
    return "".join(subprocess.run([*pre, "tc", "qdisc", "show", "dev", dev],
                                  capture_output=True, text=True, check=True).stdout
                   for pre, dev in (([], near), (c.ray_nodes.plan.exec_prefix(host), far)))


def test_locality_bench_loads_a_prefix_from_l2_and_across_hosts_byte_for_byte(hosts, uid):
    """One round of ``raykv bench-hosts --locality`` on a small prefix: written through
    host A's L2 (and put to L3 behind), loaded from A's L2 with no store get, from L3
    on A and on host B with one get per page, every load compared byte for byte.
    Controls: once the L2's pages are scribbled over, the L2 load finds other bytes; a
    prefix never written loads nothing. Then host B's link is slowed to 100 Mbit/s
    mid-run and then unshaped (no ``tbf`` left on either end; control: there was one),
    and B's loads stay exact."""
    from raykv.cache_actors.rank.client import CacheClient
    from raykv.controllers.pool_layout import PoolLayout
    from raykv_lab.bench.host_locality import (
        Prefix,
        bench_prefix,
        geometry,
        wait_written,
    )

    a, b = sorted(hosts.node_ids, key=hosts.ray_nodes.host_of)
    node_a = hosts.node_actors[a]
    puts = ray.get(node_a.stats.remote()).l2.l3_put
    prefix = Prefix(hosts, a, b, 64 * 1024, 4, uid, seed=1)
    try:
        assert ray.get(prefix.writer.write.remote(prefix.hashes)) == 4
        wait_written(node_a, puts + 4)
        row = bench_prefix(prefix, "10gbit", iters=1)
        assert row["verified_loads"] == 6
        assert [row[s]["gets_per_load"] for s in ("l2", "l3_own", "l3_cross")] == [0, 4, 4]
        # control: the L2's pages scribbled over from this process, A's L2 load differs
        model = f"raykv-bench-locality-{uid}-{64 * 1024}"
        client = CacheClient(StorageConfig(model_name=model), node_id=a)
        try:
            pool = client.l2().open(PoolLayout.vllm(size=16, **geometry(64 * 1024)), 4)
            pool.kv_buffer.view(torch.uint8).fill_(0x5A)
            assert ray.get(prefix.reader_a.read.remote("l2", prefix.hashes)) | {"s": 0} == \
                {"s": 0, "loaded": 4, "same": False}
        finally:
            client.close()
        missing = [f"{h}-never" for h in prefix.hashes]
        assert ray.get(prefix.reader_b.read.remote("l3_cross", missing))["loaded"] == 0
        try:  # host B's link slowed to 100 Mbit/s mid-run, then unshaped
            hosts.ray_nodes.set_rate(1, "100mbit")
            assert qdiscs(hosts, 1).count("rate 100Mbit") == 2
            slow = ray.get(prefix.reader_b.read.remote("l3_cross", prefix.hashes))
            assert (slow["loaded"], slow["same"]) == (4, True)
            hosts.ray_nodes.set_rate(1, None)
            assert "tbf" not in qdiscs(hosts, 1)
            fast = ray.get(prefix.reader_b.read.remote("l3_cross", prefix.hashes))
            assert (fast["loaded"], fast["same"]) == (4, True)
        finally:
            hosts.ray_nodes.set_rate(1, "10gbit")
        assert qdiscs(hosts, 1).count("tbf") == 2
    finally:
        prefix.close()


def test_the_hosts_ray_is_stopped_alone_and_joined_again(hosts):
    """What a failed join does before its next try (``join_ray``): ``stop_ray`` kills
    every Ray process of the hosts and nothing else (the master still runs), then Ray
    starts again with a node on each host and this process joins it. Runs next to last:
    the cluster's node actors and controller are gone with the old Ray."""
    net = hosts.ray_nodes
    folder = str(net.workdir / "ray")

    def ray_processes() -> list[str]:
        found = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                line = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue
            if folder in line:
                found.append(line)
        return found
    assert ray_processes()  # control: the probe sees the running Ray
    ray.shutdown()
    net.stop_ray()
    assert ray_processes() == []
    assert hosts.master.alive()
    net.join_ray(1, net.object_store_memory, namespace=hosts.namespace,
                 log_to_driver=False)
    alive = sorted(n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"])
    assert alive == sorted([net.address(0), net.address(1)])


def test_a_normal_exit_leaves_nothing_behind(hosts):
    """Runs last in this module: shuts the module's cluster down itself."""
    index, tag = hosts.ray_nodes.plan.index, hosts.cluster_tag
    assert nothing_left(index, tag)  # control: the probe sees a running cluster
    hosts.shutdown()
    assert nothing_left(index, tag) == []


DRIVER = textwrap.dedent("""
    import sys, time
    from raykv.clusters.local import local_settings
    from raykv_lab.hosts import start_hosts
    c = start_hosts(2, local_settings(global_segment_size=32 << 20), cpus_per_node=1,
                    log_to_driver=False)
    print(c.ray_nodes.plan.index, c.cluster_tag, flush=True)
    time.sleep(600)
""")


def test_kill_9_then_clean_hosts_leaves_nothing_behind():
    driver = subprocess.Popen([sys.executable, "-c", DRIVER], cwd=ROOT, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        index, tag = driver.stdout.readline().split()
        index = int(index)
    finally:
        driver.send_signal(signal.SIGKILL)
        driver.wait()
    assert leftovers()[index] is False  # its driver is gone
    time.sleep(1)
    assert nothing_left(index, tag)  # control: a killed driver leaves its hosts behind
    out = subprocess.run([sys.executable, "-m", "raykv.clusters.cli", "clean-hosts"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert f"rkvh{index}" in out.stdout
    assert nothing_left(index, tag) == []



def test_raykv_emulate_hosts_runs_with_the_node_options(tmp_path):
    """``raykv emulate-hosts 2`` with node options (segment size, a tenant quota, an
    L2 size, placement) comes up, every node actor runs with those options
    (``raykv status --json``), and SIGTERM removes every host. Before, the command
    dropped them: the nodes ran with the defaults."""
    env = os.environ | {"RAY_AUTH_MODE": "token"}  # the hosts' Ray, as the command joins it
    up = subprocess.Popen(
        [sys.executable, "-m", "raykv.clusters.cli", "emulate-hosts", "2",
         "--segment-size", "48MB", "--tenant-quota", "acme=40MB", "--l2-size", "24MB",
         "--placement", "any"],
        cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
        start_new_session=True)
    try:
        first = up.stdout.readline()
        assert first.startswith("raykv is up on 2 emulated hosts"), first
        gcs = first.split("Ray ", 1)[1].split(",", 1)[0]
        out = subprocess.run([sys.executable, "-m", "raykv.clusters.cli", "status",
                              "--address", gcs, "--json"], cwd=ROOT, env=env,
                             capture_output=True, text=True, timeout=180)
        assert out.returncode == 0, out.stderr[-2000:]
        nodes = json.loads(out.stdout)["nodes"]
        assert len(nodes) == 2
        for s in nodes.values():
            assert s["global_segment_size"] == 48 * MiB
            assert s["tenants"]["acme"]["quota"] == 40 * MiB
            assert s["l2"]["l2_bytes"] == 24 * MiB
    finally:
        up.send_signal(signal.SIGTERM)
        rest = up.communicate(timeout=180)[0]
    index = int(gcs.split(".")[2])
    assert up.returncode == 0 and "emulated hosts removed" in rest, rest
    assert index not in leftovers()


@SLOW
def test_a_host_cut_off_for_20_s_costs_misses_never_wrong_bytes():
    """Host 1's link down for 20 s: a rank on host 0 reading what host 1 stored gets
    misses or retryable errors, never other bytes, never a hang; once the link is back,
    puts from host 1 and gets of them on host 0 succeed within seconds, both hosts are
    listed, and the pages stored before the cut read back exact or miss.

    Bound: a get whose store call started waits for that call to end (a return is
    final), and Mooncake 0.3.13's TCP transfer to a cut-off peer fails only after
    10-20 s; so a call returns within ``timeout_s`` + ``STUCK_TRANSFER_S``, not within
    ``timeout_s`` (measured: 12.3 s with ``timeout_s`` = 2)."""
    from raykv.cache_actors.errors import NodeUnavailableError

    with start_hosts(2, settings=local_settings(global_segment_size=64 * MiB), cpus_per_node=1,
                     log_to_driver=False) as c:
        a, b = c.node_ids
        uid = "cut"
        config = cfg(uid, extra_config={"timeout_s": 2.0})
        writer, reader = start_rank(b, config), start_rank(a, config)
        ray.get(writer.fill.remote(3))
        keys = [f"{uid}-{i}" for i in range(4)]
        assert ray.get(writer.call.remote("batch_set_v1", keys, indices(0, 4))) == [True] * 4
        expect = [ray.get(writer.pages.remote(i * 4, 1)) for i in range(4)]
        c.ray_nodes.link_down(1)
        took = []
        try:
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                t = time.monotonic()
                try:
                    got = ray.get(reader.call.remote("batch_get_v1", keys, indices(16, 4)))
                except ray.exceptions.RayTaskError as e:
                    assert isinstance(e.cause, NodeUnavailableError), e
                    got = [False] * 4
                took.append(time.monotonic() - t)
                assert took[-1] < 2.0 + STUCK_TRANSFER_S, took
                for i, ok in enumerate(got):
                    if ok:
                        assert torch.equal(ray.get(reader.pages.remote(16 + i * 4, 1)),
                                           expect[i])
        finally:
            c.ray_nodes.link_up(1)
        print("calls while the link was down took (s):", [round(t, 2) for t in took])
        back, attempt = time.monotonic(), 0
        while True:  # fresh pages from host 1, read on host 0
            attempt += 1
            fresh = [f"{uid}-after-{attempt}-{i}" for i in range(4)]
            try:
                if ray.get(writer.call.remote("batch_set_v1", fresh, indices(0, 4))) == \
                        [True] * 4 and ray.get(reader.call.remote(
                            "batch_get_v1", fresh, indices(16, 4))) == [True] * 4:
                    break
            except ray.exceptions.RayTaskError as e:
                assert isinstance(e.cause, NodeUnavailableError), e
            except ray.exceptions.ActorUnavailableError:
                pass  # Ray's own connection to the rank on host 1 was reset by the cut
            assert time.monotonic() < back + 30, "calls did not recover within 30 s"
            time.sleep(0.5)
        print(f"puts and gets across the link again {time.monotonic() - back:.1f} s after "
              "it came back")
        for i in range(4):
            assert torch.equal(ray.get(reader.pages.remote(16 + i * 4, 1)), expect[i])
        # the pages stored before the cut: read back exact, or missed (the master
        # dropped the segment's objects when host 1's client went silent)
        got = ray.get(reader.call.remote("batch_get_v1", keys, indices(32, 4)))
        print("pages stored before the cut, read after it:", got)
        for i, ok in enumerate(got):
            if ok:
                assert torch.equal(ray.get(reader.pages.remote(32 + i * 4, 1)), expect[i])
        assert set(ray.get(c.controller.nodes.remote())) == {a, b}


@SLOW
@pytest.mark.engine("vllm")
def test_a_vllm_engine_on_one_host_loads_the_bytes_an_engine_on_another_saved(tmp_path):
    """vLLM engine A on host 1 computes a prompt (its connector saves 7 blocks across
    host 1's link); engine B on host 0 serves it with all 7 loaded from raykv, and per
    block and layer B's KV right after the load is byte-identical (SHA-256) to what A
    saved. Control: with corrupted loads no block of any layer matches."""
    import random

    from raykv_lab.engines.vllm_actors import ready, start_engine
    from raykv_lab.engines.vllm_model import make_llama

    from tests.integration.vllm_control import ControlEngine

    def prompt(seed: int) -> list[int]:
        rnd = random.Random(seed)
        return [rnd.randrange(3, 2000) for _ in range(1000)]

    model = make_llama(str(tmp_path / "tiny-llama"))
    with start_hosts(2, settings=local_settings(global_segment_size=256 * MiB), link="10gbit",
                     log_to_driver=False) as c:
        conf = {"model_name": "tiny-hosts", "load_guard": "off"}
        a = start_engine(c.node_ids[1], model, conf, enable_prefix_caching=True,
                         actor_class=ControlEngine)
        b = start_engine(c.node_ids[0], model, conf, actor_class=ControlEngine)
        ready(a, b)

        def served_by_a_then_b(seed: int) -> tuple[dict, dict]:
            ray.get([a.record_blocks.remote(True), b.record_blocks.remote(True)])
            ray.get(a.generate.remote(prompt(seed)))
            got = ray.get(b.generate.remote(prompt(seed)))
            assert got["cached"] == 7 * 128, got
            saved = ray.get(a.recorded_blocks.remote())["saved"]
            loaded = ray.get(b.recorded_blocks.remote())["loaded"]
            assert len(loaded) == 7 and set(loaded) <= set(saved)
            return saved, loaded

        saved, loaded = served_by_a_then_b(5)
        assert {h: saved[h] for h in loaded} == loaded
        ray.get(b.corrupt_loads.remote(True))
        saved, loaded = served_by_a_then_b(6)
        assert not any(s == d for h, layers in loaded.items()
                       for s, d in zip(saved[h], layers, strict=True))
        for e in (a, b):
            ray.kill(e)
