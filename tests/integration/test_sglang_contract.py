"""The rest of SGLang 0.5.23's storage contract, driven by SGLang's own code against a
real two-node raykv cluster (``sglang_driver.py`` in the SGLang venv, as
``test_sglang.py``):

- the single-key calls: ``set(key, ptr)`` then ``exists(key)`` and ``get(key, ptr)``
  name one object, as SGLang's ``MooncakeStore`` (the value form is refused); SGLang's own
  ``test_mooncake_store.py::test_single_operation`` passes against ``RayKVStore``
  (``sglang_peer.py``), and fails with the ``exists`` of before (control);
- the legacy pointer ``batch_get`` counts pages (13 for 13 MHA pages of 2 objects), as
  MooncakeStore; a page missing one object ends the count;
- ``clear()`` through SGLang's ``clear_storage_backend``: the deployment's pages miss
  afterwards (they hit before, and were just looked up: leased), so do the pages
  SGLang's ``MooncakeStore`` wrote for the same model (the same keys), while a
  deployment whose key prefix extends it and a tenant of the same model keep theirs; a
  tenant's own clear; a deployment without a key prefix fails the clear;
- the legacy pointer API refuses pointers into a staged pool with a warning naming why;
- the staging warning for ``page_first_direct`` with ``"allocator": "shm"`` names the
  layout, not the flag already set.
"""

from __future__ import annotations

import os

import pytest

from tests.integration.sglang_runs import mooncake_config, run_driver, scenario, steps

pytestmark = pytest.mark.engine("sglang")

PAGES = 8
STAGING = "host pools are served through a staging copy"
SECRET = "contract-secret-" + "x" * 32


@pytest.fixture(scope="module")
def contract(cluster, tmp_path_factory):
    """One SGLang driver on node 0 runs every scenario, in order (run once)."""
    tmp = tmp_path_factory.mktemp("sglang-contract")
    uid = os.urandom(4).hex()
    model = f"org/clr-{uid}"
    tenant = {"extra": {"tenant": f"acme-{uid}"}, "env": {"RAYKV_TENANT_SECRET": SECRET}}

    def write(seed):
        return {"op": "write", "seed": f"{seed}-{uid}", "n_pages": PAGES}

    def prefetch(seed, rid="p"):
        return {"op": "prefetch", "seed": f"{seed}-{uid}", "n_pages": PAGES, "rid": rid}

    mooncake = {"backend": "mooncake", "mooncake": mooncake_config(cluster)}
    out = run_driver(tmp, cluster, 0, [
        scenario("trio", "mha", "shm", [
            {"op": "trio", "seed": f"trio-{uid}"},
            {"op": "legacy_batch_get", "seed": f"lg-{uid}", "n_pages": 13},
            {"op": "legacy_batch_get", "seed": f"lg-part-{uid}", "n_pages": 13,
             "objects": 11},
            {"op": "peer_tests", "tests": ["test_single_operation"]},
            {"op": "peer_tests", "tests": ["test_single_operation"], "old_exists": True},
        ], model_name=f"org/trio-{uid}"),
        scenario("trio-mla", "mla", "shm", [
            {"op": "trio", "seed": f"trio-mla-{uid}"},
            {"op": "legacy_batch_get", "seed": f"lg-mla-{uid}", "n_pages": 13}],
            model_name=f"org/trio-mla-{uid}"),
        scenario("staged", "mha", "default", [{"op": "trio", "seed": f"staged-{uid}"}],
                 model_name=f"org/staged-{uid}"),
        scenario("direct", "mha", "shm", [{"op": "write", "seed": f"direct-{uid}",
                                           "n_pages": 2}, {"op": "stats"}],
                 model_name=f"org/direct-{uid}", layout="page_first_direct"),
        # clear: two other deployments write first; "mine" clears, the others keep theirs.
        scenario("extends", "mha", "shm", [write("extends")], model_name=model + "_x"),
        scenario("tenant", "mha", "shm", [write("tenant")], model_name=model, **tenant),
        scenario("by-mooncake", "mha", "shm", [write("by-mooncake")], model_name=model,
                 **mooncake),
        scenario("mine", "mha", "shm", [
            write("mine"), prefetch("mine", "before"), prefetch("by-mooncake", "before"),
            {"op": "clear"},
            {"op": "exists_v2", "seed": f"mine-{uid}", "n_pages": PAGES},
            prefetch("mine", "after"), prefetch("by-mooncake", "after"),
            write("again"), prefetch("again")],
            model_name=model),
        scenario("extends-after", "mha", "shm", [prefetch("extends")],
                 model_name=model + "_x"),
        scenario("tenant-after", "mha", "shm", [
            prefetch("tenant", "before"), {"op": "clear"}, prefetch("tenant", "after")],
            model_name=model, **tenant),
        {"name": "no-prefix", "model": "mha", "allocator": "shm", "model_name": "",
         "steps": [{"op": "clear"}]},
    ])
    return out["scenarios"]


