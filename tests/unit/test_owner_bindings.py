"""Pool owners, owner sessions and tenant quotas in a node actor's pools and data calls
(``controllers.ownership``, ``controllers.owner_keys``, ``controllers.owner_sessions``,
``controllers.tenant_quotas``), without Ray: the bindings alone, ``NodePools`` over real
shared memory (records re-adopted as a restarted actor does) and ``NodeService``'s data
path over a fake store. Every refusal has its control: the same call by the owner
succeeds. tests/unit/test_owner_sessions.py: challenges, sessions and replays;
tests/integration/test_ownership.py: the same through real Ray and Mooncake."""

from __future__ import annotations

import json
import os
import uuid
from dataclasses import replace

import pytest
from raykv.cache_actors.errors import NodeUnavailableError
from raykv.cache_actors.node.node_memory import node_memory_bytes
from raykv.cache_actors.node.node_pools import NodePools
from raykv.cache_actors.node.node_service import NodeService
from raykv.cache_actors.node.pool_memory import PoolBudget, ShmPoolMemory
from raykv.cache_actors.rank.rank_owner import RankOwner
from raykv.controllers.contract import StorageConfig
from raykv.controllers.node_records import TenantUse
from raykv.controllers.node_settings import NodeSettings
from raykv.controllers.object_batch import ObjectBatch
from raykv.controllers.ownership import (
    Owner,
    OwnerBindings,
    OwnerClaim,
    bind_tenant_key,
    check_access,
    check_tenant_digests,
    claim_of,
    owner_key,
    tenant_digest,
)
from raykv.controllers.pool_layout import PoolLayout
from raykv.controllers.result_codes import NOT_OWNED
from raykv.controllers.tenant_quotas import check_fits, check_tenant_quotas, untenanted_bound

from tests.unit.fakes import FakeBackend, NoMetrics, ShmStore
from tests.unit.test_node_pools import RealStore

LAYOUT = PoolLayout.mla(page_size=1, size=4, layer_num=1, kv_cache_dim=8, dtype="uint8",
                        itemsize=1)  # 32 bytes
SECRET_A, SECRET_B = b"a" * 32, b"b" * 32
KEY_A = tenant_digest("team-a", {"RAYKV_TENANT_SECRET": SECRET_A.decode()})
KEY_B = tenant_digest("team-b", {"RAYKV_TENANT_SECRET": SECRET_B.decode()})


def config(model: str, tenant: str | None = None) -> StorageConfig:
    return StorageConfig(model_name=model,
                         extra_config={"tenant": tenant} if tenant else None)


CONFIGS = {"a": config("a", "team-a"), "a2": config("a2", "team-a"),  # team-a's two
           "b": config("b", "team-b"), "plain": config("plain"),
           "x": config("x", "team-a")}  # "x": team-a's name, another secret (a forger)
SECRETS = {"a": SECRET_A, "a2": SECRET_A, "b": SECRET_B, "x": SECRET_B}
OWNERS = {name: claim_of(c).owner for name, c in CONFIGS.items()}
A, B, PLAIN = OWNERS["a"], OWNERS["b"], OWNERS["plain"]


class Ranks:
    """One rank per entry of ``CONFIGS``, each with its owner sessions at ``verifier``
    (an ``OwnerBindings`` or a ``NodeService``): ``ranks("a")`` is a fresh claim."""

    def __init__(self, verifier) -> None:
        self.verifier = verifier
        self.owners = {n: RankOwner.of_config(c, {"RAYKV_TENANT_SECRET": SECRETS[n].decode()}
                                              if n in SECRETS else {})
                       for n, c in CONFIGS.items()}

    def ask(self, method: str, *args):
        return getattr(self.verifier, method)(*args)

    def __call__(self, name: str, purpose: str = "") -> OwnerClaim:
        """A fresh claim of rank ``name`` for a call of ``purpose`` (the verifier checks
        it bound to that purpose: ``OwnerClaim.for_call``; a claim no entry bound has
        purpose ``""``)."""
        return self.owners[name].claim("node", self.ask, purpose)


