"""Pool owners, tenant proofs and tenant quotas in a node actor's pools and data calls
(``controllers.ownership``, ``controllers.tenant_quotas``), without Ray: the bindings
alone, ``NodePools`` over real shared memory (records re-adopted as a restarted actor
does) and ``NodeService``'s data path over a fake store. Every refusal has its control:
the same call by the owner succeeds. tests/integration/test_ownership.py: the same
through real Ray and Mooncake."""

from __future__ import annotations

import glob
import json
import os
import uuid

import pytest
from raykv.cache_actors.node.mooncake_codes import NOT_OWNED
from raykv.cache_actors.node.node_pools import NodePools
from raykv.cache_actors.node.node_service import NodeService
from raykv.cache_actors.node.pool_memory import PoolBudget, ShmPoolMemory
from raykv.controllers.contract import StorageConfig
from raykv.controllers.object_batch import ObjectBatch
from raykv.controllers.ownership import (
    Owner,
    OwnerBindings,
    OwnerClaim,
    bind_tenant_proof,
    check_access,
    check_tenant_digests,
    claim_of,
    proof_digest,
    tenant_digest,
)
from raykv.controllers.pool_layout import PoolLayout
from raykv.controllers.tenancy import owner_proof
from raykv.controllers.tenant_quotas import check_fits, check_tenant_quotas

from tests.unit.fakes import Registrations, ShmStore
from tests.unit.test_node_pools import NoMetrics, RealStore

LAYOUT = PoolLayout.mla(page_size=1, size=4, layer_num=1, kv_cache_dim=8, dtype="uint8",
                        itemsize=1)  # 32 bytes
SECRET_A, SECRET_B = b"a" * 32, b"b" * 32
A = OwnerClaim("dep-a", "team-a", owner_proof(SECRET_A), "a_")
A2 = OwnerClaim("dep-a2", "team-a", owner_proof(SECRET_A), "a2_")  # team-a's other one
B = OwnerClaim("dep-b", "team-b", owner_proof(SECRET_B), "b_")
PLAIN = OwnerClaim("plain", None, None, "plain_")


# ------------------------------------------------------------------- bindings alone
def test_a_tenant_proof_is_bound_on_first_use_and_another_is_refused():
    bindings = OwnerBindings()
    assert bindings.verify(A) is A and bindings.verify(A2) is A2  # same secret: bound
    forged = OwnerClaim("dep-x", "team-a", owner_proof(SECRET_B), "x_")
    with pytest.raises(ValueError, match="tenant 'team-a': the owner proof differs"):
        bindings.verify(forged)
    assert bindings.verify(B) is B  # another tenant: its own first use
    assert bindings.verify(None) is None  # a caller without a claim stays one


def test_a_tenant_bound_in_advance_refuses_even_the_first_claim_of_another_secret():
    digest = tenant_digest("team-a", {"RAYKV_TENANT_SECRET": SECRET_A.decode()})
    assert digest == proof_digest(owner_proof(SECRET_A))
    bindings = OwnerBindings(digests={"team-a": digest})
    forged = OwnerClaim("dep-x", "team-a", owner_proof(SECRET_B), "x_")
    with pytest.raises(ValueError, match="tenant 'team-a': the owner proof differs"):
        bindings.verify(forged)  # first claim on this node, yet refused
    assert bindings.verify(A) is A  # the tenant's own secret
    # Control: without the advance binding, the forger's first claim takes the name.
    squatted = OwnerBindings()
    assert squatted.verify(forged) is forged
    with pytest.raises(ValueError, match="the owner proof differs"):
        squatted.verify(A)


def test_the_controller_binds_a_tenant_proof_at_first_registration_or_in_advance():
    digests: dict[str, str] = {}
    bind_tenant_proof(digests, "team-a", owner_proof(SECRET_A), binder="the controller")
    bind_tenant_proof(digests, "team-a", owner_proof(SECRET_A), binder="the controller")
    with pytest.raises(ValueError, match="differs from the one the controller bound"):
        bind_tenant_proof(digests, "team-a", owner_proof(SECRET_B), binder="the controller")
    with pytest.raises(ValueError, match="needs the tenant's owner proof"):
        bind_tenant_proof(digests, "team-b", None, binder="the controller")
    assert digests == {"team-a": proof_digest(owner_proof(SECRET_A))}  # nothing else bound
    advance = {"team-b": proof_digest(owner_proof(SECRET_B))}
    with pytest.raises(ValueError, match="differs"):  # the first claim, yet refused
        bind_tenant_proof(advance, "team-b", owner_proof(SECRET_A), binder="the controller")
    with pytest.raises(ValueError, match="has bound 1 tenants"):
        bind_tenant_proof(advance, "team-c", owner_proof(SECRET_A), binder="the controller",
                          max_tenants=1)


