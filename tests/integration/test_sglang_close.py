"""SGLang's backend closed under its own transfers (real Ray, real mooncake_master,
embedded and standalone): raykv's ``RayKVStore.close()`` runs while SGLang's threads
(``HybridCacheController``, driven by ``sglang_driver.py`` in the SGLang venv) move
pages through it. Neither the node actor nor SGLang's process crashes, SGLang's acks
count no page stored (or loaded) that does not hold the bytes SGLang wrote, and no key
ever reads back other bytes (a fresh backend reads every object that exists:
``read_back``).

The node actors run with slow store calls (``store_delay``, injected into them):
each put and get waits inside the store call, after the node actor resolved its
pointers. Paths:

- zero-copy (embedded, ``allocator: shm``): the pool is SGLang's memfd, adopted and
  mapped by the node actor;
- staged (embedded with ``zero_copy: false``; standalone, where every pool is staged):
  SGLang's pages are copied into a raykv staging pool, and out of it after a load.

``test_close_during_backup_...``: ``close()`` while a put is in the node actor's store
call (6 backups of 8 pages queued at once, ``close()`` once the second call has been
0.1 s in the store; staged with 4 pages per direction, so a backup is two store calls).
The node actor drains the call before the pool goes; with that drain disabled
(``NodePools._drain`` releasing at once) the embedded node actor died of SIGSEGV.
``test_close_during_staging_copies_...``: ``close()`` while the backend copies pages
into or out of its staging pool (slowed per page); before ``close()`` waited for the
staged transfer under way, SGLang's process died of SIGSEGV in that copy.
"""

from __future__ import annotations

import os

import pytest

from tests.integration.conftest import MODES, node_pids, slow_two_nodes
from tests.integration.sglang_runs import PAGE, run_driver, scenario

pytestmark = pytest.mark.engine("sglang")

DELAY_S = 0.25
OPS = 6
RUN_PAGES = 8
STAGING_PAGES = 4
LOAD_PAGES = 8
COPY_S = 0.05


@pytest.fixture(scope="module", params=MODES)
def slow_cluster(request):
    """``(mode, cluster)``: a two-node cluster whose node actors hold every put and get
    ``DELAY_S`` s."""
    with slow_two_nodes(request.param, DELAY_S) as cluster:
        yield request.param, cluster


def paths(mode: str) -> dict[str, dict]:
    """Extra config per path checked in ``mode`` (see the module docstring)."""
    staged = {"staging_pages": STAGING_PAGES}
    if mode == "standalone":
        return {"staged": staged}
    return {"zero-copy": {}, "staged": {**staged, "zero_copy": False}}


def test_close_during_backup_never_stores_or_reads_wrong_bytes(slow_cluster, tmp_path):
    mode, cluster = slow_cluster
    before = node_pids(cluster)
    uid = os.urandom(4).hex()
    specs = []
    for name, extra in paths(mode).items():
        seed, model = f"close-{name}-{uid}", f"org/close-{name}-{uid}"
        specs += [
            scenario(f"{name}-writer", "mha", "shm", [
                {"op": "stats"},
                {"op": "close_during_backup", "seed": seed, "ops": OPS,
                 "run_pages": RUN_PAGES, "after_calls": 2, "into_s": 0.1}],
                model_name=model, extra=extra),
            scenario(f"{name}-reader", "mha", "shm", [
                {"op": "read_back", "seed": seed, "n_pages": (OPS + 1) * RUN_PAGES}],
                model_name=model),
        ]
    out = run_driver(tmp_path, cluster, 0, specs, timeout=300)["scenarios"]

    assert node_pids(cluster) == before  # no node actor crashed (or was restarted)
    for name in paths(mode):
        writer, reader = out[f"{name}-writer"], out[f"{name}-reader"]
        for sc in (writer, reader):
            assert "attach_error" not in sc, (name, sc)
            for s in sc["steps"]:
                assert "error" not in s, (name, s)
        stats, wrote, back = writer["steps"][0], writer["steps"][1], reader["steps"][0]
        assert wrote["pid"] == back["pid"] == before[cluster.node_ids[0]], (name, wrote, back)
        zero_copy = all(p["zero_copy"] for p in stats["pools"].values())
        assert zero_copy == (name == "zero-copy"), (name, stats["pools"])
        assert all(writer["threads"].values()), (name, writer["threads"])  # SGLang's too

        # close() ran while a backup call was inside the node actor's store call.
        close, calls = wrote["close"], wrote["calls"]
        assert any(c["start"] < close["start"] < c["end"] for c in calls), (name, wrote)
        assert all("raised" not in c for c in calls), (name, calls)  # never into SGLang
        # What the backup could not store is reported not stored: the operations
        # queued behind the close acked 0 tokens, and the one queued after close()
        # returned called the closed backend, which stored nothing.
        assert wrote["completed"][0] == RUN_PAGES * PAGE, (name, wrote)  # before close
        assert wrote["completed"][OPS - 1:] == [0, 0], (name, wrote)
        late = [c for c in calls if c["start"] > close["end"]]
        assert late and not any(ok for c in late for ok in c["result"]), (name, calls)

        # Every object that exists holds exactly SGLang's bytes; every page SGLang's
        # acks count stored exists in full.
        objects = back["objects"]
        assert back["read"] == back["existing"] > 0, (name, back)
        assert not any(o is False for page in objects for o in page), (name, objects)
        for p in wrote["stored_pages"]:
            assert all(objects[p]), (name, p, objects[p])


