"""One ``NodeSettings`` reaches every node's Mooncake client whole: each field is an
argument of the node actor, and the transport (protocol, RDMA devices, local hostname,
buffer size) arrives at Mooncake's ``setup`` call (embedded mode) or at
``mooncake_client``'s flags (standalone). ``raykv up`` builds the settings from its
options; the cluster configs' commands parse. Mooncake and Ray are faked or not
needed: the path from settings to the setup call is followed up to the store."""

from __future__ import annotations

import inspect
from dataclasses import fields, replace
from types import SimpleNamespace

import pytest
from click.testing import CliRunner
from raykv.cache_actors.node import node_actor
from raykv.cache_actors.node.client_supervisor import MooncakeClientProcess
from raykv.cache_actors.node.node_actor import NodeCacheActor
from raykv.cache_actors.node.node_store import NodeStore
from raykv.clusters.cli import main
from raykv.controllers.node_settings import PROCESS_ONLY, NodeSettings

RDMA = NodeSettings(master_address="10.0.0.9:50051",
                    metadata_server="http://10.0.0.9:8080/metadata", cluster_tag="c0ffee00",
                    global_segment_size=4 << 30, local_buffer_size=32 << 20, protocol="rdma",
                    rdma_devices="mlx5_0,mlx5_1", local_hostname="10.0.0.5")


class Reached(Exception):
    """Raised where the path under test hands its arguments on; carries them."""

    def __init__(self, what) -> None:
        super().__init__()
        self.what = what


def store_open_args(monkeypatch, settings: NodeSettings) -> tuple[tuple, dict]:
    """What ``NodeCacheActor`` built from ``settings.actor_kwargs()`` passes to
    ``NodeStore.open`` (the actor stops there)."""
    def stop(*args, **kwargs):
        raise Reached((args, kwargs))

    monkeypatch.setattr(node_actor, "NodeStore", SimpleNamespace(open=stop))
    with pytest.raises(Reached) as reached:
        NodeCacheActor("node-1", **settings.actor_kwargs())
    return reached.value.what


def test_every_field_is_an_argument_of_the_node_actor():
    kwargs = RDMA.actor_kwargs()
    inspect.signature(NodeCacheActor.__init__).bind(None, "node-1", **kwargs)
    assert set(kwargs) == {f.name for f in fields(NodeSettings)} - PROCESS_ONLY
    assert RDMA.env == {"MC_LOG_LEVEL": "ERROR"}


def test_settings_without_the_store_addresses_are_refused():
    with pytest.raises(ValueError, match="without master_address, metadata_server"):
        NodeSettings(cluster_tag="t").actor_kwargs()
    with pytest.raises(ValueError, match="needs protocol 'rdma'"):
        NodeSettings(rdma_devices="mlx5_0")


@pytest.mark.parametrize(("settings", "transport"), [
    (RDMA, ("10.0.0.5", 32 << 20, "rdma", "mlx5_0,mlx5_1")),
    # Control: the defaults give TCP and no devices, so the figures above are the
    # settings' own, not what the path would pass anyway.
    (NodeSettings(master_address="m:1", metadata_server="http://m:2/metadata",
                  cluster_tag="t", local_hostname="127.0.0.1"),
     ("127.0.0.1", 16 << 20, "tcp", "")),
])
def test_embedded_transport_reaches_the_mooncake_setup_call(monkeypatch, fake_mooncake,
                                                            settings, transport):
    args, kwargs = store_open_args(monkeypatch, settings)
    NodeStore.open(*args, **kwargs)
    host, buffer, protocol, devices = transport
    assert fake_mooncake.made[-1].args == (
        host, settings.metadata_server, settings.global_segment_size, buffer, protocol,
        devices, settings.master_address)


def test_standalone_transport_reaches_mooncake_client_flags(monkeypatch):
    args, kwargs = store_open_args(monkeypatch, replace(RDMA, standalone=True,
                                                        host_pool_bytes=1 << 30))

    def stop(self, timeout_s: float = 30.0):
        raise Reached(self)

    monkeypatch.setattr(MooncakeClientProcess, "start_or_adopt", stop)
    with pytest.raises(Reached) as reached:
        NodeStore.open(*args, **kwargs)
    flags = reached.value.what._args
    for flag in ("-host=10.0.0.5", "-protocol=rdma", "-device_names=mlx5_0,mlx5_1",
                 "-master_server_address=10.0.0.9:50051", f"-global_segment_size={4 << 30}"):
        assert flag in flags, (flag, flags)


