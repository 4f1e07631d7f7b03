"""GroupQueries (pure logic): answers shared by the ranks of a group (within the window
and while in flight), fresh for a rank that asks again, concurrent distinct queries
batched into one store call, store errors to every waiter."""

import threading
import time

import pytest
from raykv.cache_actors.node.group_queries import GroupQueries
from raykv.controllers.contract import PoolName, PoolTransferResult
from raykv.controllers.deployments import Deployment, PoolSpec

from tests.unit.fakes import Counts
from tests.unit.oracle import group_objects

DEP = Deployment("m", "m", None, 2, 1, False,
                 {PoolName.KV: PoolSpec(PoolName.KV, "mha", ("k", "v"))})


class Store:
    """Objects in ``present`` exist; each call can be held until ``release`` is set."""

    def __init__(self, present=()) -> None:
        self.present = set(present)
        self.calls: list[list[str]] = []
        self.release = threading.Event()
        self.release.set()
        self.entered = threading.Event()
        self.fail: Exception | None = None

    def exists(self, keys: list[str]) -> list[int]:
        self.calls.append(list(keys))
        self.entered.set()
        self.release.wait(5)
        if self.fail:
            raise self.fail
        return [1 if k in self.present else 0 for k in keys]


def answer(groups: GroupQueries, dep: Deployment, keys, queries, rank=(0, 0),
           timeout_s: float | None = None, engine: str = "") -> PoolTransferResult:
    """``groups.submit`` and wait for the answer: the result, or the store's error
    raised; ``TimeoutError`` if none came within ``timeout_s`` seconds (None: no limit)."""
    answered = threading.Event()
    out: list = []

    def done(result, error) -> None:
        out[:] = [result, error]
        answered.set()
    groups.submit(dep, keys, queries, rank, done, engine)
    if not answered.wait(timeout_s):
        raise TimeoutError(f"the group query was not answered within {timeout_s:g} s")
    result, error = out
    if error is not None:
        raise error
    return result


def objects(keys):
    return group_objects(DEP, keys, []).objects


def test_answer_is_shared_by_the_group_then_fresh():
    store = Store(objects(["a", "b"]))
    told: list[str] = []
    counts = Counts()
    groups = GroupQueries(store.exists, window_s=5.0,
                          on_query=lambda how: (told.append(how), counts.record_group_query(how)))
    first = answer(groups, DEP, ["a", "b", "c"], [], rank=(0, 0))
    store.present |= set(objects(["c"]))
    assert answer(groups, DEP, ["a", "b", "c"], [], rank=(1, 0)) is first  # the other rank
    # Two store calls: the probe of page 0 (both ranks), then the rest.
    assert first.kv_hit_pages == 2 and len(store.calls) == 2
    # Both ranks had it: the answer is gone, the next request is looked up afresh.
    assert answer(groups, DEP, ["a", "b", "c"], [], rank=(1, 0)).kv_hit_pages == 3
    assert len(store.calls) == 4
    assert counts.recent == 1 and counts.looked_up == 2
    assert told == ["looked_up", "recent", "looked_up"]


def test_a_rank_asking_again_gets_a_fresh_answer_the_other_rank_the_newest():
    store = Store(objects(["a"]))
    groups = GroupQueries(store.exists, window_s=5.0)
    assert answer(groups, DEP, ["a", "b"], [], rank=(0, 0)).kv_hit_pages == 1
    store.present |= set(objects(["b"]))
    assert answer(groups, DEP, ["a", "b"], [], rank=(0, 0)).kv_hit_pages == 2
    assert answer(groups, DEP, ["a", "b"], [], rank=(1, 0)).kv_hit_pages == 2
    assert len(store.calls) == 4  # two checks of two steps; the other rank shared one