# ------------------------------------------------------------------- bindings alone
def test_a_tenant_key_is_bound_on_first_use_and_another_is_refused():
    bindings = OwnerBindings()
    ranks = Ranks(bindings)
    assert bindings.verify(ranks("a")).owner == A  # its session bound team-a's key
    assert bindings.verify(ranks("a2")).owner == OWNERS["a2"]  # same secret
    with pytest.raises(ValueError, match="tenant 'team-a': the owner key differs"):
        ranks("x")  # another secret: its session is refused
    assert bindings.verify(ranks("b")).owner == B  # another tenant: its own first use
    assert bindings.verify(None) is None  # a caller without a claim stays one
    assert bindings.digest("team-a") == KEY_A


def test_a_tenant_bound_in_advance_refuses_even_the_first_claim_of_another_secret():
    bindings = OwnerBindings(digests={"team-a": KEY_A})
    ranks = Ranks(bindings)
    with pytest.raises(ValueError, match="tenant 'team-a': the owner key differs"):
        ranks("x")  # first claim on this node, yet refused
    assert bindings.verify(ranks("a")).owner == A  # the tenant's own secret
    # Control: without the advance binding, the forger's first claim takes the name.
    squatted = OwnerBindings()
    squat = Ranks(squatted)
    assert squatted.verify(squat("x")).tenant == "team-a"
    with pytest.raises(ValueError, match="the owner key differs"):
        squat("a")


def test_bound_tenants_only_binds_no_tenant_on_first_use():
    bindings = OwnerBindings(digests={"team-a": KEY_A}, bound_only=True)
    ranks = Ranks(bindings)
    with pytest.raises(ValueError, match="tenant 'team-b' is not bound on this cluster"):
        ranks("b")
    assert bindings.digest("team-b") is None  # nothing filled the table
    assert bindings.verify(ranks("a")).owner == A  # control: the bound tenant is served
    assert Ranks(OwnerBindings(digests={"team-a": KEY_A}))("b")  # control: first use
    bindings.bind(B, KEY_B)  # a pool record at restart still binds its tenant


def test_the_controllers_tenant_keys_bind_at_first_registration_or_in_advance():
    keys: dict[str, str] = {}
    bind_tenant_key(keys, "team-a", KEY_A, binder="the controller")
    bind_tenant_key(keys, "team-a", KEY_A, binder="the controller")
    with pytest.raises(ValueError, match="differs from the one the controller bound"):
        bind_tenant_key(keys, "team-a", KEY_B, binder="the controller")
    assert keys == {"team-a": KEY_A}  # nothing else bound
    advance = {"team-b": KEY_B}
    with pytest.raises(ValueError, match="differs"):  # the first claim, yet refused
        bind_tenant_key(advance, "team-b", KEY_A, binder="the controller")
    with pytest.raises(ValueError, match="has bound 1 tenants"):
        bind_tenant_key(advance, "team-c", KEY_A, binder="the controller", max_tenants=1)
    with pytest.raises(ValueError, match="binds no tenant on first use"):
        bind_tenant_key(advance, "team-c", KEY_A, binder="the controller", bound_only=True)


@pytest.mark.parametrize("digests", [{"team a": "0" * 64}, {"t": "0" * 63}, {"t": "Z" * 64},
                                     {"t": 7}, ["t"]])
def test_bad_tenant_digests_are_refused(digests):
    with pytest.raises(ValueError):
        check_tenant_digests(digests)
    with pytest.raises(ValueError):
        OwnerBindings(digests=digests)


def test_a_deployment_stays_with_its_first_tenant():
    bindings = OwnerBindings()
    ranks = Ranks(bindings)
    plain = OwnerClaim("p_", None, None, "p_")
    bindings.verify(plain)
    tenant = ranks("a")
    bindings.bind(Owner("p_", None), None)  # control: the first claimant again
    with pytest.raises(ValueError, match="deployment 'p_' was claimed on this node "
                                         "without a tenant, not by tenant 'team-a'"):
        bindings.bind(Owner("p_", "team-a"), KEY_A)
    assert bindings.verify(tenant).owner == A


TENANT_ID = claim_of(CONFIGS["a"]).deployment_id
TENANT_PREFIX = claim_of(CONFIGS["a"]).key_prefix


