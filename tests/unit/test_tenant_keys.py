"""Unambiguous identities (pure logic): a tenant's key prefix names exactly one identity
(property test over adversarial tuples, and parsed back), SGLang's prefix without a
tenant stays as it is but the registry refuses a second identity under it, pools'
bytes are part of the group spec, and page hashes are keyed without the secret ever
reaching a key scheme, a registration or a pool spec."""

from __future__ import annotations

import dataclasses
import pickle
import random

import pytest
from raykv.controllers.contract import PoolName, PoolTransfer, StorageConfig
from raykv.controllers.deployments import Deployment, DeploymentRegistry, PoolSpec
from raykv.controllers.keyed_hashes import KeyedHashes
from raykv.controllers.keys import Identity, KeyScheme, key_prefix, parse_prefix
from raykv.controllers.tenancy import (
    OWNER_KEY,
    PAGE_HASHES,
    keyed_page_hash,
    page_key,
    sub_key,
)

SECRET = b"s" * 32
KV = PoolSpec(PoolName.KV, "mha", ("k", "v"), ("bfloat16", "bfloat16"), 16, "page_first",
              (4096, 4096))
# Characters that delimit or escape something somewhere: "_" (key parts), "/" (model
# names, SGLang maps it to "-"), "-", digits (field lengths), ":", "." "=" "~" "%" (this
# encoding's own), a space and a non-ASCII letter.
ALPHABET = ["_", "/", "-", ":", ".", "=", "~", "%", "%2F", "0", "1", "12", "a", "B", " ",
            "é", "t1", "acme"]


def text(rng: random.Random) -> str | None:
    """None, "" or up to 4 adversarial pieces."""
    n = rng.randrange(-1, 5)
    return None if n < 0 else "".join(rng.choice(ALPHABET) for _ in range(n))


def identity(rng: random.Random) -> Identity:
    return Identity(text(rng), text(rng), text(rng), text(rng), text(rng),
                    rng.choice([None, 1, 10, 16, 101]), rng.choice([1, 2, 11]),
                    rng.choice([1, 2, 21]), rng.choice([False, True]))


def test_distinct_identities_never_share_a_tenant_prefix_and_each_parses_back():
    rng = random.Random(1234)
    seen: dict[str, Identity] = {}
    for _ in range(5000):
        ident = identity(rng)
        if ident.tenant is None:
            ident = dataclasses.replace(ident, tenant=text(rng) or "")
        prefix = ident.prefix
        assert seen.setdefault(prefix, ident) == ident, (prefix, ident, seen[prefix])
        assert parse_prefix(prefix) == ident
        assert prefix.endswith("_") and "_" not in prefix[:-1]
    assert len(seen) > 4000  # the generator is not degenerate


@pytest.mark.parametrize("bad", ["", "org-m_", "t1_", "t1.~_", "t1" + ".~" * 9 + "_",
                                 "t1" + ".~" * 6 + ".01=1.1=1.1=0_",
                                 "t1" + ".~" * 6 + ".1=1.1=1.1=2_",
                                 "t1" + ".~" * 6 + ".1=1.1=1.1=0.~_",
                                 "t1.9=a" + ".~" * 5 + ".1=1.1=1.1=0_"])
def test_what_is_not_a_tenant_prefix_does_not_parse(bad):
    with pytest.raises(ValueError, match="tenant key prefix"):
        parse_prefix(bad)


def base(**kw) -> StorageConfig:
    extra = {k: kw.pop(k) for k in ("tenant", "extra_backend_tag", "model_revision",
                                    "kv_dtype", "page_size") if k in kw}
    return StorageConfig(extra_config=extra, **kw)


# Pairs of ranks of different identities that SGLang's prefix does not tell apart.
COLLIDING = {
    "slash or dash": (dict(model_name="org/m"), dict(model_name="org-m")),
    "tag and model split": (dict(model_name="c", extra_backend_tag="a_b"),
                            dict(model_name="b_c", extra_backend_tag="a")),
    "model revision": (dict(model_name="org/m", model_revision="r1"),
                       dict(model_name="org/m", model_revision="r2")),
    "kv dtype": (dict(model_name="org/m", kv_dtype="bfloat16"),
                 dict(model_name="org/m", kv_dtype="fp8_e4m3")),
    "page size": (dict(model_name="org/m", page_size=16), dict(model_name="org/m",
                                                                page_size=32)),
}