def test_set_exists_get_name_one_object(contract):
    for name in ("trio", "trio-mla"):
        t = steps(contract[name])[0]
        assert t["exists_before"] is False and t["set"] is True
        assert t["exists"] is True                         # the object set stored
        assert t["exists_other"] is False                  # control: another key
        assert t["get"] is True and t["bytes_equal"] is True
        assert t["get_missing"] is False
        assert t["page_hit"] == 0       # a page's hit asks for its KV objects, not this one
        assert t["old_exists"] is False  # control: the exists of before missed it
        assert t["value_set"] is False and t["value_get"] is None
        assert t["value_batch_get"] == [None]
        assert any("with page values" in m for m in contract[name]["warnings"])


def test_sglang_single_operation_test_passes(contract):
    """SGLang's own test, unchanged, against RayKVStore; with the old exists it fails
    where the issue saw it fail."""
    new, old = steps(contract["trio"])[3:5]
    assert new["test_single_operation"] == {"passed": True, "error": None}, new
    assert old["test_single_operation"]["passed"] is False
    assert "should exist after set operation" in old["test_single_operation"]["error"]


def test_legacy_batch_get_counts_pages(contract):
    full, part = steps(contract["trio"])[1:3]
    assert full["per_page"] == 2 and full["set"] is True
    assert full["pages"] == 13 and full["match"] == [True] * 13
    assert full["objects"] == 26                       # control: the count of before
    # 11 objects: pages 0-4 and the K of page 5: 5 pages read.
    assert part["set"] is True and part["pages"] == 5 and part["match"] == [True] * 5
    assert part["objects"] == 11
    mla = steps(contract["trio-mla"])[1]
    assert mla["per_page"] == 1 and mla["pages"] == 13 and mla["objects"] == 13
    assert mla["match"] == [True] * 13


def test_clear_removes_this_deployments_objects_only(contract):
    w, before, mc_before, clear, ex, after, mc_after, again, hit_again = \
        steps(contract["mine"])
    assert w["completed"] == [PAGES * 16]
    # Control: there was something to clear, just looked up (leased: the clear waited).
    assert before["hit_pages"] == PAGES and before["kv_match"] == [True] * PAGES
    assert mc_before["hit_pages"] == PAGES       # SGLang's MooncakeStore's, same keys
    assert clear["ok"] is True and "raised" not in clear
    assert clear["counters"]["cleared_objects"] == 2 * 2 * PAGES
    assert ex["kv_hit_pages"] == 0 and ex["rank_local_v1"] == 0
    assert after["hit_pages"] == 0 and after["loaded_pages"] == 0
    assert mc_after["hit_pages"] == 0
    # The backend serves on: a prompt backed up after the clear hits.
    assert again["completed"] == [PAGES * 16] and hit_again["hit_pages"] == PAGES
    assert hit_again["kv_match"] == [True] * PAGES
    # A deployment whose key prefix starts with this one's, and a tenant of the same
    # model: untouched.
    other = steps(contract["extends-after"])[0]
    assert other["hit_pages"] == PAGES and other["kv_match"] == [True] * PAGES
    t_before, t_clear, t_after = steps(contract["tenant-after"])
    assert t_before["hit_pages"] == PAGES and t_before["kv_match"] == [True] * PAGES
    # The tenant's own clear.
    assert t_clear["ok"] is True and t_after["hit_pages"] == 0


def test_clear_without_key_prefix_fails(contract):
    clear = steps(contract["no-prefix"])[0]
    assert clear["ok"] is False and "no key prefix" in clear["raised"]
    assert clear["counters"]["clear_failures"] == 1


def test_pointer_into_a_staged_pool_is_refused(contract):
    t = steps(contract["staged"])[0]
    assert t["set"] is False and t["exists"] is False and t["get"] is False
    assert any("legacy pointer API needs a zero-copy pool" in m
               for m in contract["staged"]["warnings"])
    # Control: the same call on a zero-copy pool stored it (test_set_exists_get...).
    assert steps(contract["trio"])[0]["set"] is True


def test_page_first_direct_staging_warning_names_the_layout(contract):
    sc = contract["direct"]
    assert steps(sc)[0]["completed"] == [2 * 16]
    assert steps(sc)[1]["pools"]["kv"]["zero_copy"] is False
    staging = [m for m in sc["warnings"] if STAGING in m]
    assert len(staging) == 1
    assert "page_first_direct" in staging[0] and "--hicache-mem-layout page_first" in \
        staging[0]
    assert '"allocator": "shm"' not in staging[0]
    # Control: with the default allocator the warning names the flag.
    staged = [m for m in contract["staged"]["warnings"] if STAGING in m]
    assert len(staged) == 1 and '"allocator": "shm"' in staged[0]
