"""Pool owners, owner sessions and tenant quotas through a real node actor (real Ray,
real mooncake_master): another deployment's create of a pool name, its attach, destroy,
engine-memory adoption, data calls and group query are refused, a wrong tenant secret is
refused, a call proof or a signed session answer seen once and sent again by another
process is refused, an impostor's claim on a tenant's deployment id and a claim with an
emptied key prefix are refused while the tenant is served, a tenant's pools stop at its
quota while another tenant goes on, and `raykv status` shows the bytes per tenant.
CONTROL for every refusal: the same call by the owner succeeds. The ranks are
CacheClients of this process (one per deployment; a tenant's secret is in
RAYKV_TENANT_SECRET while its client is made)."""

from __future__ import annotations

import io
import os
import uuid

import pytest
import ray
import torch
from raykv import CacheClient, local_settings, start_local
from raykv.cache_actors.data_ops import DataOp
from raykv.clusters import deploy
from raykv.clusters.status_view import render_status
from raykv.controllers import PoolName, StorageConfig
from raykv.controllers.contract import PoolTransfer
from raykv.controllers.deployments import deployment_id
from raykv.controllers.naming import node_actor_name
from raykv.controllers.node_records import PoolOwner, TenantUse
from raykv.controllers.ownership import tenant_digest
from raykv.controllers.pool_layout import PoolLayout
from raykv.controllers.result_codes import NOT_OWNED
from raykv.controllers.tenancy import TENANT_SECRET_ENV
from rich.console import Console

from tests.integration.ranks import MHA, indices, planned

SECRET_Q, SECRET_R, SECRET_D, FORGED = "q" * 32, "r" * 32, "d" * 32, "f" * 32
POOL_BYTES = 2 * 64 * 2 * 2 * 8 * 2  # K and V: 64 slots x 2 layers x 2 heads x 8 dims, fp16
QUOTA = 3 * POOL_BYTES
UNTENANTED = 32 * POOL_BYTES  # the bound of the pools without a tenant


@pytest.fixture(scope="module")
def cluster():
    """One node whose tenant ``team-q`` may hold three MHA pools, whose pools without a
    tenant may hold ``UNTENANTED`` bytes together, and to which tenant ``team-d`` is
    bound in advance (its digest in the cluster's settings)."""
    digest = tenant_digest("team-d", {TENANT_SECRET_ENV: SECRET_D})
    with start_local(settings=local_settings(global_segment_size=256 << 20,
                                             tenant_quotas={"team-q": QUOTA},
                                             tenant_digests={"team-d": digest},
                                             untenanted_pool_bytes=UNTENANTED), num_nodes=1) as c:
        yield c


def client(monkeypatch, model: str, tenant: str | None = None,
           secret: str | None = None) -> CacheClient:
    """A rank of deployment ``model`` (of ``tenant``, with ``secret`` in the env)."""
    extra = {} if tenant is None else {"tenant": tenant}
    if secret is not None:
        monkeypatch.setenv(TENANT_SECRET_ENV, secret)
    try:
        return CacheClient(StorageConfig(model_name=model, extra_config=extra))
    finally:
        monkeypatch.delenv(TENANT_SECRET_ENV, raising=False)


def round_trip(c: CacheClient, pool, uid: str) -> None:
    """Pages out of ``pool`` into the store and back into other slots, exact."""
    c.register_mem_pool_host(pool)
    pool.kv_buffer.copy_(torch.randn(pool.kv_buffer.shape).to(pool.kv_buffer.dtype))
    keys = [f"{uid}-{i}" for i in range(2)]
    assert c.batch_set_v1(keys, indices(0, 2)) == [True, True]
    assert c.batch_get_v1(keys, indices(16, 2)) == [True, True]
    assert torch.equal(pool.kv_buffer[:, 16:24], pool.kv_buffer[:, 0:8])