@pytest.mark.parametrize("named", [True, False], ids=["engines", "control_unnamed"])
def test_replicas_take_only_their_own_engines_answers(named):
    """Two replicas of one deployment (TP 2 each) ask about the same keys, interleaved,
    while the store changes: each replica's two ranks get one answer. Control: ranks
    naming no engine count as one group per deployment, and replica A's second rank
    gets the answer replica B's first rank asked for."""
    store = Store(objects(["a"]))
    groups = GroupQueries(store.exists, window_s=5.0)

    def ask(engine: str, tp: int) -> int:
        return answer(groups, DEP, ["a", "b"], [], rank=(tp, 0),
                      engine=engine if named else "").kv_hit_pages
    a0 = ask("A", 0)
    store.present |= set(objects(["b"]))  # replica B stored page 1 meanwhile
    b0 = ask("B", 0)
    a1, b1 = ask("A", 1), ask("B", 1)
    assert (a0, b0) == (1, 2)
    if named:
        assert (a1, b1) == (1, 2)
    else:
        assert a1 != a0  # the split an engine id prevents


def test_an_engine_id_that_is_not_a_short_str_is_refused():
    groups = GroupQueries(Store().exists, window_s=5.0)
    for bad in (7, "e" * 129, None):
        with pytest.raises(ValueError, match="engine"):
            groups.submit(DEP, ["a"], [], (0, 0), lambda r, e: None, bad)
    assert answer(groups, DEP, ["a"], [], engine="e" * 128).kv_hit_pages == 0  # control


def test_answers_expire_after_the_window():
    store = Store()
    groups = GroupQueries(store.exists, window_s=0.1)
    answer(groups, DEP, ["a"], [], rank=(0, 0))
    store.present |= set(objects(["a"]))
    time.sleep(0.15)
    assert answer(groups, DEP, ["a"], [], rank=(1, 0)).kv_hit_pages == 1


def test_window_zero_keeps_nothing():
    store = Store()
    groups = GroupQueries(store.exists, window_s=0.0)
    answer(groups, DEP, ["a"], [], rank=(0, 0))
    answer(groups, DEP, ["a"], [], rank=(1, 0))
    assert len(store.calls) == 2


def run(groups, keys_list):
    out: dict[int, object] = {}

    def ask(i, keys):
        try:
            out[i] = answer(groups, DEP, keys, [])
        except Exception as e:  # collected for the assertions
            out[i] = e
    threads = [threading.Thread(target=ask, args=(i, k)) for i, k in enumerate(keys_list)]
    return threads, out


def test_concurrent_queries_join_one_check_and_distinct_ones_are_batched():
    store = Store(objects(["a", "b"]))
    counts = Counts()
    groups = GroupQueries(store.exists, window_s=0.0, parallel=1,
                          on_query=counts.record_group_query,
                          on_store_call=counts.record_group_store_call)
    store.release.clear()
    first, out0 = run(groups, [["a"]])
    first[0].start()
    assert store.entered.wait(5)          # the first check is in the store
    threads, out = run(groups, [["a", "b"], ["a", "b"], ["b"], ["a", "c"]])
    for t in threads:
        t.start()
    time.sleep(0.2)                       # all four are queued behind the first check
    store.release.set()
    for t in [*first, *threads]:
        t.join(5)
    assert out0[0].kv_hit_pages == 1
    assert [out[i].kv_hit_pages for i in range(4)] == [2, 2, 1, 1]
    assert out[0] is out[1]               # identical query: one answer object
    # The first query's probe (page "a" of both ranks); then one call for the probes of
    # the three distinct queries (page "a" asked by two of them, named once); then the
    # rest of the two longer ones.
    assert len(store.calls) == 3
    second, third = store.calls[1], store.calls[2]
    assert sorted(second) == sorted(objects(["a", "b"]))
    assert sorted(third) == sorted(objects(["b", "c"]))
    assert counts.inflight == 1 and counts.store_calls == 3


def test_a_store_error_reaches_every_waiter_and_the_next_query_works():
    store = Store(objects(["a"]))
    store.fail = RuntimeError("store down")
    groups = GroupQueries(store.exists, window_s=1.0)
    with pytest.raises(RuntimeError, match="store down"):
        answer(groups, DEP, ["a"], [])
    store.fail = None
    assert answer(groups, DEP, ["a"], []).kv_hit_pages == 1


def test_unknown_pool_is_refused_before_the_store_is_asked():
    from raykv.controllers.deployments import PoolQuery

    store = Store()
    groups = GroupQueries(store.exists, window_s=1.0)
    with pytest.raises(ValueError, match="registered no 'mamba' pool"):
        answer(groups, DEP, ["a"], [PoolQuery(PoolName.MAMBA)])
    assert store.calls == []
    assert answer(groups, DEP, ["a"], []).kv_hit_pages == 0


