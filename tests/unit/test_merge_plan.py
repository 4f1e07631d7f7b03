"""Merging concurrent put/get batches (pure logic) and the TransferMerger in front of a
fake store: each caller gets exactly its own objects' codes, colliding keys never share a
call, store calls in flight stay bounded, errors reach every caller of the failed call."""

import random
import threading
import time

import pytest
from raykv.cache_actors.node.merge_plan import Pending, merge, select, split
from raykv.cache_actors.node.transfer_merger import TransferMerger
from raykv.controllers.result_codes import ALREADY_PRESENT

from tests.unit.fakes import Counts


def test_select_takes_same_op_disjoint_keys_in_order():
    pending = [Pending("put", ["a", "b"]), Pending("get", ["c"]), Pending("put", ["c"]),
               Pending("put", ["b", "d"]), Pending("put", ["e"])]
    assert select(pending, 100) == [0, 2, 4]


def test_select_oldest_always_goes_even_if_too_big():
    pending = [Pending("get", list("abcdef")), Pending("get", ["x"])]
    assert select(pending, 4) == [0]
    assert select([Pending("get", ["x"]), Pending("get", list("abcdef")),
                   Pending("get", ["y"])], 4) == [0, 2]


def test_select_stops_at_max_objects_and_empty_queue():
    pending = [Pending("put", [f"k{i}"]) for i in range(10)]
    assert select(pending, 3) == [0, 1, 2]
    assert select([], 3) == []


def test_merge_split_round_trip_random():
    rng = random.Random(7)
    for _ in range(200):
        batches = []
        for b in range(rng.randint(1, 6)):
            n = rng.randint(0, 5)
            batches.append(([f"{b}-{i}" for i in range(n)], [rng.randint(1, 1 << 40)
                                                          for _ in range(n)],
                            [rng.randint(1, 1 << 20) for _ in range(n)]))
        keys, ptrs, sizes, bounds = merge(batches)
        assert keys == [k for b in batches for k in b[0]]
        assert len(bounds) == len(batches) + 1
        codes = [hash((k, p, s)) for k, p, s in zip(keys, ptrs, sizes, strict=True)]
        for (k, p, s), part in zip(batches, split(codes, bounds), strict=True):
            assert part == [hash(x) for x in zip(k, p, s, strict=True)]


def test_merge_and_split_refuse_mismatched_lengths():
    with pytest.raises(ValueError, match="2 keys, 1 pointers"):
        merge([(["a", "b"], [1], [1, 2])])
    with pytest.raises(ValueError, match="3 codes"):
        split([0, 0, 0], [0, 2])


class FakeStore:
    """put-if-absent and get by pointer over a dict; records every call; a call can be
    held (``hold``) and made to raise (``fail``)."""

    def __init__(self) -> None:
        self.objects: dict[str, tuple[int, int]] = {}
        self.calls: list[tuple[str, list[str]]] = []
        self.lock = threading.Lock()
        self.hold = threading.Event()
        self.hold.set()
        self.inflight = 0
        self.most_inflight = 0
        self.fail: BaseException | None = None
        self.threads: set[str] = set()

    def _enter(self, op, keys):
        with self.lock:
            assert len(set(keys)) == len(keys), "a store call repeats a key"
            self.calls.append((op, list(keys)))
            self.threads.add(threading.current_thread().name)
            self.inflight += 1
            self.most_inflight = max(self.most_inflight, self.inflight)
        self.hold.wait(5)
        time.sleep(0.001)

    def _leave(self, op):
        with self.lock:
            self.inflight -= 1
        if self.fail is not None and op == "put":
            raise self.fail

    def put(self, keys, ptrs, sizes):
        self._enter("put", keys)
        try:
            out = []
            with self.lock:
                for k, p, s in zip(keys, ptrs, sizes, strict=True):
                    if k in self.objects:
                        out.append(ALREADY_PRESENT)
                    else:
                        self.objects[k] = (p, s)
                        out.append(0)
            return out
        finally:
            self._leave("put")

    def get(self, keys, ptrs, sizes):
        self._enter("get", keys)
        try:
            with self.lock:
                return [self.objects[k][1] if k in self.objects else -704 for k in keys]
        finally:
            self._leave("get")