@pytest.mark.parametrize(("claim", "msg"), [
    (OwnerClaim("d_", "team-a", None, "d_"), "needs a call proof"),
    (OwnerClaim("d_", None, "0" * 64, "d_"), "without a tenant carries no proof"),
    (OwnerClaim("", None), "needs a deployment id"),
    (OwnerClaim("d_", "bad name", None, "d_"), "tenant must be"),
    (OwnerClaim("d" * 600, None), "at most 512"),
    (OwnerClaim("d_", None, None, 3), "key prefix must be a str"),  # type: ignore[arg-type]
    # an impostor without the secret claims the tenant's deployment id without a tenant
    (OwnerClaim(TENANT_ID, None, None, TENANT_PREFIX), "another key prefix than its own"),
    (OwnerClaim(TENANT_ID, None, None, ""), "cannot empty its key prefix"),
    (OwnerClaim("m_", None, None, ""), "cannot empty its key prefix"),
    (OwnerClaim("m_", None, None, "n_"), "another key prefix than its own"),
    (OwnerClaim("t1.x_", None, None, "t1.x_"), "or a tenant's"),
])
def test_malformed_or_disagreeing_claims_are_refused_and_never_echo_the_proof(claim, msg):
    with pytest.raises(ValueError, match=msg) as e:
        OwnerBindings().verify(claim)
    assert claim.proof is None or claim.proof not in str(e.value)


@pytest.mark.parametrize("fields", [
    {"key_prefix": ""},  # a tenant's claim that empties its key prefix
    {"key_prefix": "a_"},  # ... or names a prefix that is no tenant's
    {"deployment_id": "other"},  # ... or another deployment id than its prefix's
    {"tenant": "team-b"},  # ... or another tenant than its prefix names
])
def test_a_tenants_session_cannot_be_opened_for_disagreeing_fields(fields):
    bindings = OwnerBindings()
    owner = RankOwner(replace(claim_of(CONFIGS["a"]), **fields),
                      owner_key("team-a", {"RAYKV_TENANT_SECRET": SECRET_A.decode()}))
    with pytest.raises(ValueError, match="is not the tenant's key prefix"):
        owner.claim("node", lambda m, *a: getattr(bindings, m)(*a), "")
    # control: the rank's own fields open a session
    assert bindings.verify(Ranks(bindings)("a")).owner == A


def test_an_impostors_claim_leaves_the_tenants_deployment_to_the_tenant():
    """On the old design a claim's fields were taken as given: this impostor's claim
    bound the tenant's deployment id to no tenant and the tenant was refused after."""
    bindings = OwnerBindings()
    impostor = OwnerClaim(TENANT_ID, None, None, TENANT_PREFIX)
    impostor._check_shape()  # well formed: only the agreement of its fields refuses it
    with pytest.raises(ValueError):
        bindings.verify(impostor)
    assert not bindings.claimed(TENANT_ID)
    assert bindings.verify(Ranks(bindings)("a")).owner == A  # the tenant is served


def test_the_tables_are_bounded_and_pool_owners_are_never_forgotten():
    owning = {"d0_", "d1_"}
    bindings = OwnerBindings(keep=lambda d: d in owning, max_tenants=2, max_deployments=3)
    for i in range(3):
        bindings.verify(OwnerClaim(f"d{i}_", None, None, f"d{i}_"))
    bindings.verify(OwnerClaim("d3_", None, None, "d3_"))  # d2 owns no pool: forgotten
    assert bindings.claimed("d0_") and bindings.claimed("d1_") and not bindings.claimed("d2_")
    owning.add("d3_")
    with pytest.raises(ValueError, match="bound 3 deployments without a tenant that all own pools"):
        bindings.verify(OwnerClaim("d4_", None, None, "d4_"))
    bindings = OwnerBindings(max_tenants=2)
    ranks = Ranks(bindings)
    ranks("a")
    ranks("b")
    third = RankOwner.of_config(config("c", "team-c"), {"RAYKV_TENANT_SECRET": "c" * 32})
    with pytest.raises(ValueError, match="bound 2 tenants"):
        third.claim("node", ranks.ask, "")