def test_another_deployment_is_refused_the_owner_is_served(cluster, monkeypatch):
    uid = uuid.uuid4().hex[:8]
    a, b = client(monkeypatch, f"own/a{uid}"), client(monkeypatch, f"own/b{uid}")
    name = f"shared-name-{uid}"
    pool = a.create_host_pool("mha", name=name, **MHA)
    owner = f"belongs to deployment 'own-a{uid}_'"
    with pytest.raises(ValueError, match=owner):  # today's silent attach: refused
        b.create_host_pool("mha", name=name, **MHA)
    with pytest.raises(ValueError, match=owner):
        b.attach_host_pool(name)
    with pytest.raises(ValueError, match=owner):
        b.destroy_host_pool(name)
    # CONTROL: the owner attaches by create (same layout) and by name, and its pages
    # still round-trip through the pool nobody else could touch
    assert a.create_host_pool("mha", name=name, **MHA).handle == pool.handle
    again = client(monkeypatch, f"own/a{uid}")  # a restarted rank of the same deployment
    assert again.attach_host_pool(name).handle == pool.handle
    round_trip(a, pool, f"{uid}-a")

    # Data calls naming the owner's pool from the other deployment: every object fails,
    # on the channel and on the Ray route; the owner's same batch moves (CONTROL).
    plan = planned(a, [PoolTransfer(PoolName.KV, [f"{uid}-x"], indices(0, 1))],
                   write=True)
    assert b._link.data(DataOp.PUT, plan.batch) == [NOT_OWNED] * len(plan.batch)
    actor = cluster.node_actors[a.node_id]
    assert ray.get(actor.put.remote(plan.batch, claim=b.owner_claim())) == [NOT_OWNED] * len(
        plan.batch)
    assert ray.get(actor.get.remote(plan.batch)) == [NOT_OWNED] * len(plan.batch)
    assert a._link.data(DataOp.PUT, plan.batch) == [0] * len(plan.batch)
    assert b._link.data(DataOp.GET, plan.batch) == [NOT_OWNED] * len(plan.batch)
    assert ray.get(actor.get.remote(plan.batch, claim=a.owner_claim())) == plan.batch.sizes
    assert b._link.data(DataOp.EXISTS, plan.batch.keys) == [NOT_OWNED] * len(plan.batch)
    assert a._link.data(DataOp.EXISTS, plan.batch.keys) == [1] * len(plan.batch)

    assert a.destroy_host_pool(name)  # CONTROL: the owner destroys it
    assert b.create_host_pool("mha", name=name, **MHA)  # the name is free again
    assert b.destroy_host_pool(name)


def test_engine_memory_adoption_of_another_owners_name_is_refused(cluster, monkeypatch):
    uid = uuid.uuid4().hex[:8]
    a, b = client(monkeypatch, f"adopt/a{uid}"), client(monkeypatch, f"adopt/b{uid}")
    layout = a.create_host_pool("mha", name=f"layout-{uid}", **MHA).layout
    fd = os.memfd_create("sglang_host_pool_test", os.MFD_CLOEXEC)
    os.ftruncate(fd, layout.nbytes)
    st = os.fstat(fd)
    path, inode = f"/proc/{os.getpid()}/fd/{fd}", (st.st_dev, st.st_ino)
    try:
        with pytest.raises(ValueError, match=f"belongs to deployment 'adopt-a{uid}_'"):
            b.adopt_engine_pool(f"layout-{uid}", path, layout, inode)
        engine = a.adopt_engine_pool(f"engine-{uid}", path, layout, inode)  # CONTROL
        with pytest.raises(ValueError, match=f"belongs to deployment 'adopt-a{uid}_'"):
            b.adopt_engine_pool(f"engine-{uid}", path, layout, inode)
        with pytest.raises(ValueError, match=f"belongs to deployment 'adopt-a{uid}_'"):
            b.attach_host_pool(f"engine-{uid}")
        assert a.adopt_engine_pool(f"engine-{uid}", path, layout, inode).handle == \
            engine.handle  # CONTROL: the owner adopts it again
        round_trip(a, engine, f"{uid}-e")
        assert a.destroy_host_pool(f"engine-{uid}")
    finally:
        a.destroy_host_pool(f"layout-{uid}")
        os.close(fd)