def test_close_during_staging_copies_never_crashes_or_hands_over_other_bytes(slow_cluster,
                                                                           tmp_path):
    """``close()`` while the backend copies pages through its staging pool (each page's
    copy slowed to ``COPY_S`` s: ``close_during_copy``): SGLang's pages into staging
    before a backup (``in``), pages read out of staging into SGLang's after a load
    (``out``). SGLang's process survives, no page SGLang's acks count stored or loaded
    holds other bytes than the writer's, and every object that exists afterwards reads
    back exact. Before ``close()`` waited for the staged transfers under way, it
    unmapped the staging pool under the copy (torch views hold no buffer export, so the
    mapping went at once) and SGLang's process died of SIGSEGV."""
    mode, cluster = slow_cluster
    before = node_pids(cluster)
    uid = os.urandom(4).hex()
    extra = {"zero_copy": False} if mode == "embedded" else {}  # staged in both modes
    seeds = {d: f"close-copy-{d}-{uid}" for d in ("in", "out")}
    copy = {"n_pages": LOAD_PAGES, "copy_s": COPY_S}
    specs = [
        scenario("in", "mha", "shm", [
            {"op": "close_during_copy", "direction": "in", "seed": seeds["in"], **copy}],
            model_name=f"org/{seeds['in']}", extra=extra),
        scenario("out", "mha", "shm", [
            {"op": "write", "seed": seeds["out"], "n_pages": LOAD_PAGES},
            {"op": "close_during_copy", "direction": "out", "seed": seeds["out"], **copy}],
            model_name=f"org/{seeds['out']}", extra=extra),
        scenario("reader", "mha", "shm", [
            {"op": "read_back", "seed": seeds["in"], "n_pages": LOAD_PAGES}],
            model_name=f"org/{seeds['in']}"),
    ]
    out = run_driver(tmp_path, cluster, 0, specs, timeout=300)["scenarios"]

    assert node_pids(cluster) == before
    for sc in out.values():
        assert "attach_error" not in sc, sc
        for s in sc["steps"]:
            assert "error" not in s, s
    for direction in ("in", "out"):
        step = out[direction]["steps"][-1]
        # close() began while the copy through staging was under way.
        assert step["copy_started"] < step["close"]["start"] < \
            step["copy_started"] + LOAD_PAGES * COPY_S, (direction, step)

    # Backup: what SGLang's acks count stored exists and reads back exact, and so does
    # every other object of the prompt that exists.
    stored = out["in"]["steps"][0]["result"]["completed"]
    back = out["reader"]["steps"][0]
    assert stored[0] > 0, out["in"]  # the backup under way ended before its pool went
    assert not any(o is False for page in back["objects"] for o in page), back
    assert back["read"] == back["existing"], back
    for p in range(stored[0] // PAGE):
        assert all(back["objects"][p]), (p, back)

    # Load: the pages SGLang's acks count loaded hold the writer's bytes.
    assert out["out"]["steps"][0]["completed"] == [LOAD_PAGES * PAGE], out["out"]
    got = out["out"]["steps"][1]["result"]
    assert got["hit_pages"] == LOAD_PAGES and got["loaded_pages"] > 0, got
    assert got["kv_match"] == [True] * got["loaded_pages"], got