def test_claims_anyone_can_make_never_crowd_out_the_tenants_bound_in_advance():
    """Claims without a tenant need no secret, nor (without ``bound_only``) do those of
    tenants bound on first use: each kind fills a table of its own. On the old design
    one table held them all: three unauthenticated claims owning a tiny pool each
    filled it, and the tenant bound in advance was refused, even with ``bound_only``."""
    for bound_only in (True, False):
        bindings = OwnerBindings(keep=lambda d: True, digests={"team-a": KEY_A},
                                 bound_only=bound_only, max_deployments=3)
        for i in range(3):
            bindings.verify(OwnerClaim(f"d{i}_", None, None, f"d{i}_"))
        with pytest.raises(ValueError, match="bound 3 deployments without a tenant"):
            bindings.verify(OwnerClaim("d3_", None, None, "d3_"))
        ranks = Ranks(bindings)
        assert bindings.verify(ranks("a")).owner == A
        assert bindings.verify(ranks("a2")).owner == OWNERS["a2"]
    # without bound_only, tenants anyone binds on first use fill their own table too
    first_use = [RankOwner.of_config(config(f"m{i}", f"team-{i}"),
                                     {"RAYKV_TENANT_SECRET": f"{i}" * 32}) for i in range(4)]
    for owner in first_use[:3]:
        bindings.verify(owner.claim("node", ranks.ask, ""))
    with pytest.raises(ValueError, match="bound 3 deployments of tenants bound on first use"):
        first_use[3].claim("node", ranks.ask, "")
    assert bindings.verify(ranks("a")).owner == A  # the tenant bound in advance: served
    team_a = [RankOwner.of_config(config(f"a{i}", "team-a"),
                                  {"RAYKV_TENANT_SECRET": SECRET_A.decode()}) for i in (3, 4)]
    bindings.verify(team_a[0].claim("node", ranks.ask, ""))  # its third deployment
    with pytest.raises(ValueError, match="bound 3 deployments of tenants bound in advance"):
        team_a[1].claim("node", ranks.ask, "")


def test_a_ranks_claim_carries_a_call_proof_and_its_key_prefix():
    ranks = Ranks(OwnerBindings())
    claim = ranks("a")
    # A tenant's key prefix encodes its identity, tenant first (controllers.keys).
    assert claim.key_prefix.startswith("t1.6=team-a.") and claim.tenant == "team-a"
    assert claim.deployment_id == claim.key_prefix.removesuffix("_")
    assert claim.proof != ranks("a").proof  # a fresh proof per call
    with pytest.raises(ValueError, match="RAYKV_TENANT_SECRET"):
        RankOwner.of_config(CONFIGS["a"], {})
    plain = claim_of(StorageConfig())
    assert plain.tenant is None and plain.proof is None and plain.key_prefix == ""
    assert plain.deployment_id == "default" and plain.check_fields() is plain
    assert claim.proof not in repr(claim)


def test_access_errors_name_the_owner_and_legacy_pools_only_answer_claimless_callers():
    with pytest.raises(ValueError, match=f"belongs to deployment '{TENANT_ID}' of tenant "
                                         "'team-a'"):
        check_access("kv", A, B, "attach")
    with pytest.raises(ValueError, match="has no owner"):
        check_access("kv", None, A, "attach")
    with pytest.raises(ValueError, match="a caller without an owner claim may not"):
        check_access("kv", A, None, "destroy")
    check_access("kv", A, Owner(TENANT_ID, "team-a"), "attach")  # control: its owner
    check_access("kv", None, None, "attach")


def test_quota_options_are_checked_and_a_pool_over_it_names_tenant_quota_and_use():
    assert check_tenant_quotas({"team-a": 64}) == {"team-a": 64}
    for bad in ({"team a": 1}, {"t": 0}, {"t": 1.5}, {"t": True}, [("t", 1)]):
        with pytest.raises(ValueError):
            check_tenant_quotas(bad)
    check_fits({"team-a": 64}, "team-a", "p", 32, 32)  # exactly full: fits
    with pytest.raises(ValueError, match=r"tenant 'team-a' is over its quota on this node: "
                                         r"pool 'p' needs 32 bytes, the tenant's pools here "
                                         r"use 40 of its quota of 64 bytes \(24 left\)"):
        check_fits({"team-a": 64}, "team-a", "p", 32, 40)
    check_fits({"team-a": 64}, "team-b", "p", 1 << 40, 0)  # no quota of its own
    check_fits({"team-a": 64}, None, "p", 1 << 40, 0)  # no tenant: under no quota


# ---------------------------------------------------------------- a node's pools
@pytest.fixture
def prefix(shm_prefix):
    return shm_prefix


def node_pools(prefix: str, quotas: dict | None = None, untenanted: int = 0) -> NodePools:
    """A node's pools as a (re)started actor has them, its records re-adopted."""
    node = NodePools(prefix, ShmStore(ShmPoolMemory(prefix, PoolBudget(0)), FakeBackend()),
                     lambda *_: None, quotas=(quotas or {}) | {None: untenanted})
    node.readopt()
    return node


