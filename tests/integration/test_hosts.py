"""A raykv cluster of emulated hosts (``start_local(hosts=2)``, ``clusters.hosts``): two
network namespaces with addresses of their own on raykv's private subnet, a real Ray
node in each, a real ``mooncake_master`` on host 0. Bytes written by a rank on one host
are read by a rank on the other; every node's Mooncake endpoint is its host's address
(control: the single-host cluster's is loopback, ``test_doors``); from the other host
nothing of the master's that lists or removes keys answers while its RPC serves that
host's node actor (control: a master started with the wide flags answers
``/get_all_keys`` there); the cluster leaves nothing behind, after a normal exit and
after ``kill -9`` of its driver and ``raykv clean-hosts`` (control: before the clean-up
the namespaces are still there). Traffic goes only to loopback and to the emulated
hosts' addresses.

Root only (namespaces, links): skipped otherwise. ``RAYKV_SLOW_HOST_TESTS=1`` also runs
the slow ones (a link down for 20 s)."""

from __future__ import annotations

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
from raykv.clusters import start_local
from raykv.clusters.host_plan import HostPlan
from raykv.clusters.hosts import WORKDIR, cluster_pids, leftovers
from raykv.clusters.mooncake_master import MooncakeMaster
from raykv.controllers import StorageConfig
from raykv.controllers.pool_layout import MiB

from tests.integration.ranks import indices, start_rank

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="emulated hosts need root")
SLOW = pytest.mark.skipif(os.environ.get("RAYKV_SLOW_HOST_TESTS") != "1",
                          reason="slow: set RAYKV_SLOW_HOST_TESTS=1")
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def hosts():
    """Two emulated hosts, links shaped to 10 Gbit/s (host 0 runs the head and the
    master)."""
    with start_local(hosts=2, link="10gbit", global_segment_size=64 * MiB,
                     cpus_per_node=1, log_to_driver=False) as c:
        yield c


def cfg(uid: str, **kw) -> StorageConfig:
    return StorageConfig(model_name=f"hosts/{uid}", **kw)


def in_host(c, host: int, code: str, timeout: float = 30) -> subprocess.CompletedProcess:
    """Run python ``code`` on emulated host ``host`` (inside its namespace)."""
    return subprocess.run([*c.hosts.plan.exec_prefix(host), sys.executable, "-c", code],
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
        endpoint = ray.get(actor.stats.remote())["mooncake_endpoint"]
        assert endpoint.rpartition(":")[0] == hosts.hosts.address(hosts.hosts.host_of(node_id))
    assert hosts.master_address.startswith(hosts.hosts.address(0) + ":")


def test_from_another_host_the_master_lists_and_removes_nothing(hosts):
    """Host 1 reaches the master's RPC (its node actor is served: it joined the store)
    and the metadata server, never the metrics server that lists every key."""
    head, master = hosts.hosts.address(0), hosts.master
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


def test_a_normal_exit_leaves_nothing_behind(hosts):
    """Runs last in this module: shuts the module's cluster down itself."""
    index, tag = hosts.hosts.plan.index, hosts.cluster_tag
    assert nothing_left(index, tag)  # control: the probe sees a running cluster
    hosts.shutdown()
    assert nothing_left(index, tag) == []


DRIVER = textwrap.dedent("""
    import sys, time
    from raykv.clusters import start_local
    c = start_local(hosts=2, global_segment_size=32 << 20, cpus_per_node=1,
                    log_to_driver=False)
    print(c.hosts.plan.index, c.cluster_tag, flush=True)
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


@SLOW
def test_a_host_cut_off_for_20_s_costs_misses_never_wrong_bytes():
    """Host 1's link down for 20 s: a rank on host 0 reading what host 1 stored gets
    misses or retryable errors within its deadline, never other bytes, never a hang;
    once the link is back, calls succeed within seconds and both hosts are listed."""
    from raykv.cache_actors.errors import NodeUnavailableError

    with start_local(hosts=2, global_segment_size=64 * MiB, cpus_per_node=1,
                     log_to_driver=False) as c:
        a, b = c.node_ids
        uid = "cut"
        config = cfg(uid, extra_config={"timeout_s": 2.0})
        writer, reader = start_rank(b, config), start_rank(a, config)
        ray.get(writer.fill.remote(3))
        keys = [f"{uid}-{i}" for i in range(4)]
        assert ray.get(writer.call.remote("batch_set_v1", keys, indices(0, 4))) == [True] * 4
        expect = [ray.get(writer.pages.remote(i * 4, 1)) for i in range(4)]
        c.hosts.link_down(1)
        try:
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                t = time.monotonic()
                try:
                    got = ray.get(reader.call.remote("batch_get_v1", keys, indices(16, 4)))
                except ray.exceptions.RayTaskError as e:
                    assert isinstance(e.cause, NodeUnavailableError), e
                    got = [False] * 4
                assert time.monotonic() - t < 2.0 + 5.0  # within its deadline (+ Ray)
                for i, ok in enumerate(got):
                    if ok:
                        assert torch.equal(ray.get(reader.pages.remote(16 + i * 4, 1)),
                                           expect[i])
        finally:
            c.hosts.link_up(1)
        deadline = time.monotonic() + 30
        while True:
            try:
                if ray.get(reader.call.remote("batch_get_v1", keys, indices(16, 4))) == \
                        [True] * 4:
                    break
            except ray.exceptions.RayTaskError:
                pass
            assert time.monotonic() < deadline, "reads did not recover within 30 s"
            time.sleep(0.5)
        for i in range(4):
            assert torch.equal(ray.get(reader.pages.remote(16 + i * 4, 1)), expect[i])
        assert set(ray.get(c.controller.nodes.remote())) == {a, b}
