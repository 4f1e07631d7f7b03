"""A hung node actor under SGLang's real cache controller: every call SGLang's threads
make on raykv's ``RayKVStore`` returns within the deadline as misses / failed pages,
never raises into SGLang and never reports a page stored or loaded that was not, and
hits resume once the actor runs again.

``sglang_driver.py`` (SGLang 0.5.23's ``HybridCacheController`` and host pools, in the
SGLang venv) drives backups and prefetches through SGLang's own threads with
``timeout_s`` = 1 s; the node actor is stopped with SIGSTOP (its pid from ``health()``)
(a) before a prefetch (the hit query times out), (b) before a backup, and (c) between
the hit query and the load (the driver stops it as SGLang's prefetch thread hands the
answered query back), then continued with SIGCONT. MHA (v1 calls: ``batch_exists``,
``batch_get_v1``, ``batch_set_v1``, zero-copy KV) and hybrid (v2 calls with a staged
Mamba pool: ``batch_exists_v2``, ``batch_set_v2``).

Hang detection: the driver's waits on SGLang's queues end after 60 s (an inner step
then reports ``inner_error``) and each logged call must have returned within the
documented bound (``deadline_bound``): ``timeout_s`` on a stopped actor, ``timeout_s``
plus the rest of the store call under way for a zero-copy call on a slow store (at most
``DELAY_S``); a call hung for good (the rank side before deadlines) fails the test.

Store calls slower than the deadline (MHA, zero-copy: SGLang's own host memory is what
the node actor reads and writes): every node actor holds each put and get ``DELAY_S`` >
``timeout_s`` inside its store call (``store_delay``). SGLang's prefetch of a stored
prompt G and its backup of a prompt A fail (no page reported loaded or stored that was
not, nothing raised into SGLang), and right after each the driver gives the host pages
to other bytes, as SGLang does with pages it freed or evicted. Those pages keep the new
bytes, every object of A the store holds afterwards reads back as A's bytes (``read_back``),
and G and A then load byte-identical: what SGLang sees equals a run where raykv missed.
CONTROL (``old_return``): the ranks return from the failed calls at the deadline whatever
store call runs: the late get overwrites the reused pages and the late put stores the
reused pages' bytes under A's keys.
"""

from __future__ import annotations

import os

import pytest

from tests.integration.conftest import set_store_delay
from tests.integration.deadline_bound import bound_s, within
from tests.integration.sglang_runs import run_driver, scenario, steps

pytestmark = pytest.mark.engine("sglang")

TIMEOUT_S = 1.0
DELAY_S = 3.0  # a slow store call (a control's late call lands DELAY_S - TIMEOUT_S later)
N = 4


def stopped_scenario(name: str, model: str, uid: str,
                     mamba: list | None = None) -> tuple[dict, list[str]]:
    """Back up and prefetch ``seed`` A, then the three stops (see the module docstring),
    then hits again after SIGCONT; the scenario and a label per step."""
    a, b, c = (f"{x}-{name}-{uid}" for x in "abc")
    extra = {"mamba": mamba} if mamba else {}

    def logged(inner: dict, **kw) -> dict:
        return {"op": "logged", "inner": inner, **kw}

    labeled = [
        ("write A", {"op": "write", "seed": a, "n_pages": N, **extra}),
        ("control prefetch A", logged({"op": "prefetch", "seed": a, "n_pages": N})),
        ("stop", {"op": "stop_node_actor"}),
        ("lookup while stopped", logged({"op": "prefetch", "seed": a, "n_pages": N,
                                         "rid": "stop"})),
        ("backup while stopped", logged({"op": "write", "seed": b, "n_pages": N, **extra})),
        ("continue", {"op": "cont_node_actor"}),
        ("hits again", {"op": "until_hit", "seed": a, "n_pages": N}),
        ("load while stopped", logged({"op": "prefetch", "seed": a, "n_pages": N,
                                       "rid": "load"}, stop_after_hit=True)),
        ("continue again", {"op": "cont_node_actor"}),
        ("hits again after the load", {"op": "until_hit", "seed": a, "n_pages": N}),
        ("write C", {"op": "write", "seed": c, "n_pages": N, **extra}),
        ("prefetch C", logged({"op": "prefetch", "seed": c, "n_pages": N})),
    ]
    return scenario(name, model, "shm", [step for _, step in labeled],
                    model_name=f"org/deadline-{name}-{uid}",
                    extra={"timeout_s": TIMEOUT_S}), [label for label, _ in labeled]