TENANT_KEYS = {"team-a": KEY_A, "team-b": KEY_B}


def create(node: NodePools, name: str, owner: Owner | None, layout=LAYOUT):
    """Pool ``name`` of ``owner``, bound first as a verified claim binds it."""
    if owner is not None:
        node.owners.bind(owner, TENANT_KEYS.get(owner.tenant or ""))
    return node.create(name, layout, owner=owner)


def test_another_owner_is_refused_every_pool_call_the_owner_is_served(prefix):
    node = node_pools(prefix)
    handle = create(node, "kv", A)
    for call, what in ((lambda o: node.create("kv", LAYOUT, owner=o), "create or attach"),
                       (lambda o: node.handle("kv", "n", o), "attach"),
                       (lambda o: node.destroy("kv", o), "destroy"),
                       (lambda o: node.adopt_engine("kv", "/proc/1/fd/1", LAYOUT, (0, 0), o),
                        "adopt engine memory as")):
        for other in (B, Owner(TENANT_ID, None), None):
            with pytest.raises(ValueError, match=f"belongs to deployment '{TENANT_ID}' of "
                                                 f"tenant 'team-a': .* may not {what} it"):
                call(other)
    assert "kv" in node.table.pools  # nothing was removed
    # control: the owner attaches (create with the same layout), looks up, destroys
    assert create(node, "kv", A) == handle and node.handle("kv", "n", A) == handle
    assert node.destroy("kv", A) and "kv" not in node.table.pools
    node.close(remove=True)


def test_legacy_pools_answer_only_callers_without_a_claim(prefix):
    node = node_pools(prefix)
    create(node, "old", None)
    with pytest.raises(ValueError, match="has no owner"):
        node.handle("old", "n", PLAIN)
    assert node.handle("old", "n", None).name == "old"  # control: a claimless caller
    node.close(remove=True)


def test_owners_and_tenant_keys_survive_a_restart_through_the_records(prefix):
    node = node_pools(prefix)
    create(node, "kv-a", A)
    create(node, "plain", PLAIN)
    node.close(remove=False)  # the actor dies; pools and records stay
    with open(f"/dev/shm/{prefix}kv-a.json") as f:
        record = json.load(f)
    assert record["owner"] == {"deployment": TENANT_ID, "tenant": "team-a",
                               "owner_key": KEY_A}  # the public key only

    again = node_pools(prefix)
    assert dict(again.table.owners) == {"kv-a": A, "plain": PLAIN}
    ranks = Ranks(again.owners)
    with pytest.raises(ValueError, match="owner key differs"):  # bound from the record
        ranks("x")
    with pytest.raises(ValueError, match=f"belongs to deployment '{TENANT_ID}'"):
        again.handle("kv-a", "n", B)
    assert again.handle("kv-a", "n", again.owners.verify(ranks("a")).owner).name == "kv-a"
    again.close(remove=True)


def test_an_older_record_names_its_process_and_its_pool_has_no_owner(prefix):
    node = node_pools(prefix)
    create(node, "kv", None)
    node.close(remove=False)
    path = f"/dev/shm/{prefix}kv.json"
    with open(path) as f:
        raw = json.load(f)
    raw["owner"] = [os.getpid(), 1]  # what an older raykv wrote: the process
    with open(path, "w") as f:
        json.dump(raw, f)
    record = NodePools(prefix, ShmStore(ShmPoolMemory(prefix, PoolBudget(0)),
                                        FakeBackend()), lambda *_: None)._records.read(path)
    assert record.owner is None and record.process.pid == os.getpid()


def test_a_tenants_pools_stop_at_its_quota_and_other_tenants_go_on(prefix):
    node = node_pools(prefix, quotas={"team-a": 2 * LAYOUT.nbytes})
    create(node, "a1", A)
    create(node, "a2", OWNERS["a2"])  # another deployment of team-a counts under the same quota
    with pytest.raises(ValueError, match=f"tenant 'team-a' is over its quota on this node: "
                                         f"pool 'a3' needs {LAYOUT.nbytes} bytes, the "
                                         f"tenant's pools here use {2 * LAYOUT.nbytes} of "
                                         f"its quota of {2 * LAYOUT.nbytes} bytes"):
        create(node, "a3", A)
    assert "a3" not in node.table.pools and not os.path.exists(f"/dev/shm/{prefix}a3")
    create(node, "b1", B)  # team-b has no quota: unaffected
    create(node, "p1", PLAIN)  # no tenant: under no quota
    assert node.tenants() == {
        "team-a": TenantUse(pool_bytes=2 * LAYOUT.nbytes, pools=2, quota=2 * LAYOUT.nbytes),
        "team-b": TenantUse(pool_bytes=LAYOUT.nbytes, pools=1, quota=None),
        None: TenantUse(pool_bytes=LAYOUT.nbytes, pools=1, quota=None)}
    node.destroy("a1", A)
    create(node, "a3", A)  # control: room again once one of its pools went
    node.close(remove=True)