@pytest.mark.parametrize("digests", [{"team a": "0" * 64}, {"t": "0" * 63}, {"t": "Z" * 64},
                                     {"t": 7}, ["t"]])
def test_bad_tenant_digests_are_refused(digests):
    with pytest.raises(ValueError):
        check_tenant_digests(digests)
    with pytest.raises(ValueError):
        OwnerBindings(digests=digests)


def test_a_deployment_stays_with_its_first_tenant():
    bindings = OwnerBindings()
    bindings.verify(A)
    for other in (OwnerClaim("dep-a", "team-b", owner_proof(SECRET_B), "a_"),
                  OwnerClaim("dep-a", None, None, "a_")):
        with pytest.raises(ValueError, match="deployment 'dep-a' was claimed on this node "
                                             "by tenant 'team-a'"):
            bindings.verify(other)
    assert bindings.verify(A) is A  # control: the first claimant again


@pytest.mark.parametrize(("claim", "msg"), [
    (OwnerClaim("d", "team-a", None), "needs the tenant's owner proof"),
    (OwnerClaim("d", "team-a", "zz" * 32), "needs the tenant's owner proof"),
    (OwnerClaim("d", None, "0" * 64), "without a tenant carries no proof"),
    (OwnerClaim("", None), "needs a deployment id"),
    (OwnerClaim("d", "bad name"), "tenant must be"),
    (OwnerClaim("d" * 600, None), "at most 512"),
    (OwnerClaim("d", None, None, 3), "key prefix must be a str"),
])
def test_malformed_claims_are_refused_and_never_echo_the_proof(claim, msg):
    with pytest.raises(ValueError, match=msg) as e:
        OwnerBindings().verify(claim)
    assert claim.proof is None or claim.proof not in str(e.value)


def test_the_tables_are_bounded_and_pool_owners_are_never_forgotten():
    owning = {"d0", "d1"}
    bindings = OwnerBindings(keep=lambda d: d in owning, max_tenants=2, max_deployments=3)
    for i in range(3):
        bindings.verify(OwnerClaim(f"d{i}"))
    bindings.verify(OwnerClaim("d3"))  # d2 owns no pool: forgotten to make room
    assert bindings.claimed("d0") and bindings.claimed("d1") and not bindings.claimed("d2")
    owning.add("d3")
    with pytest.raises(ValueError, match="bound 3 deployments that all own pools"):
        bindings.verify(OwnerClaim("d4"))
    bindings = OwnerBindings(max_tenants=2)
    bindings.verify(A)
    bindings.verify(B)
    with pytest.raises(ValueError, match="bound 2 tenants"):
        bindings.verify(OwnerClaim("dep-c", "team-c", owner_proof(b"c" * 32)))


def test_a_ranks_claim_carries_its_tenant_proof_and_key_prefix():
    config = StorageConfig(model_name="org/m", extra_config={"tenant": "team-a"})
    claim = claim_of(config, {"RAYKV_TENANT_SECRET": SECRET_A.decode()})
    assert claim.tenant == "team-a" and claim.proof == owner_proof(SECRET_A)
    # A tenant's key prefix encodes its identity, tenant first (controllers.keys).
    assert claim.key_prefix.startswith("t1.6=team-a.") and claim.check() is claim
    assert claim.deployment_id == claim.key_prefix.removesuffix("_")
    with pytest.raises(ValueError, match="RAYKV_TENANT_SECRET"):
        claim_of(config, {})
    plain = claim_of(StorageConfig(), {})
    assert plain.tenant is None and plain.proof is None and plain.key_prefix == ""
    assert "proof" not in repr(claim) or claim.proof not in repr(claim)


