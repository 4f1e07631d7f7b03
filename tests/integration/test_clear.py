"""``CacheClient.clear_objects`` on a real two-node embedded cluster (the clear is the
node actor's own code in either mode): a deployment's objects leave the store (also those
just looked up, whose lease the clear waits out), while a deployment whose key prefix
extends its own and a tenant of the same model keep theirs; claims the node actor must
refuse (another tenant's proof, another tenant's prefix) remove nothing. SGLang's
``clear()`` on top: ``test_sglang_contract.py``."""

from __future__ import annotations

import hashlib

import pytest
import ray
from raykv import CacheClient
from raykv.controllers import StorageConfig
from raykv.controllers.ownership import OwnerClaim
from raykv.controllers.tenancy import TENANT_SECRET_ENV

from tests.integration.ranks import MHA, indices

N = 4
SECRET = "t" * 32
HASHES = [hashlib.sha256(f"page-{i}".encode()).hexdigest() for i in range(N)]
"""Page hashes of SGLang's shape (64 hex digits: what a clear without a tenant removes)."""




def client_of(monkeypatch, model: str, **extra) -> CacheClient:
    monkeypatch.setenv(TENANT_SECRET_ENV, SECRET)
    client = CacheClient(StorageConfig(model_name=model, extra_config=extra))
    pool = client.create_host_pool("mha", **MHA)
    client.register_mem_pool_host(pool)
    assert client.batch_set_v1(HASHES, indices(0, N)) == [True] * N
    return client



def test_a_clear_removes_its_deployments_objects_only(cluster, uid, monkeypatch):
    model = f"org/clear-{uid}"
    mine = client_of(monkeypatch, model)
    extends = client_of(monkeypatch, model + "_x")           # prefix "org-clear-..._x_"
    tenant = client_of(monkeypatch, model, tenant=f"acme-{uid}")
    clients = (mine, extends, tenant)
    try:
        assert [c.batch_exists(HASHES) for c in clients] == [N] * 3  # control; and leased
        actor = cluster.node_actors[mine.node_id]
        t = tenant.owner_claim()
        forged_proof = "a call proof made without the secret"
        forged = [OwnerClaim(t.deployment_id, t.tenant, forged_proof, t.key_prefix),
                  OwnerClaim(t.deployment_id.replace("acme", "evil"), f"evil-{uid}",
                             forged_proof, t.key_prefix),
                  OwnerClaim(t.key_prefix, None, None, t.key_prefix)]
        for claim in forged:
            with pytest.raises(ray.exceptions.RayTaskError, match="ValueError"):
                ray.get(actor.clear_objects.remote(claim))
        assert tenant.batch_exists(HASHES) == N

        assert mine.clear_objects() == 2 * N                  # K and V of each page
        assert mine.batch_exists(HASHES) == 0
        assert mine.batch_get_v1(HASHES, indices(32, N)) == [False] * N
        assert extends.batch_exists(HASHES) == N and tenant.batch_exists(HASHES) == N
        assert tenant.clear_objects() == 2 * N
        assert tenant.batch_exists(HASHES) == 0 and extends.batch_exists(HASHES) == N
    finally:
        for c in clients:
            c.close()