@pytest.mark.parametrize("bound", [True, False], ids=["bounded", "control-unbounded"])
def test_pools_without_a_tenant_stop_at_their_bound_and_tenants_go_on(prefix, bound):
    """Pools anyone can make (a deployment without a tenant, a caller without a claim)
    share one bound; a tenant's pools are unaffected. Control: without a bound (what
    embedded mode had by default) they take whatever the node has."""
    node = node_pools(prefix, untenanted=2 * LAYOUT.nbytes if bound else 0)
    create(node, "p1", PLAIN)
    create(node, "legacy", None)  # legacy pools count under the same bound
    if bound:
        with pytest.raises(ValueError, match=f"the pools without a tenant are over their "
                                             f"bound on this node: pool 'p2' needs "
                                             f"{LAYOUT.nbytes} bytes, they use "
                                             f"{2 * LAYOUT.nbytes} of {2 * LAYOUT.nbytes}"):
            create(node, "p2", PLAIN)
        assert "p2" not in node.table.pools and not os.path.exists(f"/dev/shm/{prefix}p2")
    else:
        create(node, "p2", PLAIN)
    create(node, "a1", A)  # a tenant's pool: unaffected
    create(node, "b1", B)
    untenanted = node.tenants()[None]
    assert untenanted.quota == (2 * LAYOUT.nbytes if bound else None)
    assert untenanted.pools == (2 if bound else 3)
    node.destroy("legacy", None)
    create(node, "p3", PLAIN)  # room again once one of them went
    node.close(remove=True)


def test_the_default_bound_of_pools_without_a_tenant_is_half_the_nodes_memory():
    assert untenanted_bound(None, False, 64 << 30) == 32 << 30  # embedded: a share
    assert untenanted_bound(None, True, 64 << 30) == 0  # standalone: host_pool_bytes
    assert untenanted_bound(1 << 20, False, 64 << 30) == 1 << 20  # given: as given
    assert untenanted_bound(0, False, 64 << 30) == 0  # 0: none
    assert NodeSettings().untenanted_pool_bytes is None
    for bad in (-1, 1.5, "1G", True):
        with pytest.raises(ValueError, match="untenanted_pool_bytes"):
            NodeSettings(untenanted_pool_bytes=bad)
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert 0 < node_memory_bytes() <= physical


# ------------------------------------------------------------------ data calls
@pytest.fixture
def service():
    prefix = f"raykv.test-{uuid.uuid4().hex[:8]}."
    store = RealStore("embedded", prefix)
    store.backend.release.set()  # puts never wait here
    stored = store.backend.stored
    store.backend.exists = lambda keys: [int(k in stored) for k in keys]
    node = NodeService("fake-node-id", prefix, store, NoMetrics(), lambda _: None,
                       segment_size=0, group_window_s=0.0, confirm_ttl_s=0.0)
    yield node, store, Ranks(node)
    node.shutdown(remove_pools=True)


def batch(handle, keys: list[str]) -> ObjectBatch:
    b = ObjectBatch(epoch=handle.epoch)
    for i, key in enumerate(keys):
        b.add(key, handle.name, i * 8, 8)
    return b


PA, PB = claim_of(CONFIGS["a"]).key_prefix, claim_of(CONFIGS["b"]).key_prefix