def test_a_group_query_of_another_deployment_is_refused(cluster, monkeypatch):
    uid = uuid.uuid4().hex[:8]
    a, b = client(monkeypatch, f"grp/a{uid}"), client(monkeypatch, f"grp/b{uid}")
    pool = a.create_host_pool("mha", **MHA)
    round_trip(a, pool, f"{uid}-g")
    keys = [f"{uid}-g-{i}" for i in range(2)]
    dep = a.register_deployment()
    assert a.group_exists(keys).kv_hit_pages == 2  # CONTROL: the owner's query
    reg = a._group._current[0]
    refused = f"may not query the group of deployment '{dep}'"
    with pytest.raises(ValueError, match=refused):  # the channel (the home node is here)
        b._link.data(DataOp.GROUP_EXISTS, dep, reg.version, (0, 0), "", keys, [],
                     node_id=reg.home_node)
    home = ray.get_actor(node_actor_name(reg.home_node), namespace=cluster.namespace)
    with pytest.raises(ValueError, match=refused):  # the Ray route
        ray.get(home.group_exists.remote(dep, reg.version, (0, 0), "", keys, [],
                                         b.owner_claim()))
    with pytest.raises(ValueError, match="needs its owner claim"):  # no claim at all
        ray.get(home.group_exists.remote(dep, reg.version, (0, 0), "", keys, []))
    assert ray.get(home.group_exists.remote(dep, reg.version, (0, 0), "", keys, [],
                                            a.owner_claim())).kv_hit_pages == 2  # CONTROL
    assert a.group_exists(keys).kv_hit_pages == 2
    a.destroy_host_pool(pool)


def test_a_wrong_tenant_secret_is_refused(cluster, monkeypatch):
    uid = uuid.uuid4().hex[:8]
    first = client(monkeypatch, f"proof/{uid}", "team-r", SECRET_R)
    pool = first.create_host_pool("mha", **MHA)  # team-r's owner key is bound here now
    forged = client(monkeypatch, f"proof/{uid}x", "team-r", FORGED)
    with pytest.raises(ValueError, match="tenant 'team-r': the owner key differs"):
        forged.create_host_pool("mha", **MHA)
    with pytest.raises(ValueError, match="owner key differs"):  # its channel too
        forged._link.data(DataOp.EXISTS, [f"{uid}-0"])
    with pytest.raises(ValueError, match="owner key differs"):  # and the Ray route
        forged.owner_claim()  # its session is refused: no call proof to send
    # CONTROL: another deployment of team-r with the right secret is served
    second = client(monkeypatch, f"proof/{uid}y", "team-r", SECRET_R)
    round_trip(second, second.create_host_pool("mha", **MHA), f"{uid}-r")
    assert first.destroy_host_pool(pool)


def test_a_tenant_bound_in_advance_is_never_claimed_by_another_secret(cluster,
                                                                      monkeypatch):
    """``team-d``'s digest came with the cluster's settings: a process with another secret
    that claims the name first on the node is refused all the same (with first-use
    binding it would have taken the name: see the unit test's control)."""
    uid = uuid.uuid4().hex[:8]
    squatter = client(monkeypatch, f"bound/{uid}x", "team-d", FORGED)
    with pytest.raises(ValueError, match="tenant 'team-d': the owner key differs"):
        squatter.create_host_pool("mha", **MHA)
    # CONTROL: the tenant's own secret is served
    owner = client(monkeypatch, f"bound/{uid}", "team-d", SECRET_D)
    pool = owner.create_host_pool("mha", **MHA)
    round_trip(owner, pool, f"{uid}-d")
    assert owner.destroy_host_pool(pool)


def test_a_tenant_stops_at_its_quota_and_status_shows_its_use(cluster, monkeypatch):
    uid = uuid.uuid4().hex[:8]
    q = client(monkeypatch, f"quota/q{uid}", "team-q", SECRET_Q)
    r = client(monkeypatch, f"quota/r{uid}", "team-r", SECRET_R)
    pools = [q.create_host_pool("mha", **MHA) for _ in range(3)]  # up to the quota
    assert pools[0].nbytes == POOL_BYTES
    with pytest.raises(ValueError, match=f"tenant 'team-q' is over its quota on this node: "
                                         f"pool '.*' needs {POOL_BYTES} bytes, the tenant's "
                                         f"pools here use {QUOTA} of its quota of {QUOTA} "
                                         "bytes"):
        q.create_host_pool("mha", **MHA)
    others = [r.create_host_pool("mha", **MHA) for _ in range(4)]  # team-r: no quota
    round_trip(q, pools[0], f"{uid}-q")  # the tenant's pools keep serving

    state = deploy.status(cluster.address, cluster.namespace)
    (node,) = state["nodes"].values()
    assert node.tenants["team-q"] == TenantUse(pool_bytes=QUOTA, pools=3, quota=QUOTA)
    assert node.tenants["team-r"].pool_bytes >= 4 * POOL_BYTES
    assert node.tenants["team-r"].quota is None
    assert node.pools[pools[0].name].owner == PoolOwner(deployment=deployment_id(q.config),
                                                        tenant="team-q")
    out = io.StringIO()
    render_status(state, Console(file=out, width=100))
    assert "team-q 24.0 KiB of 24.0 KiB quota (3 pools)" in out.getvalue(), out.getvalue()

    assert q.destroy_host_pool(pools.pop())
    pools.append(q.create_host_pool("mha", **MHA))  # CONTROL: room again
    for p in pools:
        q.destroy_host_pool(p)
    for p in others:
        r.destroy_host_pool(p)


