"""The store's doors on a real ``start_local`` cluster: nothing of the Mooncake master's
or of its metadata server listens beyond loopback (read from the listening sockets of
their processes, as ``ss -ltnp`` shows them), and a master started the way raykv used to
start it (its own HTTP metadata server, metrics on the default host) is caught listening
on every interface, with a warning naming each port. No traffic leaves loopback."""

import logging

import pytest
import ray
from raykv import start_local
from raykv.cache_actors.listeners import Listener, listeners
from raykv.cache_actors.local_ports import free_port
from raykv.clusters.mooncake_master import MooncakeMaster
from raykv.controllers.pool_layout import MiB

WILDCARDS = {"0.0.0.0", "::"}


def test_start_local_keeps_the_masters_doors_on_loopback():
    with start_local(num_nodes=1, global_segment_size=64 * MiB) as c:
        master, metadata = listeners(c.master.proc.pid), listeners(c.master.metadata_proc.pid)
        assert {x.port for x in master} >= {c.master.rpc_port, c.master.metrics_port}
        assert {x.port for x in metadata} == {c.master.http_port}
        assert {x.address for x in master + metadata} == {"127.0.0.1"}
        assert c.master.exposed == []
        # the node actor checked its Mooncake client's ports too and reports the wide ones
        (actor,) = c.node_actors.values()
        pid = ray.get(actor.health.remote())["pid"]
        stats = ray.get(actor.stats.remote())
        named = stats["exposed_ports"]
        # the control of test_hosts: a single-host cluster's node advertises loopback
        assert stats["mooncake_endpoint"].startswith("127.0.0.1:")
        mine = {str(x) for x in listeners(pid)}
        assert set(named) <= mine and not any(x.startswith("127.") for x in named)
        print("the node's Mooncake client listens beyond loopback on", named)


@pytest.mark.parametrize("old", [False, True], ids=["now", "old-flags"])
def test_a_master_listening_wider_is_named_in_a_warning(old, caplog):
    """Control: the flags raykv used to start the master with (its own HTTP metadata
    server, ``-http_metadata_server_host=127.0.0.1``, metrics on the default host) leave
    two servers on the wildcard address; ``check_doors`` finds them."""
    metadata_port = free_port()
    args = ["-enable_http_metadata_server=true", "-http_metadata_server_host=127.0.0.1",
            f"-http_metadata_server_port={metadata_port}", "-metrics_host=0.0.0.0"] \
        if old else []
    master = MooncakeMaster("127.0.0.1", extra_args=args)
    with caplog.at_level(logging.WARNING, logger="raykv.clusters.mooncake_master"):
        master.start()
    try:
        found = set(listeners(master.proc.pid))
        wide = {x for x in found if x.address in WILDCARDS}
        if not old:
            assert not wide and master.exposed == []
            return
        assert wide == {Listener("0.0.0.0", metadata_port),
                        Listener("0.0.0.0", master.metrics_port)}
        assert {x for _, x in master.exposed} == wide
        for x in wide:
            assert f"listens on {x}" in caplog.text
    finally:
        master.stop()