def test_access_errors_name_the_owner_and_legacy_pools_only_answer_claimless_callers():
    with pytest.raises(ValueError, match="belongs to deployment 'dep-a' of tenant 'team-a'"):
        check_access("kv", A.owner, B.owner, "attach")
    with pytest.raises(ValueError, match="has no owner"):
        check_access("kv", None, A.owner, "attach")
    with pytest.raises(ValueError, match="a caller without an owner claim may not"):
        check_access("kv", A.owner, None, "destroy")
    check_access("kv", A.owner, Owner("dep-a", "team-a"), "attach")  # control: its owner
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
def prefix():
    prefix = f"raykv.test-{uuid.uuid4().hex[:8]}."
    yield prefix
    for path in glob.glob(os.path.join("/dev/shm", glob.escape(prefix) + "*")):
        os.unlink(path)


def node_pools(prefix: str, quotas: dict | None = None) -> NodePools:
    """A node's pools as a (re)started actor has them, its records re-adopted."""
    node = NodePools(prefix, ShmStore(ShmPoolMemory(prefix, PoolBudget(0)), Registrations()),
                     lambda *_: None, quotas=quotas)
    node.readopt()
    return node


def create(node: NodePools, name: str, claim: OwnerClaim | None, layout=LAYOUT):
    owner = node.owners.verify(claim)
    return node.create(name, layout, owner=None if owner is None else owner.owner)


def test_another_owner_is_refused_every_pool_call_the_owner_is_served(prefix):
    node = node_pools(prefix)
    handle = create(node, "kv", A)
    for call, what in ((lambda o: node.create("kv", LAYOUT, owner=o), "create or attach"),
                       (lambda o: node.handle("kv", "n", o), "attach"),
                       (lambda o: node.destroy("kv", o), "destroy"),
                       (lambda o: node.adopt_engine("kv", "/proc/1/fd/1", LAYOUT, (0, 0), o),
                        "adopt engine memory as")):
        for other in (B.owner, Owner("dep-a", None), None):
            with pytest.raises(ValueError, match=f"belongs to deployment 'dep-a' of tenant "
                                                 f"'team-a': .* may not {what} it"):
                call(other)
    assert "kv" in node.table.pools  # nothing was removed
    # control: the owner attaches (create with the same layout), looks up, destroys
    assert create(node, "kv", A) == handle and node.handle("kv", "n", A.owner) == handle
    assert node.destroy("kv", A.owner) and "kv" not in node.table.pools
    node.close(remove=True)


def test_legacy_pools_answer_only_callers_without_a_claim(prefix):
    node = node_pools(prefix)
    create(node, "old", None)
    with pytest.raises(ValueError, match="has no owner"):
        node.handle("old", "n", PLAIN.owner)
    assert node.handle("old", "n", None).name == "old"  # control: a claimless caller
    node.close(remove=True)


def test_owners_and_tenant_proofs_survive_a_restart_through_the_records(prefix):
    node = node_pools(prefix)
    create(node, "kv-a", A)
    create(node, "plain", PLAIN)
    node.close(remove=False)  # the actor dies; pools and records stay
    with open(f"/dev/shm/{prefix}kv-a.json") as f:
        record = json.load(f)
    assert record["owner"]["tenant"] == "team-a" and A.proof not in json.dumps(record)

    again = node_pools(prefix)
    assert dict(again.table.owners) == {"kv-a": A.owner, "plain": PLAIN.owner}
    forged = OwnerClaim("dep-a", "team-a", owner_proof(SECRET_B), "a_")
    with pytest.raises(ValueError, match="owner proof differs"):  # bound from the record
        again.owners.verify(forged)
    with pytest.raises(ValueError, match="belongs to deployment 'dep-a'"):
        again.handle("kv-a", "n", B.owner)
    assert again.handle("kv-a", "n", again.owners.verify(A).owner).name == "kv-a"
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
                                        Registrations()), lambda *_: None)._records.read(path)
    assert record.owner is None and record.process.pid == os.getpid()