def test_raykv_up_passes_its_transport_options_in_one_settings(monkeypatch):
    from raykv.clusters import deploy

    seen = {}

    def up(address, settings, **kwargs):
        seen.update(address=address, settings=settings, **kwargs)
        return {"mode": settings.mode, "master_address": "m:1", "metadata_server": "u",
                "node_ids": ["n"]}

    monkeypatch.setattr(deploy, "up", up)
    out = CliRunner().invoke(main, [
        "up", "--address=h:6379", "--protocol=rdma", "--rdma-devices=mlx5_0,mlx5_1",
        "--local-hostname=10.0.0.5", "--local-buffer-size=32M", "--segment-size=4GB",
        "--mooncake-log-level=WARNING"])
    assert out.exit_code == 0, out.output
    assert seen["address"] == "h:6379" and seen["namespace"] == "raykv"
    assert seen["settings"] == NodeSettings(
        global_segment_size=4 << 30, local_buffer_size=32 << 20, protocol="rdma",
        rdma_devices="mlx5_0,mlx5_1", local_hostname="10.0.0.5",
        mooncake_log_level="WARNING")
    assert seen["master_ports"] == (0, 0)  # free ports unless given
    mooncake_host = CliRunner().invoke(main, ["up", "--mooncake-host=127.0.0.1",
                                              "--master-port=50051", "--metadata-port=8080"])
    assert mooncake_host.exit_code == 0 and seen["settings"].local_hostname == "127.0.0.1"
    assert seen["master_ports"] == (50051, 8080)
    digest = "ab" * 32
    bound = CliRunner().invoke(main, ["up", f"--tenant-digest=team-a={digest}",
                                      "--tenant-quota=team-a=1GB"])
    assert bound.exit_code == 0, bound.output
    assert seen["settings"].tenant_digests == {"team-a": digest}
    assert seen["settings"].tenant_quotas == {"team-a": 1 << 30}
    assert not seen["settings"].bound_tenants_only  # first use, unless asked
    only = CliRunner().invoke(main, ["up", f"--tenant-digest=team-a={digest}",
                                     "--bound-tenants-only"])
    assert only.exit_code == 0, only.output
    assert seen["settings"].bound_tenants_only
    filled = replace(seen["settings"], master_address="m:1", metadata_server="u",
                     cluster_tag="t")
    assert filled.actor_kwargs()["bound_tenants_only"] is True  # to every node actor
    for bad in ("team-a", "team-a=xyz", f"team a={digest}"):
        out = CliRunner().invoke(main, ["up", f"--tenant-digest={bad}"])
        assert out.exit_code == 2 and "--tenant-digest" in out.output, out.output


@pytest.mark.parametrize("args", [["--rdma-devices=mlx5_0"],
                                  ["--standalone", "--host-pool-size=0"],
                                  ["--master-address=m:1", "--metadata-server=u",
                                   "--master-port=50051"]])
def test_raykv_up_refuses_contradicting_options_as_usage_errors(monkeypatch, args):
    from raykv.clusters import deploy

    monkeypatch.setattr(deploy, "up", lambda *a, **k: pytest.fail("started anyway"))
    out = CliRunner().invoke(main, ["up", *args])
    assert out.exit_code == 2, out.output


def drifted(fn_defaults: dict[str, object]) -> dict[str, tuple[object, object]]:
    """Per ``NodeSettings`` field among ``fn_defaults``, a default that is not
    ``DEFAULTS``': ``{name: (given, DEFAULTS')}``. None and an empty tuple mean "none
    given" (the settings' default, or one by mode: ``pool_budget``)."""
    from raykv.controllers.node_settings import DEFAULTS

    return {name: (value, getattr(DEFAULTS, name)) for name, value in fn_defaults.items()
            if name in {f.name for f in fields(NodeSettings)} and value not in (None, ())
            and value != getattr(DEFAULTS, name)}


def test_node_defaults_are_written_once():
    from dataclasses import asdict

    from raykv.clusters.local import LOCAL_DEFAULTS, start_local

    # start_local takes its node settings whole (no keyword of its own repeats a field)
    assert not {f.name for f in fields(NodeSettings)} & set(
        inspect.signature(start_local).parameters)
    # one machine: a smaller segment (local_hostname None: Mooncake bound to the loopback,
    # or to each emulated host's address)
    local = asdict(LOCAL_DEFAULTS)
    assert set(drifted(local)) == {"global_segment_size"}
    assert local["local_hostname"] is None
    cli_fields = {"segment_size": "global_segment_size", "confirm_ttl": "confirm_ttl_s",
                  "l2_warm_size": "l2_warm_bytes", "l2_warm_seconds": "l2_warm_s"}
    up = next(c for name, c in main.commands.items() if name == "up")
    cli = {cli_fields.get(p.name, p.name): p.type_cast_value(None, p.default)
           for p in up.params if isinstance(p.default, int | float | str)}  # flags: unset
    assert drifted(cli) == {}
    assert {"global_segment_size", "local_buffer_size", "protocol", "confirm_ttl_s",
            "mooncake_log_level", "l2_warm_bytes", "l2_warm_s"} <= set(cli)
    actor = inspect.signature(NodeCacheActor.__init__).parameters.values()
    # (Ray's tracing adds ``_ray_trace_ctx`` to the class's methods once it was made remote)
    assert [p.name for p in actor if p.default is not inspect.Parameter.empty
            and p.name != "_ray_trace_ctx"] == []
    # CONTROL: a default written again by hand, and off by one, is caught
    assert drifted({"local_buffer_size": (16 << 20) + 1, "protocol": "tcp"}) == {
        "local_buffer_size": ((16 << 20) + 1, 16 << 20)}