def test_up_to_parallel_store_calls_run_at_once():
    """A query arriving while a check is in the store gets a second checker: both calls
    are in the store together (each waits for the other at a barrier)."""
    store = Store()
    inside, peak, lock = [0], [0], threading.Lock()
    gate = threading.Barrier(2, timeout=5)

    def exists(keys):
        with lock:
            inside[0] += 1
            peak[0] = max(peak[0], inside[0])
        gate.wait()  # returns only once two calls are in the store together
        with lock:
            inside[0] -= 1
        return store.exists(keys)
    groups = GroupQueries(exists, window_s=0.0, parallel=2)
    threads, out = run(groups, [["a"], ["b"]])
    threads[0].start()
    deadline = time.monotonic() + 5
    while not inside[0] and time.monotonic() < deadline:
        time.sleep(0.01)
    threads[1].start()
    for t in threads:
        t.join(5)
    assert peak[0] == 2 and len(store.calls) == 2
    assert [out[i].kv_hit_pages for i in range(2)] == [0, 0]


def test_many_callers_few_checkers_all_answered():
    """With 48 callers and 2 checker threads every query is answered, each with its own
    hit."""
    keys = [[f"k{i}-{j}" for j in range(4)] for i in range(48)]
    present = [k for i, ks in enumerate(keys) for k in ks[:i % 5]]

    class Slow(Store):
        def exists(self, names):
            time.sleep(0.002)
            return super().exists(names)
    store = Slow(objects(present))
    counts = Counts()
    groups = GroupQueries(store.exists, window_s=0.0, parallel=2,
                          on_query=counts.record_group_query,
                          on_store_call=counts.record_group_store_call)
    threads, out = run(groups, keys)
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert not any(t.is_alive() for t in threads)
    assert [out[i].kv_hit_pages for i in range(48)] == [min(i % 5, 4) for i in range(48)]
    assert counts.store_calls < 2 * 48  # distinct queries were batched


def test_mostly_hits_check_everything_in_one_call_mostly_misses_probe_first():
    store = Store(objects([f"p{i}" for i in range(20)]))
    groups = GroupQueries(store.exists, window_s=0.0)
    assert answer(groups, DEP, ["p0", "p1"], []).kv_hit_pages == 2
    assert len(store.calls) == 2  # no history: the probe of page 0, then the rest
    for i in range(2, 20):
        answer(groups, DEP, [f"p{i}"], [])
    store.calls.clear()
    assert answer(groups, DEP, ["p0", "p1", "x"], []).kv_hit_pages == 2
    assert len(store.calls) == 1 and sorted(store.calls[0]) == sorted(objects(["p0", "p1",
                                                                              "x"]))
    for i in range(20):  # a run of misses: probes again, a miss costs page 0 only
        answer(groups, DEP, [f"m{i}"], [])
    store.calls.clear()
    assert answer(groups, DEP, ["m", "p0"], []).kv_hit_pages == 0
    assert store.calls == [["m_m_0_k", "m_m_0_v", "m_m_1_k", "m_m_1_v"]]


def test_lookup_threads_end_when_idle_and_come_back():
    store = Store(objects(["a"]))
    groups = GroupQueries(store.exists, window_s=0.0, idle_s=0.05)
    assert answer(groups, DEP, ["a"], []).kv_hit_pages == 1
    deadline = time.monotonic() + 5
    while groups._threads and time.monotonic() < deadline:
        time.sleep(0.01)
    assert groups._threads == 0
    assert answer(groups, DEP, ["a", "b"], []).kv_hit_pages == 1


def test_ask_gives_up_at_its_wait_limit_while_the_store_check_hangs():
    store = Store(objects(["a"]))
    store.release.clear()  # the store check hangs
    groups = GroupQueries(store.exists, window_s=0.0)
    with pytest.raises(TimeoutError, match="not answered within 0.2 s"):
        answer(groups, DEP, ["a"], [], timeout_s=0.2)
    store.release.set()
    assert answer(groups, DEP, ["a"], [], timeout_s=5).kv_hit_pages == 1