def test_pools_without_a_tenant_stop_at_their_bound_and_tenants_go_on(cluster, monkeypatch):
    """Pools any process in the cluster can make (no tenant, no secret) share one bound
    per node; a tenant's pools go on, and `raykv status` shows their use against it.
    Before, nothing but host_pool_bytes (no limit in embedded mode by default) bounded
    them. CONTROL: room again once one of them is destroyed."""
    uid = uuid.uuid4().hex[:8]
    plain = client(monkeypatch, f"untenanted/{uid}")

    def untenanted() -> TenantUse:
        (node,) = deploy.status(cluster.address, cluster.namespace)["nodes"].values()
        return node.untenanted

    assert untenanted().quota == UNTENANTED
    room = UNTENANTED - untenanted().pool_bytes
    fill = plain.create_host_pool("mha", **(MHA | {"size": 64 * room // POOL_BYTES}))
    with pytest.raises(ValueError, match=f"the pools without a tenant are over their bound "
                                         f"on this node: pool '.*' needs {POOL_BYTES} bytes, "
                                         f"they use {UNTENANTED} of {UNTENANTED} bytes"):
        plain.create_host_pool("mha", **MHA)
    bound = client(monkeypatch, f"untenanted/d{uid}", "team-d", SECRET_D)
    pool = bound.create_host_pool("mha", **MHA)  # a tenant: unaffected
    round_trip(bound, pool, f"{uid}-d")
    out = io.StringIO()
    render_status(deploy.status(cluster.address, cluster.namespace),
                  Console(file=out, width=100))
    assert "no tenant 256.0 KiB of 256.0 KiB bound" in out.getvalue(), out.getvalue()
    assert plain.destroy_host_pool(fill)
    plain.destroy_host_pool(plain.create_host_pool("mha", **MHA))  # CONTROL: room again
    assert bound.destroy_host_pool(pool)


L2_PAGE = PoolLayout.vllm(page_size=4, size=4, layer_num=1, head_num=1, head_dim=64,
                         dtype="bfloat16", itemsize=2)  # 512 bytes per page


def test_an_l2_pool_shrinks_to_what_is_left_of_its_tenants_quota(cluster, monkeypatch):
    """A tenant's L2 pool takes at most what is left of its tenant's quota on the node
    (as it takes at most what is left of the node's L2 bytes), down to one page; with
    less than one page left it is refused, naming the quota. CONTROL: a tenant without
    a quota gets every page it asked for."""
    uid = uuid.uuid4().hex[:8]
    q = client(monkeypatch, f"l2q/q{uid}", "team-q", SECRET_Q)
    q2 = client(monkeypatch, f"l2q/q2{uid}", "team-q", SECRET_Q)
    r = client(monkeypatch, f"l2q/r{uid}", "team-r", SECRET_R)
    page = L2_PAGE.object_bytes
    asked = 2 * QUOTA // page  # twice the whole quota
    staging = q.create_host_pool("mha", **MHA)  # what an engine makes first
    pools = []
    try:
        l2 = q.l2().open(L2_PAGE, asked)
        assert l2 is not None
        pools.append((q, l2))
        assert l2.size // L2_PAGE.page_size == (QUOTA - POOL_BYTES) // page
        state = deploy.status(cluster.address, cluster.namespace)
        (node,) = state["nodes"].values()
        assert node.tenants["team-q"] == TenantUse(pool_bytes=QUOTA, pools=2, quota=QUOTA)
        # the quota is full: another deployment of the tenant gets no page
        with pytest.raises(ValueError, match="tenant 'team-q' is over its quota on this "
                                             "node"):
            q2.l2().open(L2_PAGE, asked)
        other = r.l2().open(L2_PAGE, asked)  # CONTROL: no quota, every page asked
        pools.append((r, other))
        assert other.size // L2_PAGE.page_size == asked
    finally:
        for c, p in pools:
            c.destroy_host_pool(p)
        q.destroy_host_pool(staging)


def test_pools_without_an_owner_answer_only_callers_without_one(cluster, monkeypatch):
    """A pool made by a caller that sends no owner claim (an older raykv) has no owner:
    a rank of any deployment is refused it, a caller without a claim is served."""
    uid = uuid.uuid4().hex[:8]
    a = client(monkeypatch, f"legacy/{uid}")
    layout = a.create_host_pool("mha", name=f"probe-{uid}", **MHA).layout
    actor = cluster.node_actors[a.node_id]
    name = f"legacy-{uid}"
    handle = ray.get(actor.create_pool.remote(name, layout))
    with pytest.raises(ValueError, match="has no owner"):
        a.attach_host_pool(name)
    assert ray.get(actor.get_pool.remote(name)) == handle  # CONTROL: no claim: served
    assert ray.get(actor.destroy_pool.remote(name))
    a.destroy_host_pool(f"probe-{uid}")


@ray.remote(num_cpus=0)
def another_process(actor, method: str, *args):
    """``method`` of ``actor`` called from a Ray worker, a process without the tenant
    secret (what any process that saw a message on the wire can do); the error's type
    and text, or ``("ok", result)``."""
    try:
        return "ok", ray.get(getattr(actor, method).remote(*args))
    except Exception as e:
        return type(e).__name__, str(e)


@ray.remote(num_cpus=0)
def bind_from_another_process(path: str, claim) -> tuple[str, str]:
    """Open the node actor's channel with ``claim`` from a Ray worker."""
    from raykv.cache_actors.rank.channel_client import ChannelClient
    try:
        ChannelClient(path, bind=claim).close()
        return "ok", ""
    except Exception as e:
        return type(e).__name__, str(e)


def test_a_proof_seen_once_is_refused_when_another_process_sends_it_again(cluster,
                                                                          monkeypatch):
    """A tenant's call proof, channel bind and signed session answer, each used once by
    the rank (CONTROL: served), then sent again by another process: refused every time.
    The old static owner proof replays for ever (test_owner_sessions.py's control)."""
    uid = uuid.uuid4().hex[:8]
    rank = client(monkeypatch, f"replay/{uid}", "team-r", SECRET_R)
    pool = rank.create_host_pool("mha", **MHA)
    round_trip(rank, pool, f"{uid}-r")
    key = rank.key_scheme.prefix + "k"
    actor = cluster.node_actors[rank.node_id]

    seen = rank.owner_claim(None, "exists", [key])  # a Ray call's claim, on the wire
    assert ray.get(actor.exists.remote([key], seen)) == [0]  # CONTROL: its one use
    kind, text = ray.get(another_process.remote(actor, "exists", [key], seen))
    assert kind == "ValueError" or "ValueError" in kind, (kind, text)
    assert "shown before" in text

    path = ray.get(actor.channel_path.remote())
    bind = rank.owner_claim(None, "channel")  # a channel connection's bind
    assert ray.get(bind_from_another_process.remote(path, bind)) == ("ok", "")  # CONTROL
    kind, text = ray.get(bind_from_another_process.remote(path, bind))
    assert kind == "ValueError" and "shown before" in text, (kind, text)

    # A proof taken off the wire before its call arrives, spent first on another
    # method or other arguments: refused, and the rank's own call is served after.
    name = pool.name
    seen = rank.owner_claim(None, "exists", [key])
    for method, args in (("destroy_pool", (name,)), ("clear_objects", ()),
                         ("exists", ([key + "x"],))):
        kind, text = ray.get(another_process.remote(actor, method, *args, seen))
        assert "does not verify" in text, (method, kind, text)
    assert ray.get(actor.exists.remote([key], seen)) == [0]  # CONTROL: its own call
    assert rank.attach_host_pool(name) is not None  # the pool is still there

    from raykv.controllers.owner_keys import answer_challenge
    from raykv.controllers.ownership import owner_key
    owner = owner_key("team-r", {TENANT_SECRET_ENV: SECRET_R})
    base = rank._link.owner.base
    request, _ = answer_challenge(owner, ray.get(actor.challenge.remote()),
                                  base.deployment_id, "team-r", base.key_prefix)
    assert ray.get(actor.open_session.remote(base, request))  # CONTROL: answered once
    kind, text = ray.get(another_process.remote(actor, "open_session", base, request))
    assert "challenge is unknown, answered already" in text, (kind, text)
    round_trip(rank, pool, f"{uid}-s")  # the rank goes on
    assert rank.destroy_host_pool(pool)


def test_an_impostors_claim_on_a_tenants_deployment_is_refused_and_the_tenant_served(
        cluster, monkeypatch):
    """A process without the secret claims the tenant's deployment id (derivable from
    public fields) first, without a tenant or with the tenant's name and a made-up call
    proof, and with an emptied key prefix: every claim is refused, nothing is bound,
    and the tenant's rank then makes its pool and moves its pages (on the old design the
    first claim bound the id to no tenant and the tenant was refused on this node)."""
    uid = uuid.uuid4().hex[:8]
    config = StorageConfig(model_name=f"imp/{uid}", extra_config={"tenant": "team-r"})
    from raykv.controllers.ownership import OwnerClaim, claim_of
    theirs = claim_of(config)  # public: model, tenant name, layout
    actor = next(iter(cluster.node_actors.values()))
    layout = client(monkeypatch, f"imp/probe{uid}").create_host_pool(
        "mha", name=f"probe-{uid}", **MHA).layout
    for claim, why in (
            (OwnerClaim(theirs.deployment_id, None, None, theirs.key_prefix),
             "another key prefix than its own"),
            (OwnerClaim(theirs.deployment_id, None, None, ""), "cannot empty its key prefix"),
            (OwnerClaim(theirs.deployment_id, "team-r", f"{'0' * 32}.1.{'0' * 32}",
                        theirs.key_prefix), "no such owner session")):
        kind, text = ray.get(another_process.remote(actor, "create_pool", f"imp-{uid}",
                                                    layout, None, claim))
        assert kind != "ok" and why in text, (kind, text)
    rank = client(monkeypatch, f"imp/{uid}", "team-r", SECRET_R)
    assert rank._link.owner.base == theirs
    pool = rank.create_host_pool("mha", name=f"imp-{uid}", **MHA)  # CONTROL: served
    round_trip(rank, pool, f"{uid}-i")
    assert rank.destroy_host_pool(pool)


def test_an_empty_key_prefix_claim_is_refused_and_tenant_keys_stay_out_of_reach(
        cluster, monkeypatch):
    """A deployment with a key prefix cannot claim an empty one (which turned the per-key
    check off); the default deployment (no model, tag or tenant: no prefix) and callers
    without a claim are refused every tenant's keys. CONTROL: the tenant sees its key."""
    uid = uuid.uuid4().hex[:8]
    from raykv.controllers.ownership import OwnerClaim
    tenant = client(monkeypatch, f"empty/{uid}", "team-r", SECRET_R)
    pool = tenant.create_host_pool("mha", **MHA)
    round_trip(tenant, pool, f"{uid}-e")
    keys = planned(tenant, [PoolTransfer(PoolName.KV, [f"{uid}-e-0"], indices(0, 1))],
                   write=True).batch.keys
    actor = cluster.node_actors[tenant.node_id]
    plain = client(monkeypatch, f"empty/p{uid}")
    emptied = OwnerClaim(plain._link.owner.base.deployment_id, None, None, "")
    kind, text = ray.get(another_process.remote(actor, "exists", keys, emptied))
    assert "cannot empty its key prefix" in text, (kind, text)
    default = CacheClient(StorageConfig())  # the one deployment without a prefix
    assert ray.get(actor.exists.remote(keys, default.owner_claim())) == [NOT_OWNED] * len(keys)
    assert ray.get(actor.exists.remote(keys)) == [NOT_OWNED] * len(keys)  # no claim
    assert ray.get(actor.exists.remote(keys, tenant.owner_claim(None, "exists", keys))) == \
        [1] * len(keys)
    assert ray.get(actor.exists.remote(keys, plain.owner_claim())) == [NOT_OWNED] * len(keys)
    assert tenant.destroy_host_pool(pool)


def test_a_client_never_carries_its_secret_into_rays_object_store(cluster, monkeypatch):
    rank = client(monkeypatch, f"pickle/{uuid.uuid4().hex[:8]}", "team-r", SECRET_R)
    with pytest.raises(TypeError, match="never pickled"):
        ray.put(rank)
    with pytest.raises(TypeError, match="never pickled"):
        another_process.remote(rank, "health")
    assert ray.get(ray.put(rank.config)) == rank.config  # CONTROL: its config travels