def check_calls(step: dict, what: str, documented_s: float = TIMEOUT_S) -> list[dict]:
    """The calls of a logged step: each returned (no inner step ran out waiting on
    SGLang), within the documented bound ``documented_s`` (``deadline_bound``: by
    default the deadline), without raising into SGLang's thread."""
    assert "inner_error" not in step, f"{what}: {step['inner_error']}; calls {step['calls']}"
    for c in step["calls"]:
        assert c["seconds"] is not None, f"{what}: {c['call']} still running: {step['calls']}"
        assert within(c["seconds"], documented_s), \
            f"{what}: {c} took past {bound_s(documented_s)} s"
        assert "raised" not in c, f"{what}: {c['call']} raised into SGLang: {c}"
    return step["calls"]


def slow_scenario(name: str, uid: str, control: bool) -> tuple[dict, list[str]]:
    """Slow store calls under SGLang's prefetch and backup (see the module docstring)."""
    g, a = f"g-{name}-{uid}", f"a-{name}-{uid}"

    def logged(inner: dict) -> dict:
        return {"op": "logged", "inner": inner, "settle_s": 0}

    labeled = [
        ("write G", {"op": "write", "seed": g, "n_pages": N}),
        *([("old return", {"op": "old_return"})] if control else []),
        ("slow store", {"op": "store_delay", "s": DELAY_S}),
        ("slow load", logged({"op": "prefetch", "seed": g, "n_pages": N, "rid": "slow"})),
        ("reuse loaded pages", {"op": "reuse", "seed": f"r1-{name}", "wait_s": DELAY_S}),
        ("breaker admits", {"op": "until_breaker_admits"}),
        ("slow backup", logged({"op": "write", "seed": a, "n_pages": N})),
        ("reuse backed-up pages", {"op": "reuse", "seed": f"r2-{name}", "wait_s": DELAY_S}),
        ("store fast again", {"op": "store_delay", "s": 0}),
        ("breaker admits again", {"op": "until_breaker_admits"}),
        ("read back A", {"op": "read_back", "seed": a, "n_pages": N}),
        ("hits on G", {"op": "until_hit", "seed": g, "n_pages": N}),
        ("prefetch A", {"op": "prefetch", "seed": a, "n_pages": N}),
    ]
    return scenario(name, "mha", "shm", [step for _, step in labeled],
                    model_name=f"org/slow-{name}-{uid}",
                    extra={"timeout_s": TIMEOUT_S}), [label for label, _ in labeled]


def run(tmp_path, cluster, name: str, model: str, mamba: list | None = None,
        slow: bool = False) -> dict:
    """The stopped scenario ``name``; with ``slow``, the slow-store scenarios ``slow``
    and (last: its switch stays on in the driver) ``slow-control`` in the same driver
    process. The scenarios by name."""
    uid = os.urandom(4).hex()
    specs = [stopped_scenario(name, model, uid, mamba)]
    if slow:
        specs += [slow_scenario("slow", uid, False), slow_scenario("slow-control", uid, True)]
    try:
        out = run_driver(tmp_path, cluster, 0, [spec for spec, _ in specs],
                         timeout=900)["scenarios"]
    finally:
        set_store_delay(cluster, 0)  # whatever step failed
    for spec, labels in specs:
        sc = out[spec["name"]]
        assert "attach_error" not in sc, sc
        sc["labels"] = labels
        if spec["name"] == "slow-control":
            continue
        # The first step that raised, or whose SGLang queue wait ran out (a call hung).
        for label, s in zip(labels, sc["steps"], strict=True):
            assert "error" not in s and "inner_error" not in s, f"{label}: {s}"
        assert all(sc["threads"].values()), sc["threads"]
    return out