def test_a_tenants_pools_stop_at_its_quota_and_other_tenants_go_on(prefix):
    node = node_pools(prefix, quotas={"team-a": 2 * LAYOUT.nbytes})
    create(node, "a1", A)
    create(node, "a2", A2)  # another deployment of team-a counts under the same quota
    with pytest.raises(ValueError, match=f"tenant 'team-a' is over its quota on this node: "
                                         f"pool 'a3' needs {LAYOUT.nbytes} bytes, the "
                                         f"tenant's pools here use {2 * LAYOUT.nbytes} of "
                                         f"its quota of {2 * LAYOUT.nbytes} bytes"):
        create(node, "a3", A)
    assert "a3" not in node.table.pools and not os.path.exists(f"/dev/shm/{prefix}a3")
    create(node, "b1", B)  # team-b has no quota: unaffected
    create(node, "p1", PLAIN)  # no tenant: under no quota
    assert node.tenants() == {
        "team-a": {"pool_bytes": 2 * LAYOUT.nbytes, "pools": 2, "quota": 2 * LAYOUT.nbytes},
        "team-b": {"pool_bytes": LAYOUT.nbytes, "pools": 1, "quota": None},
        None: {"pool_bytes": LAYOUT.nbytes, "pools": 1, "quota": None}}
    node.destroy("a1", A.owner)
    create(node, "a3", A)  # control: room again once one of its pools went
    node.close(remove=True)


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
    yield node, store
    node.shutdown(remove_pools=True)


def batch(handle, keys: list[str]) -> ObjectBatch:
    b = ObjectBatch(epoch=handle.epoch)
    for i, key in enumerate(keys):
        b.add(key, handle.name, i * 8, 8)
    return b


def test_data_calls_fail_per_object_on_foreign_pools_and_keys(service):
    node, store = service
    pool_a = node.create_pool("pa", LAYOUT, owner=A)
    pool_b = node.create_pool("pb", LAYOUT, owner=B)
    mixed = batch(pool_a, ["a_1", "a_2"])
    mixed.add("b_1", "pb", 0, 8)
    mixed.add("a_3", "pb", 8, 8)
    assert node.put(mixed, caller=A) == [0, 0, NOT_OWNED, NOT_OWNED]
    assert set(store.backend.stored) == {"a_1", "a_2"}  # nothing moved from B's pool
    outside = batch(pool_a, ["a_4", "b_2"])  # A's pool, a key of another prefix
    assert node.put(outside, caller=A) == [0, NOT_OWNED]
    assert node.exists(["a_1", "b_1"], caller=A) == [1, NOT_OWNED]
    assert node.put(batch(pool_b, ["b_3"]), caller=B) == [0]  # control: B's own
    assert node.exists(["b_3"], caller=B) == [1] and node.exists(["b_3"], caller=A) == [
        NOT_OWNED]
    assert node.put(batch(pool_a, ["x"]), caller=None) == [NOT_OWNED]  # no claim
    assert node.get(batch(pool_b, ["b_3"]), caller=A) == [NOT_OWNED]
    assert "b_2" not in store.backend.stored


def test_a_claimless_caller_reaches_legacy_pools_with_any_key(service):
    node, store = service
    legacy = node.create_pool("old", LAYOUT)
    assert node.put(batch(legacy, ["anything"])) == [0]
    assert node.put(batch(legacy, ["other"]), caller=PLAIN) == [NOT_OWNED]


def test_ill_typed_batches_still_fail_whole_before_ownership(service):
    node, _ = service
    pool_a = node.create_pool("pa", LAYOUT, owner=A)
    bad = ObjectBatch(["a_1"], ["pa"], [0.5], [8], pool_a.epoch)
    for caller in (A, B, None):
        with pytest.raises(ValueError, match=r"offsets\[0\] is 0.5"):
            node.put(bad, caller=caller)
    outside = ObjectBatch(["a_1"], ["pa"], [LAYOUT.nbytes], [8], pool_a.epoch)
    with pytest.raises(ValueError, match="do not lie inside"):
        node.put(outside, caller=B)


def test_group_queries_of_another_deployment_are_refused(service):
    node, _ = service
    answers = []
    node.verify(A)  # dep-a claimed on this node
    for caller in (B, None):
        with pytest.raises(ValueError, match="dep-a"):
            node.group_exists(lambda r, e: answers.append((r, e)), "dep-a", 1, (0, 0),
                              ["k"], [], caller)
    # control: dep-a's own rank gets as far as the deployment (unknown to the fake
    # controller: its answer is that error, not a refusal)
    node.group_exists(lambda r, e: answers.append((r, e)), "dep-a", 1, (0, 0), ["k"], [],
                      A)
    node.executor.shutdown(wait=True)
    assert len(answers) == 1 and answers[0][0] is None
    assert "may not query" not in str(answers[0][1])