def run_threads(fns):
    out = [None] * len(fns)
    errors = [None] * len(fns)

    def target(i):
        try:
            out[i] = fns[i]()
        except BaseException as e:  # noqa: BLE001
            errors[i] = e
    threads = [threading.Thread(target=target, args=(i,), name=f"caller-{i}")
               for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    return out, errors


@pytest.mark.parametrize("inflight", [1, 2, 0])
def test_concurrent_callers_get_their_own_codes(inflight):
    store, counts = FakeStore(), Counts()
    merger = TransferMerger(store, max_inflight=inflight, on_call=counts.record_merged_call)
    store.objects["shared-0"] = (1, 5)

    def caller(c):
        def fn():
            results = []
            for r in range(20):
                keys = [f"c{c}-r{r}-{i}" for i in range(c + 1)] + [f"shared-{r % 3}"]
                sizes = [100 * c + i + 1 for i in range(c + 1)] + [5]
                put = merger.run("put", keys, list(range(len(keys))), sizes)
                got = merger.run("get", keys, list(range(len(keys))), sizes)
                results.append((keys, sizes, put, got))
            return results
        return fn
    out, errors = run_threads([caller(c) for c in range(8)])
    assert errors == [None] * 8
    shared_stored = {}
    for results in out:
        for keys, sizes, put, got in results:
            assert put[:-1] == [0] * (len(keys) - 1)
            assert got[:-1] == sizes[:-1]
            shared_stored.setdefault(keys[-1], []).append(put[-1])
            assert got[-1] == 5
    # First writer wins: every shared key was stored by exactly one caller (shared-0 by
    # none, it was there before); the others saw it already present.
    assert shared_stored["shared-0"].count(0) == 0
    for k in ("shared-1", "shared-2"):
        assert shared_stored[k].count(0) == 1
        assert shared_stored[k].count(ALREADY_PRESENT) == len(shared_stored[k]) - 1
    if inflight:
        assert store.most_inflight <= inflight
        assert counts.batches == 8 * 40
        assert counts.calls <= counts.batches


def test_queued_batches_share_one_call():
    store, counts = FakeStore(), Counts()
    merger = TransferMerger(store, max_inflight=1, on_call=counts.record_merged_call)
    store.hold.clear()  # the first call blocks; the others queue behind it
    first = threading.Thread(target=merger.run, args=("get", ["x"], [1], [1]))
    first.start()
    time.sleep(0.05)
    out = [None] * 6

    def put(i):
        out[i] = merger.run("put", [f"k{i}"], [i], [i + 1])
    threads = [threading.Thread(target=put, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    time.sleep(0.1)
    store.hold.set()
    for t in [first, *threads]:
        t.join(5)
    assert out == [[0]] * 6
    assert [op for op, _ in store.calls] == ["get", "put"]
    assert sorted(store.calls[1][1]) == [f"k{i}" for i in range(6)]
    assert counts.largest == 6


def test_colliding_keys_never_share_a_call():
    store = FakeStore()
    merger = TransferMerger(store, max_inflight=1)
    store.hold.clear()
    threading.Thread(target=merger.run, args=("get", ["x"], [1], [1])).start()
    time.sleep(0.05)
    out = []

    def put(i):
        out.append(merger.run("put", ["same", f"o{i}"], [1, 2], [3, 4]))
    threads = [threading.Thread(target=put, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    time.sleep(0.1)
    store.hold.set()
    for t in threads:
        t.join(5)
    assert sorted(map(tuple, out)) == [(0, 0)] + [(ALREADY_PRESENT, 0)] * 3
    assert len(store.calls) == 5  # the get, then one put per colliding batch


def test_error_in_a_call_reaches_every_caller_of_that_call_only():
    store = FakeStore()
    merger = TransferMerger(store, max_inflight=1)
    store.hold.clear()
    blocker = threading.Thread(target=merger.run, args=("get", ["x"], [1], [1]))
    blocker.start()
    time.sleep(0.05)
    store.fail = RuntimeError("boom")
    results = {}

    def put(i):
        try:
            results[i] = merger.run("put", [f"k{i}"], [1], [1])
        except RuntimeError as e:
            results[i] = e
    threads = [threading.Thread(target=put, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    time.sleep(0.1)
    store.hold.set()
    blocker.join(5)
    for t in threads:
        t.join(5)
    assert all(isinstance(results[i], RuntimeError) for i in range(3))
    store.fail = None
    assert merger.run("put", ["later"], [1], [1]) == [0]  # the merger keeps serving


def test_lone_caller_calls_the_store_on_its_own_thread():
    store = FakeStore()
    merger = TransferMerger(store)
    assert merger.run("put", ["a"], [1], [2]) == [0]
    assert merger.run("get", ["a", "b"], [1, 2], [2, 2]) == [2, -704]
    assert store.threads == {threading.current_thread().name}
    assert merger.run("get", [], [], []) == []


def test_bad_arguments():
    merger = TransferMerger(FakeStore())
    with pytest.raises(ValueError, match="unknown operation"):
        merger.run("remove", ["a"], [1], [1])
    with pytest.raises(ValueError, match="lengths must match"):
        merger.run("put", ["a", "b"], [1], [1, 2])
    with pytest.raises(ValueError, match="max_inflight"):
        TransferMerger(FakeStore(), max_inflight=-1)


def test_backend_code_count_mismatch_is_an_error_not_a_silent_shift():
    class Short(FakeStore):
        def get(self, keys, ptrs, sizes):
            return [1] * (len(keys) - 1)
    merger = TransferMerger(Short())
    with pytest.raises(RuntimeError, match="codes"):
        merger.run("get", ["a", "b"], [1, 2], [1, 1])


def test_select_skips_keys_of_calls_in_flight():
    pending = [Pending("put", ["a"]), Pending("get", ["b"]), Pending("get", ["c"])]
    assert select(pending, 100, busy={"a"}) == [1, 2]
    assert select(pending, 100, busy={"a", "b", "c"}) == []


def test_same_key_never_in_two_calls_at_once_with_two_slots():
    store = FakeStore()
    merger = TransferMerger(store, max_inflight=2)
    out, errors = run_threads([lambda i=i: merger.run("put", ["k", f"own{i}"], [1, 2], [1, 1])
                               for i in range(8)])
    assert errors == [None] * 8
    assert sorted(c[0] for c in out) == [0] + [ALREADY_PRESENT] * 7


def test_a_queued_batch_leaves_at_its_deadline_while_a_store_call_is_stuck():
    """A store call that does not end holds only its own callers: a batch queued behind
    it gets ``DeadlineExceededError`` at its deadline (control: with no deadline it is
    still waiting when the stuck call is released), and once the call ends the store
    serves the next caller."""
    from raykv.cache_actors.errors import DeadlineExceededError

    store = FakeStore()
    store.hold.clear()  # the first call sticks in the store
    merger = TransferMerger(store, max_inflight=1)
    first = threading.Thread(target=merger.run, args=("put", ["a"], [1], [1]), name="stuck")
    first.start()
    deadline = time.monotonic() + 5
    while not store.calls and time.monotonic() < deadline:
        time.sleep(0.01)
    with pytest.raises(DeadlineExceededError, match="deadline"):
        merger.run("put", ["b"], [2], [1], deadline=time.monotonic() + 0.2)
    assert [c[1] for c in store.calls] == [["a"]]  # "b" never reached the store
    waiting = []
    control = threading.Thread(target=lambda: waiting.append(merger.run("put", ["c"], [3], [1])))
    control.start()
    control.join(0.5)
    assert control.is_alive() and not waiting  # no deadline: it waits for the stuck call
    store.hold.set()
    first.join(5)
    control.join(5)
    assert waiting == [[0]]
    assert merger.run("put", ["b"], [2], [1], deadline=time.monotonic() + 5) == [0]


class FakeTicket:
    """A batch's ticket: ``start`` answers ``starts``; records what happened when."""

    def __init__(self, store: FakeStore, starts: bool = True) -> None:
        self.store, self.starts = store, starts
        self.log: list[str] = []

    def start(self) -> bool:
        self.log.append(f"start@{len(self.store.calls)}")
        return self.starts

    def end(self) -> None:
        self.log.append(f"end@{len(self.store.calls)}")


@pytest.mark.parametrize("inflight", [1, 0])
def test_a_merged_call_carries_only_batches_whose_ticket_started(inflight):
    """Tickets start right before the store call and end right after it, before any
    caller returns; a batch whose ticket does not start (its rank gave up) is left out of
    the call and fails with ``DeadlineExceededError``, the others move."""
    from raykv.cache_actors.errors import DeadlineExceededError

    store = FakeStore()
    merger = TransferMerger(store, max_inflight=inflight)
    if inflight:
        store.hold.clear()  # queue both behind a first call: they share the next one
        first = threading.Thread(target=merger.run, args=("get", ["x"], [1], [1]))
        first.start()
        time.sleep(0.05)
    go, gone = FakeTicket(store), FakeTicket(store, starts=False)
    ended_before_return = []

    def call(keys, ticket):
        codes = merger.run("put", keys, [1] * len(keys), [1] * len(keys), ticket=ticket)
        ended_before_return.append(ticket.log[-1].startswith("end"))
        return codes
    if inflight:
        out: list = [None, None]
        errors: list = [None, None]

        def run(i, keys, ticket):
            try:
                out[i] = call(keys, ticket)
            except DeadlineExceededError as e:
                errors[i] = e
        threads = [threading.Thread(target=run, args=(0, ["a", "b"], go)),
                   threading.Thread(target=run, args=(1, ["c"], gone))]
        for t in threads:
            t.start()
        time.sleep(0.1)
        store.hold.set()
        for t in [first, *threads]:
            t.join(5)
        assert out[0] == [0, 0] and isinstance(errors[1], DeadlineExceededError)
    else:
        assert call(["a", "b"], go) == [0, 0]
        with pytest.raises(DeadlineExceededError, match="not started"):
            merger.run("put", ["c"], [1], [1], ticket=gone)
    assert ["c"] not in [keys for _, keys in store.calls] and "c" not in store.objects
    assert sorted(k for k in store.objects if k != "x") == ["a", "b"]
    calls_before = int(go.log[0].split("@")[1])
    assert go.log == [f"start@{calls_before}", f"end@{calls_before + 1}"]  # around one call
    assert gone.log[0].startswith("start") and len(gone.log) == 1  # never ended: not held
    assert ended_before_return == [True]
