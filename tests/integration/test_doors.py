"""The store's doors on a real ``start_local`` cluster: nothing of the Mooncake master's
or of its metadata server listens beyond loopback (read from the listening sockets of
their processes, as ``ss -ltnp`` shows them), and a master started the way raykv used to
start it (its own HTTP metadata server, metrics on the default host) is caught listening
on every interface, with a warning naming each port; a standalone node whose Mooncake
address is not loopback has ``mooncake_client``'s dummy-client port named the same. No
traffic leaves loopback."""

import logging
import uuid

import pytest
import ray
from raykv import local_settings, start_local
from raykv.cache_actors.listeners import Listener, listeners
from raykv.cache_actors.local_ports import free_port
from raykv.clusters.mooncake_master import MooncakeMaster
from raykv.controllers.pool_layout import MiB

WILDCARDS = {"0.0.0.0", "::"}


def test_start_local_keeps_the_masters_doors_on_loopback():
    with start_local(settings=local_settings(global_segment_size=64 * MiB), num_nodes=1) as c:
        master, metadata = listeners(c.master.proc.pid), listeners(c.master.metadata_proc.pid)
        assert {x.port for x in master} >= {c.master.rpc_port, c.master.metrics_port}
        assert {x.port for x in metadata} == {c.master.http_port}
        assert {x.address for x in master + metadata} == {"127.0.0.1"}
        assert c.master.exposed == []
        # the node actor checked its Mooncake client's ports too and reports the wide ones
        (actor,) = c.node_actors.values()
        pid = ray.get(actor.health.remote())["pid"]
        stats = ray.get(actor.stats.remote())
        named = stats.exposed_ports
        # the control of test_hosts: a single-host cluster's node advertises loopback
        assert stats.mooncake_endpoint.startswith("127.0.0.1:")
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


def test_a_standalone_nodes_dummy_client_port_beyond_loopback_is_named(caplog):
    """A standalone node whose Mooncake address is a node's (127.0.0.2 here: loopback
    still, but not 127.0.0.1, as a node's IP is not): a real ``mooncake_client`` binds
    its port for the dummy client to that address (it has one ``-host`` for that port
    and for what it advertises), so the door check names it (``exposed_ports``) with a
    warning: whoever reaches it makes the node's store calls. Control: the check before
    (every port allowed on the node's own address) named nothing of it."""
    from raykv.cache_actors.listeners import exposed
    from raykv.cache_actors.node.node_store import NodeStore

    master = MooncakeMaster("127.0.0.1")
    master.start()
    store = None
    try:
        with caplog.at_level(logging.WARNING, logger="raykv.cache_actors.node.node_store"):
            store = NodeStore.open(
                f"raykv.doors-{uuid.uuid4().hex[:8]}.", standalone=True, host="127.0.0.2",
                master_address=f"127.0.0.1:{master.rpc_port}",
                metadata_server=f"http://127.0.0.1:{master.http_port}/metadata",
                segment_size=64 * MiB, local_buffer_size=0, protocol="tcp",
                rdma_devices="", host_pool_bytes=64 * MiB)
        dummy = Listener("127.0.0.2", store.process.record.port)
        found = listeners(store.process.record.pid)
        assert dummy in found and dummy in store.exposed
        assert f"dummy client listens on {dummy}" in caplog.text
        assert dummy not in exposed(found, {"127.0.0.2", "127.0.0.1"})  # control: before
    finally:
        if store is not None:
            store.close()
        master.stop()