def check_common(sc: dict, lookup: str, backup: set[str], load: str) -> None:
    """What both models must show (``lookup`` / ``backup`` / ``load``: the backend
    calls SGLang makes for each)."""
    st = sc["steps"]
    before = st[1]["result"]
    assert before["hit_pages"] == N and before["kv_match"] == [True] * N, st[1]
    check_calls(st[1], "control")

    # (a) hit query on the stopped actor: a miss, within the deadline.
    calls = check_calls(st[3], "lookup while stopped")
    assert st[3]["result"]["hit_pages"] == 0, st[3]
    assert [c["call"] for c in calls] == [lookup], calls
    assert calls[0]["seconds"] >= TIMEOUT_S * 0.9, calls  # it did wait for the actor

    # (b) backup on the stopped actor: every page reported not stored.
    calls = check_calls(st[4], "backup while stopped")
    assert {c["call"] for c in calls} == backup, calls
    assert not any(ok for c in calls for ok in _bools(c["result"])), calls
    assert all(_zero(done) for done in st[4]["result"]["completed"]), st[4]

    # Hits resume after SIGCONT.
    assert st[6]["hit"], st[6]

    # (c) stopped between hit query and load: the query hit, the load failed in full,
    # nothing reported loaded (so no byte is taken from the poisoned slots).
    calls = check_calls(st[7], "load while stopped")
    pre = st[7]["result"]
    assert pre["hit_pages"] == N and pre["loaded_pages"] == 0, st[7]
    assert pre["kv_match"] == [], st[7]
    loads = [c for c in calls if c["call"] == load]
    assert loads and all(not any(_bools(c["result"])) for c in loads), calls

    # After SIGCONT: hits and backups work again, bytes identical.
    assert st[9]["hit"], st[9]
    after = st[11]["result"]
    assert after["hit_pages"] == N and after["kv_match"] == [True] * N, st[11]
    assert any("failed" in m for m in sc["warnings"]), sc["warnings"]


def _bools(result) -> list[bool]:
    return [v for vs in result.values() for v in vs] if isinstance(result, dict) else result


def _zero(done) -> bool:
    """A backup ack that stored nothing: 0 tokens (a Mamba backup's is ``[tokens, pool
    result]``)."""
    return (done[0] if isinstance(done, list) else done) == 0


@pytest.fixture(scope="module")
def mha_runs(cluster, tmp_path_factory) -> dict:
    """One driver process: the MHA stopped scenario, then the slow-store scenarios."""
    return run(tmp_path_factory.mktemp("mha"), cluster, "mha", "mha", slow=True)


def test_mha_v1_calls_on_a_stopped_node_actor(mha_runs):
    sc = mha_runs["mha"]
    check_common(sc, "batch_exists", {"batch_set_v1"}, "batch_get_v1")
    assert steps(sc)[-1]["result"]["kv_match"] == [True] * N


def labeled_steps(sc: dict) -> dict[str, dict]:
    return dict(zip(sc["labels"], sc["steps"], strict=True))


def test_slow_store_calls_never_change_what_sglang_sees(mha_runs):
    st = labeled_steps(mha_runs["slow"])
    load = st["slow load"]
    # zero-copy: the deadline plus the rest of the store call that started in time
    check_calls(load, "slow load", DELAY_S)
    assert load["result"]["hit_pages"] == N, load  # the hit query is not slowed
    assert all(load["result"]["kv_match"]), load  # pages reported loaded are G's
    assert all(st["reuse loaded pages"]["kept"]), st["reuse loaded pages"]
    backup = st["slow backup"]
    check_calls(backup, "slow backup", DELAY_S)
    assert all(st["reuse backed-up pages"]["kept"]), st["reuse backed-up pages"]
    objects = st["read back A"]["objects"]
    assert all(o is not False for page in objects for o in page), objects  # A's or absent
    assert st["hits on G"]["hit"], st["hits on G"]
    after = st["prefetch A"]
    assert after["kv_match"] == [True] * after["loaded_pages"], after
    print("slow store:", {k: st[k] for k in ("slow load", "slow backup", "read back A")},
          "scenario seconds:", {k: v.get("elapsed_s") for k, v in mha_runs.items()})


def test_slow_store_calls_control_old_return_shows_wrong_bytes(mha_runs):
    """CONTROL of the test above: the old return lets the late get overwrite the reused
    pages and the late put store the reused pages' bytes under A's keys."""
    st = labeled_steps(mha_runs["slow-control"])
    assert not all(st["reuse loaded pages"]["kept"]), st["reuse loaded pages"]
    objects = st["read back A"]["objects"]
    assert any(o is False for page in objects for o in page), objects


def test_hybrid_v2_calls_on_a_stopped_node_actor(cluster, tmp_path):
    """Hybrid (MHA KV zero-copy + a staged Mamba pool): SGLang asks ``batch_exists_v2``
    and backs the Mamba state up with ``batch_set_v2``; after SIGCONT the Mamba state
    loads again, byte-identical."""
    sc = run(tmp_path, cluster, "hybrid", "hybrid", mamba=[N])["hybrid"]
    check_common(sc, "batch_exists_v2", {"batch_set_v1", "batch_set_v2"}, "batch_get_v1")
    after = sc["steps"][11]["result"]
    assert after["mamba_match"] is True, after