def test_data_calls_fail_per_object_on_foreign_pools_and_keys(service):
    node, store, ranks = service
    pool_a = node.create_pool("pa", LAYOUT, claim=ranks("a"))
    pool_b = node.create_pool("pb", LAYOUT, claim=ranks("b"))
    mixed = batch(pool_a, [PA + "1", PA + "2"])
    mixed.add(PB + "1", "pb", 0, 8)
    mixed.add(PA + "3", "pb", 8, 8)
    assert node.put(mixed, claim=ranks("a")) == [0, 0, NOT_OWNED, NOT_OWNED]
    assert set(store.backend.stored) == {PA + "1", PA + "2"}  # nothing from B's pool
    outside = batch(pool_a, [PA + "4", PB + "2"])  # A's pool, a key of another prefix
    assert node.put(outside, claim=ranks("a")) == [0, NOT_OWNED]
    assert node.exists([PA + "1", PB + "1"], claim=ranks("a")) == [1, NOT_OWNED]
    assert node.put(batch(pool_b, [PB + "3"]), claim=ranks("b")) == [0]  # control
    assert node.exists([PB + "3"], claim=ranks("b")) == [1]
    assert node.exists([PB + "3"], claim=ranks("a")) == [NOT_OWNED]
    assert node.put(batch(pool_a, ["x"]), claim=None) == [NOT_OWNED]  # no claim
    assert node.get(batch(pool_b, [PB + "3"]), claim=ranks("a")) == [NOT_OWNED]
    assert PB + "2" not in store.backend.stored


def test_a_claimless_caller_reaches_legacy_pools_with_any_key_but_a_tenants(service):
    node, store, ranks = service
    legacy = node.create_pool("old", LAYOUT)
    assert node.put(batch(legacy, ["anything"])) == [0]
    assert node.put(batch(legacy, ["other"]), claim=ranks("plain")) == [NOT_OWNED]
    # a tenant's keys are out of reach of every caller without that tenant's prefix:
    # no claim, the default deployment's empty prefix, another deployment's prefix
    default = node.create_pool("dflt", LAYOUT, claim=claim_of(StorageConfig()))
    for pool, claim in ((legacy, None), (default, claim_of(StorageConfig()))):
        assert node.put(batch(pool, [PA + "k", "free"]), claim=claim) == [NOT_OWNED, 0]
        assert node.exists([PA + "k"], claim=claim) == [NOT_OWNED]
    assert PA + "k" not in store.backend.stored
    own = node.create_pool("pa", LAYOUT, claim=ranks("a"))  # control: the tenant's own
    assert node.put(batch(own, [PA + "k"]), claim=ranks("a")) == [0]


def test_ill_typed_batches_still_fail_whole_before_ownership(service):
    node, _, ranks = service
    pool_a = node.create_pool("pa", LAYOUT, claim=ranks("a"))
    bad = ObjectBatch([PA + "1"], ["pa"], [0.5], [8], pool_a.epoch)
    for claim in ("a", "b", None):
        with pytest.raises(ValueError, match=r"offsets\[0\] is 0.5"):
            node.put(bad, claim=claim and ranks(claim))
    outside = ObjectBatch([PA + "1"], ["pa"], [LAYOUT.nbytes], [8], pool_a.epoch)
    with pytest.raises(ValueError, match="do not lie inside"):
        node.put(outside, claim=ranks("b"))


def test_group_queries_of_another_deployment_are_refused(service):
    node, _, ranks = service
    answers = []
    node.verify(ranks("a"))  # team-a's deployment claimed on this node
    for claim in ("b", None):
        with pytest.raises(ValueError, match="t1.6=team-a"):
            node.group_exists(lambda r, e: answers.append((r, e)), TENANT_ID, 1, (0, 0), "",
                              ["k"], [], claim and ranks(claim))
    # control: the deployment's own rank gets as far as the deployment (unknown to the
    # fake controller: its answer is that error, not a refusal)
    node.group_exists(lambda r, e: answers.append((r, e)), TENANT_ID, 1, (0, 0), "", ["k"],
                      [], ranks("a"))
    node.executor.shutdown(wait=True)
    assert len(answers) == 1 and answers[0][0] is None
    assert "may not query" not in str(answers[0][1])


def test_the_node_service_turns_a_lost_session_into_a_retryable_error(service):
    """A node actor that restarted holds none of the rank's sessions: the rank sees a
    retryable NodeUnavailableError (it re-attaches and opens a new one)."""
    node, _, ranks = service
    lost = Ranks(OwnerBindings())("a")  # a session of another (an earlier) actor
    with pytest.raises(NodeUnavailableError, match="no such owner session"):
        node.verify(lost)
    assert node.verify(ranks("a")) is not None  # control: a session opened here