def test_the_host_pool_budget_defaults_by_mode():
    from raykv.controllers.node_settings import STANDALONE_POOL_BYTES, pool_budget

    assert pool_budget(None, standalone=False) == 0
    assert pool_budget(None, standalone=True) == STANDALONE_POOL_BYTES
    assert pool_budget(5, standalone=True) == 5
    out = CliRunner().invoke(main, ["up", "--help"])
    text = " ".join(out.output.split())
    assert "1G with --standalone" in text and "[default: 1G]" in text


@pytest.mark.parametrize(("field", "bad"), [
    ("l2_warm_bytes", -1), ("l2_warm_bytes", 1.5), ("l2_warm_bytes", True),
    ("l2_warm_s", 0), ("l2_warm_s", -2.0), ("l2_warm_s", float("nan")),
    ("l2_warm_s", float("inf")), ("l2_warm_s", "30")])
def test_warm_up_budgets_are_checked(monkeypatch, field, bad):
    from raykv.clusters import deploy

    with pytest.raises(ValueError, match=field):
        NodeSettings(**{field: bad})
    # CONTROL: the budgets' edges that are good (0 bytes: no warm-up)
    assert NodeSettings(l2_warm_bytes=0, l2_warm_s=0.5).l2_warm_bytes == 0
    monkeypatch.setattr(deploy, "up", lambda *a, **k: pytest.fail("started anyway"))
    out = CliRunner().invoke(main, ["up", "--l2-warm-seconds=0"])
    assert out.exit_code == 2 and "--l2-warm-seconds" in out.output


@pytest.mark.parametrize("bad, match", [
    (dict(disk_dir="/d"), "both disk_dir and disk_bytes"),
    (dict(disk_bytes=1 << 30), "both disk_dir and disk_bytes"),
    (dict(disk_dir="/d", disk_bytes=(24 << 20) - 1), "three offload buckets"),
    (dict(disk_dir="/d", disk_bytes=1 << 30, standalone=True, host_pool_bytes=1 << 30),
     "standalone mode has no disk tier"),
    (dict(disk_dir="/d", disk_bytes=1 << 30, seal_key="ab" * 31), "64 hex digits"),
])
def test_a_disk_tier_is_checked_before_any_node_starts(bad, match):
    """A disk tier needs a directory, a bound of three buckets or more, embedded mode
    and a well-formed seal key; one without a seal key reaches no node actor. Control:
    the same tier, whole, is taken, and its seal key never shows in its repr."""
    with pytest.raises(ValueError, match=match):
        NodeSettings(**bad)
    whole = NodeSettings(master_address="m:1", metadata_server="http://m/metadata",
                         cluster_tag="t", disk_dir="/d", disk_bytes=24 << 20)
    with pytest.raises(ValueError, match="seal_key"):
        whole.actor_kwargs()
    sealed = replace(whole, seal_key="ab" * 32)
    assert sealed.actor_kwargs()["disk_dir"] == "/d"
    assert "ab" * 32 not in repr(sealed)


@pytest.mark.parametrize("bad", ["LRU", "lfu", "", None, 1])
def test_the_l2_eviction_is_one_of_the_policies(monkeypatch, bad):
    from raykv.clusters import deploy
    from raykv.controllers.node_settings import L2_EVICTIONS

    with pytest.raises(ValueError, match="l2_eviction"):
        NodeSettings(l2_eviction=bad)
    # CONTROL: each policy's name is good
    assert [NodeSettings(l2_eviction=n).l2_eviction for n in L2_EVICTIONS] == list(L2_EVICTIONS)
    monkeypatch.setattr(deploy, "up", lambda *a, **k: pytest.fail("started anyway"))
    out = CliRunner().invoke(main, ["up", "--l2-eviction", "lfu"])
    assert out.exit_code == 2 and "--l2-eviction" in out.output


@pytest.mark.parametrize(("field", "bad"), [
    ("merge_max_inflight", -1), ("merge_max_inflight", 1.0), ("merge_max_inflight", True),
    ("merge_max_objects", 0), ("merge_max_objects", "2048")])
def test_the_merging_of_store_calls_is_checked(field, bad):
    with pytest.raises(ValueError, match=field):
        NodeSettings(**{field: bad})
    # CONTROL: no merging (0 calls in flight) and one object a call are good
    off = NodeSettings(merge_max_inflight=0, merge_max_objects=1)
    assert (off.merge_max_inflight, off.merge_max_objects) == (0, 1)