@pytest.mark.parametrize("pair", COLLIDING.values(), ids=COLLIDING.keys())
def test_colliding_pairs(pair):
    a, b = (base(**kw) for kw in pair)
    # Control: SGLang's prefix (kept as it is without a tenant) is one for both, which is
    # why the registry must refuse the second.
    assert key_prefix(a.model_name, a.extra_backend_tag) == \
        key_prefix(b.model_name, b.extra_backend_tag)
    assert KeyScheme.from_config(a).kv_keys("h") == KeyScheme.from_config(b).kv_keys("h")
    reg = DeploymentRegistry()
    reg.register_rank(a, [KV], "n1")
    with pytest.raises(ValueError, match="another identity than the deployment registered "
                                         "under the same key prefix.*tenant.*extra_backend_tag"):
        reg.register_rank(b, [KV], "n2")
    # With a tenant the prefixes differ, and so do the deployments.
    ta, tb = (base(tenant="acme", **kw) for kw in pair)
    assert KeyScheme.from_config(ta).prefix != KeyScheme.from_config(tb).prefix
    assert reg.register_rank(ta, [KV], "n1") is not reg.register_rank(tb, [KV], "n2")


def test_tenants_and_sizes_are_in_the_tenant_prefix_only():
    a = base(model_name="org/m", tenant="a")
    assert KeyScheme.from_config(a).prefix != KeyScheme.from_config(base(model_name="org/m",
                                                                         tenant="b")).prefix
    assert Identity.from_config(a).prefix != Identity.from_config(
        base(model_name="org/m", tenant="a", tp_size=2)).prefix
    # Without a tenant the prefix is SGLang's, byte for byte.
    assert KeyScheme.from_config(base(model_name="org/m", extra_backend_tag="t",
                                      model_revision="r", kv_dtype="bf16", page_size=4,
                                      tp_size=2)).kv_keys("h") == ["t_org-m_h_0_k",
                                                                   "t_org-m_h_0_v"]


def test_deployment_ids_are_injective():
    ids = {Identity.from_config(base(**kw)).deployment_id
           for kw in ({}, dict(model_name="default"), dict(model_name="org/m"),
                      dict(model_name="org/m", tenant="x"), dict(model_name="org-m", tenant="x"))}
    assert len(ids) == 5 and "default" in ids


def test_a_rank_without_a_tenant_never_takes_a_tenants_deployment():
    """Anyone can compute a tenant's prefix and make it theirs with a tag; the keys they
    name are not the tenant's (no keyed hashes), and neither is their deployment."""
    reg = DeploymentRegistry()
    victim = base(model_name="org/m", tenant="acme")
    prefix = Identity.from_config(victim).prefix
    squatter = base(extra_backend_tag=prefix[:-1])
    assert KeyScheme.from_config(squatter).prefix == prefix
    first = reg.register_rank(squatter, [dataclasses.replace(KV, dtypes=("x", "x"))], "n")
    dep = reg.register_rank(victim, [KV], "n")
    assert dep is not first and dep.tenant == "acme"


def test_identity_keys_are_validated():
    cfg = base(model_revision="abc", kv_dtype="fp8", page_size=16)
    assert (cfg.model_revision, cfg.kv_dtype, cfg.page_size) == ("abc", "fp8", 16)
    for key, bad in (("model_revision", 3), ("kv_dtype", b"x"), ("page_size", "16"),
                     ("page_size", 0), ("page_size", True)):
        with pytest.raises(ValueError, match=f"extra_config\\['{key}'\\] must be"):
            StorageConfig(extra_config={key: bad})


def test_the_tenant_is_part_of_the_deployment_record_and_its_scheme():
    reg = DeploymentRegistry()
    cfg = base(model_name="org/m", tenant="acme", model_revision="r1", tp_size=2, tp_rank=1)
    dep = reg.register_rank(cfg, [KV], "n1")
    assert (dep.tenant, dep.model_revision, dep.deployment_id) == (
        "acme", "r1", Identity.from_config(cfg).prefix[:-1])
    assert dep.key_scheme(1, 0) == KeyScheme.from_config(cfg)
    assert Deployment.from_dict(dep.to_dict()) == dep


# ------------------------------------------------------------- pools' bytes
@pytest.mark.parametrize("tenant", [None, "acme"])
@pytest.mark.parametrize(("change", "match"), [
    (dict(dtypes=("float8_e4m3fn",) * 2), "dtypes"),
    (dict(page_size=32, page_bytes=(8192, 8192)), "page_size"),
    (dict(order="layer_first"), "order"),
])
def test_a_pool_of_other_bytes_is_refused_tenant_or_not(tenant, change, match):
    reg = DeploymentRegistry()
    cfg = dict(model_name="org/m", tp_size=2, tenant=tenant)
    reg.register_rank(base(tp_rank=0, **cfg), [KV], "n1")
    with pytest.raises(ValueError, match=f"pool 'kv' is {match} .* on this rank but"):
        reg.register_rank(base(tp_rank=1, **cfg), [dataclasses.replace(KV, **change)], "n2")
    reg.register_rank(base(tp_rank=1, **cfg), [KV], "n2")  # control: the same pool is fine


def test_page_bytes_are_compared_rank_by_rank():
    """PP stages may hold unequal layer counts: their page objects differ in size; the
    same rank registering other bytes per page (another model) is refused."""
    reg = DeploymentRegistry()
    cfg = dict(model_name="org/m", pp_size=2)
    reg.register_rank(base(pp_rank=0, **cfg), [KV], "n1")
    stage1 = dataclasses.replace(KV, page_bytes=(2048, 2048))
    dep = reg.register_rank(base(pp_rank=1, **cfg), [stage1], "n1")
    assert dep.page_bytes == {"0,0": {"kv": [4096, 4096]}, "0,1": {"kv": [2048, 2048]}}
    reg.retire_node("n1")  # the record outlives the ranks: their objects stay
    with pytest.raises(ValueError, match=r"\[4096, 4096\] bytes per page object on this "
                                         r"rank but \[2048, 2048\]"):
        reg.register_rank(base(pp_rank=1, **cfg), [KV], "n2")


def test_an_older_checkpoint_without_byte_fields_loads_and_learns_them():
    old = {"deployment_id": "org-m", "model_name": "org/m", "extra_backend_tag": None,
           "tp_size": 1, "pp_size": 1, "is_mla_model": False,
           "pools": [{"name": "kv", "kind": "mha", "buffers": ["k", "v"]}],
           "ranks": {"0,0": "n1"}, "home_node": "n1", "version": 1}
    dep = Deployment.from_dict(old)
    assert dep.deployment_id == "org-m_" and dep.tenant is None
    assert dep.pools[PoolName.KV] == PoolSpec(PoolName.KV, "mha", ("k", "v"))
    reg = DeploymentRegistry()
    reg.deployments[dep.deployment_id] = dep
    reg.register_rank(base(model_name="org/m"), [KV], "n1")  # nothing recorded to contradict
    assert dep.pools[PoolName.KV] == KV.group_spec
    with pytest.raises(ValueError, match="dtypes"):
        reg.register_rank(base(model_name="org/m"),
                          [dataclasses.replace(KV, dtypes=("float16",) * 2)], "n1")


# ------------------------------------------------------------- keyed hashes
def test_keyed_hashes_map_each_key_once_and_sidecars_through_their_source():
    keyed = KeyedHashes(SECRET)
    assert keyed.keys(["a", "b"]) == [keyed_page_hash(page_key(SECRET), h) for h in "ab"]
    kv = PoolTransfer(PoolName.KV, ["a"], [0, 1])
    side = PoolTransfer(PoolName.INDEXER, indices_from_pool=PoolName.KV)
    out = keyed.transfers([kv, side])
    assert out[0].keys == [keyed_page_hash(page_key(SECRET), "a")] and out[1].keys is None
    assert kv.keys == ["a"]  # the caller's transfer is left as it was
    with pytest.raises(ValueError, match="'a' appears at positions 0 and 1"):
        keyed.keys(["a", "a"])  # errors name what the caller gave
    assert keyed.transfers("not a list") == "not a list"  # for the planner to refuse
    plain = KeyedHashes(None)
    keys = ["a"]
    assert plain.keys(keys) is keys and plain.transfers([kv])[0] is kv


def test_each_use_of_the_secret_has_its_own_sub_key():
    """Page hashes are keyed under the secret's page-hash sub-key, the owner key is
    seeded with its owner-key sub-key: distinct, deterministic, neither the secret nor
    a function of the other; another use is refused."""
    page, owner = sub_key(SECRET, PAGE_HASHES), sub_key(SECRET, OWNER_KEY)
    assert len(page) == len(owner) == 32 and page != owner and SECRET not in (page, owner)
    assert page_key(SECRET) == page == sub_key(SECRET, PAGE_HASHES)
    assert sub_key(b"t" * 32, PAGE_HASHES) != page  # another secret, another sub-key
    assert keyed_page_hash(page, "a") != keyed_page_hash(SECRET, "a")  # not the secret
    with pytest.raises(ValueError, match="sub-key"):
        sub_key(SECRET, "session")


def test_no_secret_in_what_leaves_the_rank():
    keyed = KeyedHashes(SECRET)
    assert "s" * 16 not in repr(keyed)
    cfg = base(model_name="org/m", tenant="acme")
    reg = DeploymentRegistry().register_rank(cfg, [KV], "n1")
    for thing in (cfg, KeyScheme.from_config(cfg), reg, KV):
        assert SECRET not in pickle.dumps(thing)
