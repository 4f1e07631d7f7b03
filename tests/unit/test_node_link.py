"""NodeLink against fakes of Ray and of the local channel (no cluster): which route each
call takes, what a dead actor, a broken channel, a restarting store and a deadline turn
into, and that only an unreachable actor makes the link re-attach and re-map."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import ray.exceptions
from raykv.cache_actors.channel_socket import ChannelClosedError, RequestNotSentError
from raykv.cache_actors.data_ops import ASYNC_OPS, DataOp
from raykv.cache_actors.errors import (
    CircuitOpenError,
    DeadlineExceededError,
    NodeUnavailableError,
)
from raykv.cache_actors.processes import ProcessIdentity
from raykv.cache_actors.rank import node_guard, node_link, node_lookup
from raykv.cache_actors.rank.call_budget import Budget
from raykv.cache_actors.rank.circuit_breaker import BreakerSettings, BreakerState
from raykv.cache_actors.rank.node_guard import NodeGuard
from raykv.cache_actors.rank.node_link import CONTROL_TIMEOUT_S, NodeLink
from raykv.cache_actors.tickets import TicketRef, process_book
from raykv.controllers.naming import CONTROLLER_NAME, RECONCILER_NAME, node_actor_name

HERE, OTHER = "a" * 40, "b" * 40
HANG = object()  # a fake call that never ends: ``ray.get`` times out


class Ref:
    def __init__(self, actor: FakeActor, method: str, args: tuple, kwargs: dict) -> None:
        self.actor, self.method, self.args, self.kwargs = actor, method, args, kwargs


class FakeActor:
    """A Ray actor handle: ``actor.<method>.remote(*args)`` returns a ``Ref``; what
    ``ray.get`` gives for it is ``answers[method]`` (a value, an exception to raise, a
    callable of the args, or ``HANG``)."""

    def __init__(self, name: str, answers: dict | None = None) -> None:
        self.name = name
        self.answers = dict(answers or {})
        self.calls: list[tuple[str, tuple]] = []
        self.kwargs: list[dict] = []  # of each call, in order

    def __getattr__(self, method: str):
        if method.startswith("_"):
            raise AttributeError(method)

        def remote(*args, **kwargs):
            self.calls.append((method, args))
            self.kwargs.append(kwargs)
            return Ref(self, method, args, kwargs)
        return SimpleNamespace(remote=remote)


class FakeRay:
    """The part of ``ray`` a ``NodeLink`` uses: named actors, ``get`` with a timeout,
    ``cancel``, the runtime context's node id, the real exception classes."""

    exceptions = ray.exceptions

    def __init__(self, node_id: str = HERE) -> None:
        self.actors: dict[str, FakeActor] = {}
        self.lookups: list[str] = []
        self.timeouts: list[tuple[str, float]] = []
        self.cancelled: list[Ref] = []
        self.wants: list[tuple] = []  # the reconciler's ``want`` calls' arguments
        self._node_id = node_id
        self.connected = True  # False: as after ray.shutdown()

    def is_initialized(self) -> bool:
        return self.connected

    def get_actor(self, name: str, namespace: str) -> FakeActor:
        assert namespace == "ns"
        self.lookups.append(name)
        if name not in self.actors:
            raise ValueError(f"Failed to look up actor {name}")
        return self.actors[name]

    def get_runtime_context(self):
        return SimpleNamespace(get_node_id=lambda: self._node_id)

    def get(self, ref: Ref, timeout: float | None = None):
        if ref.method == "want":  # the lookup of the node's actor (``node_lookup``)
            self.wants.append(ref.args)
            return None
        # the time left when the call was made (a few us less than its deadline)
        self.timeouts.append((ref.method, None if timeout is None else round(timeout, 2)))
        answer = ref.actor.answers.get(ref.method)
        if answer is HANG:
            raise ray.exceptions.GetTimeoutError("timed out")
        if isinstance(answer, BaseException):
            raise answer
        return answer(*ref.args) if callable(answer) else answer

    def cancel(self, ref: Ref) -> None:
        self.cancelled.append(ref)

    def wait(self, refs: list[Ref], timeout: float) -> tuple[list[Ref], list[Ref]]:
        """Ready unless the answer (looked up now: a question answered later) hangs."""
        if all(r.actor.answers.get(r.method) is not HANG for r in refs):
            return refs, []
        time.sleep(timeout)
        return [], refs


class FakeChannel:
    """A ``ChannelClient``: answers ``op`` with ``answers[op]`` (a value or an exception;
    a new channel starts with ``preset``)."""

    opened: list[FakeChannel] = []
    preset: dict = {}

    def __init__(self, path: str, async_ops: frozenset, timeout_s: float,
                 bind=None, deadline: float | None = None) -> None:
        self.path, self.async_ops, self.timeout_s = path, async_ops, timeout_s
        self.bind, self.deadline = bind, deadline
        self.answers: dict = dict(FakeChannel.preset)
        self.calls: list[tuple[str, tuple]] = []
        self.timeouts: list[float] = []  # what each call was given (rounded)
        self.closed = False
        FakeChannel.opened.append(self)

    def call(self, op: str, *args, timeout_s: float | None = None):
        self.calls.append((op, args))
        self.timeouts.append(round(timeout_s, 2))
        answer = self.answers.get(op, [1])
        if isinstance(answer, BaseException):
            raise answer
        return answer

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def fake(monkeypatch):
    fake_ray = FakeRay()
    fake_ray.actors[node_actor_name(HERE)] = FakeActor("here", {"channel_path": "/sock"})
    # an engine's link gets its node's actor through the reconciler (``want``)
    fake_ray.actors[RECONCILER_NAME] = FakeActor("reconciler")
    monkeypatch.setattr(node_link, "ray", fake_ray)
    monkeypatch.setattr(node_lookup, "ray", fake_ray)
    monkeypatch.setattr(node_link, "ChannelClient", FakeChannel)
    monkeypatch.setattr(node_guard, "ray", fake_ray)
    monkeypatch.setattr(node_guard, "_guards", {})  # every test its own breakers
    FakeChannel.opened = []
    FakeChannel.preset = {}
    return fake_ray


def make_link(remaps: list | None = None, node_id: str = HERE,
              timeout_s: float = 2.5) -> NodeLink:
    remaps = [] if remaps is None else remaps
    return NodeLink(node_id, "ns", remap=lambda: remaps.append(1), timeout_s=timeout_s)


def test_no_actor_on_the_node_is_unavailable(fake):
    with pytest.raises(NodeUnavailableError, match="no raykv node actor on node"):
        make_link(node_id=OTHER)


def test_control_calls_go_through_ray_with_the_control_deadline(fake):
    actor = fake.actors[node_actor_name(HERE)]
    actor.answers["health"] = {"mode": "embedded"}
    link = make_link()
    assert link.call("health") == {"mode": "embedded"}
    assert link.ask("get_pool", "p") is None
    # a link on its actor's node asks the reconciler for it, counted as its engine
    assert fake.wants == [(HERE, ProcessIdentity.current())]
    assert actor.calls == [("health", ()), ("get_pool", ("p",))]
    assert fake.timeouts == [("health", CONTROL_TIMEOUT_S), ("get_pool", CONTROL_TIMEOUT_S)]


def test_local_data_ops_take_the_channel_opened_within_the_deadline(fake):
    actor = fake.actors[node_actor_name(HERE)]
    link = make_link(timeout_s=2.5)
    assert link.data(DataOp.EXISTS, ["k"]) == [1]
    assert link.data(DataOp.GET, "batch") == [1]
    (channel,) = FakeChannel.opened  # one channel, its path asked once, within 2.5 s
    assert channel.path == "/sock" and channel.timeout_s == 2.5
    assert channel.async_ops == ASYNC_OPS
    (exists, (get, (batch, ticket))) = channel.calls  # a get carries its ticket
    assert exists == ("exists", (["k"],)) and (get, batch) == ("get", "batch")
    assert isinstance(ticket, TicketRef) and ticket.book == process_book().name
    assert actor.calls == [("channel_path", ())]
    assert fake.timeouts == [("channel_path", 2.5)]


def test_data_ops_of_another_node_go_through_ray_with_the_data_deadline(fake):
    fake.actors[node_actor_name(OTHER)] = FakeActor("other", {"group_exists": "hit"})
    link = make_link(timeout_s=2.5)
    assert link.data(DataOp.GROUP_EXISTS, "dep", 1, node_id=OTHER) == "hit"
    assert fake.actors[node_actor_name(OTHER)].calls == [("group_exists", ("dep", 1))]
    assert fake.timeouts == [("group_exists", 2.5)]
    assert FakeChannel.opened == []


def test_a_client_off_its_actors_node_uses_ray_for_data(fake):
    fake._node_id = OTHER  # this process runs on another node than the link's actor
    fake.actors[node_actor_name(HERE)].answers["put"] = [0, 0]
    link = make_link(timeout_s=1.0)
    sent = time.monotonic()
    assert link.data(DataOp.PUT, "batch") == [0, 0]
    assert fake.timeouts == [("put", 1.0)] and FakeChannel.opened == []
    actor = fake.actors[node_actor_name(HERE)]
    assert actor.calls == [("put", ("batch",))]  # the batch; its ticket and deadline named
    (kw,) = actor.kwargs
    assert isinstance(kw["ticket"], TicketRef)
    assert sent + 1.0 <= kw["deadline"] <= time.monotonic() + 1.0


def test_a_dead_actor_is_retryable_and_the_retry_reaches_its_replacement(fake):
    name = node_actor_name(HERE)
    fake.actors[name].answers["stats"] = ray.exceptions.RayActorError()
    remaps: list = []
    link = make_link(remaps)
    fake.actors[CONTROLLER_NAME] = FakeActor("controller", {"info": {}})
    link.ask_controller("info")
    assert link.controller_attached
    replacement = FakeActor("replacement", {"stats": {"ok": 1}})
    fake.lookups.clear()

    def die_then_replace(*args):
        fake.actors[name] = replacement
        raise ray.exceptions.RayActorError()
    fake.actors[name].answers["stats"] = die_then_replace
    with pytest.raises(NodeUnavailableError, match="restarted automatically: retry"):
        link.call("stats")
    assert fake.lookups == [name]  # re-attached by name
    assert link.stale and not link.controller_attached and remaps == []
    assert link.call("stats") == {"ok": 1}  # the retry: re-mapped first, then served
    assert remaps == [1] and not link.stale
    assert link.call("stats") == {"ok": 1} and remaps == [1]  # re-mapped once


def test_an_unavailable_actor_is_retryable_too(fake):
    fake.actors[node_actor_name(HERE)].answers["put"] = ray.exceptions.ActorUnavailableError(
        "restarting", b"1" * 16)
    fake._node_id = OTHER
    link = make_link()
    with pytest.raises(NodeUnavailableError):
        link.data(DataOp.PUT, "batch")
    assert link.stale


def test_a_broken_channel_reattaches_and_reopens_after_remapping(fake):
    remaps: list = []
    link = make_link(remaps)
    link.data(DataOp.EXISTS, ["k"])
    first = FakeChannel.opened[0]
    first.answers["exists"] = ChannelClosedError("peer closed")
    with pytest.raises(NodeUnavailableError, match="actor for exists"):
        link.data(DataOp.EXISTS, ["k"])
    assert first.closed and link.stale and remaps == []
    assert link.data(DataOp.EXISTS, ["k"]) == [1]
    assert remaps == [1] and len(FakeChannel.opened) == 2  # a new channel


def test_a_store_restarting_inside_the_actor_reattaches(fake):
    err = NodeUnavailableError("mooncake_client is down")
    err.cause = "mooncake_client is down"
    fake.actors[node_actor_name(HERE)].answers["health"] = err
    link = make_link()
    with pytest.raises(NodeUnavailableError, match="mooncake_client is down"):
        link.call("health")
    assert link.stale


def test_a_deadline_cancels_and_neither_reattaches_nor_remaps(fake):
    name = node_actor_name(HERE)
    fake.actors[name].answers["stats"] = HANG
    remaps: list = []
    link = make_link(remaps)
    fake.lookups.clear()
    with pytest.raises(DeadlineExceededError, match="did not finish within 120 s"):
        link.call("stats")
    assert [r.method for r in fake.cancelled] == ["stats"]
    assert fake.lookups == [] and not link.stale
    fake.actors[name].answers["stats"] = {"ok": 1}
    assert link.call("stats") == {"ok": 1} and remaps == []


def test_a_deadline_on_the_channel_keeps_the_link(fake, monkeypatch):
    guard = fast_guard(monkeypatch)
    remaps: list = []
    link = make_link(remaps)
    link.data(DataOp.PUT, "batch")
    FakeChannel.opened[0].answers["put"] = DeadlineExceededError("late")
    with pytest.raises(DeadlineExceededError):
        link.data(DataOp.PUT, "batch")
    assert not link.stale and not FakeChannel.opened[0].closed
    FakeChannel.opened[0].answers["put"] = [0]
    assert poll(lambda: guard.breaker.state is BreakerState.TRIAL)  # the probe answered
    assert link.data(DataOp.PUT, "batch") == [0] and remaps == []


def test_a_group_home_node_without_an_actor_drops_the_controller(fake):
    fake.actors[CONTROLLER_NAME] = FakeActor("controller", {"info": {}})
    link = make_link()
    link.ask_controller("info")
    with pytest.raises(NodeUnavailableError, match="retry the call"):
        link.data(DataOp.GROUP_EXISTS, "dep", node_id=OTHER)
    assert not link.controller_attached  # the next group query registers again
    assert not link.stale  # this node's actor is fine


def test_no_controller_is_unavailable(fake):
    with pytest.raises(NodeUnavailableError, match="no raykv controller"):
        make_link().ask_controller("info")


def test_a_tenants_link_opens_a_session_within_the_deadline_and_a_fresh_proof_per_bind(
        fake):
    """The channel's bind makes a fresh call proof for each connection (a proof is good
    once), the session is opened through Ray within the data op's deadline, and a
    re-attach forgets it (the actor may have restarted): the next bind opens another."""
    from raykv.cache_actors.rank.rank_owner import RankOwner
    from raykv.controllers.contract import StorageConfig
    from raykv.controllers.ownership import OwnerBindings, for_call

    bindings = OwnerBindings()
    actor = fake.actors[node_actor_name(HERE)]
    actor.answers["challenge"] = bindings.challenge
    actor.answers["open_session"] = bindings.open_session
    owner = RankOwner.of_config(StorageConfig(model_name="m", extra_config={"tenant": "t"}),
                                {"RAYKV_TENANT_SECRET": "s" * 32})
    link = NodeLink(HERE, "ns", remap=lambda: None, timeout_s=2.5, owner=owner)
    link.data(DataOp.EXISTS, ["k"])
    (channel,) = FakeChannel.opened
    first, second = channel.bind(), channel.bind()  # two connections' binds
    assert first.proof != second.proof
    bound = [for_call(c, "channel") for c in (first, second, first)]
    assert bindings.verify(bound[0]) is bound[0] and bindings.verify(bound[1]) is bound[1]
    with pytest.raises(ValueError, match="shown before"):
        bindings.verify(bound[2])  # CONTROL: a bind is good once
    # the session's two calls run within the data op's deadline (what is left of 2.5 s)
    waits = dict((m, t) for m, t in fake.timeouts if m in ("challenge", "open_session"))
    assert set(waits) == {"challenge", "open_session"}
    assert all(0 < t <= 2.5 for t in waits.values()), waits
    channel.answers["exists"] = ChannelClosedError("the node actor closed the channel")
    with pytest.raises(NodeUnavailableError):
        link.data(DataOp.EXISTS, ["k"])  # the link re-attaches: sessions forgotten
    assert [c[0] for c in actor.calls].count("open_session") == 1
    link.claim(None, "channel")
    assert [c[0] for c in actor.calls].count("open_session") == 2


# ------------------------------------------------------ circuit breaker and probe
WAIT_S = 10.0  # bound of a poll for the probe thread: only turns a hang into a failure


def fast_guard(monkeypatch, node_id: str = HERE) -> NodeGuard:
    """This process's guard on ``node_id``'s actor, with a short hold (10 ms)."""
    guard = NodeGuard(node_id, "ns", BreakerSettings(hold_s=0.01, max_hold_s=0.01))
    monkeypatch.setitem(node_guard._guards, ("ns", node_id), guard)
    return guard


def poll(condition) -> bool:
    end = time.monotonic() + WAIT_S
    while not condition() and time.monotonic() < end:
        time.sleep(0.005)
    return condition()


def test_a_whole_deadline_missed_opens_the_breaker_then_calls_fail_without_being_sent(
        fake, monkeypatch):
    guard = fast_guard(monkeypatch)
    actor = fake.actors[node_actor_name(HERE)]
    actor.answers["health"] = HANG  # stopped: the probe's question stays unanswered
    link = make_link()
    assert link.data(DataOp.EXISTS, ["k"]) == [1]
    channel = FakeChannel.opened[0]
    channel.answers["exists"] = DeadlineExceededError("late")
    with pytest.raises(DeadlineExceededError):  # granted its whole deadline: opens
        link.data(DataOp.EXISTS, ["k"])
    assert guard.breaker.state is BreakerState.OPEN
    sent = len(channel.calls)
    for _ in range(5):
        with pytest.raises(CircuitOpenError, match="failed at once"):
            link.data(DataOp.EXISTS, ["k"])
    assert len(channel.calls) == sent  # none reached the channel
    assert guard.breaker.counts()["rejected"] == 5
    time.sleep(0.1)  # the probe asks and waits: still no answer, still open
    assert guard.breaker.state is BreakerState.OPEN
    assert [m for m, _ in actor.calls].count("health") == 1  # one question, not piled up

    actor.answers["health"] = {"pid": 1}  # continued: the question is answered
    channel.answers["exists"] = [1]
    assert poll(lambda: guard.breaker.state is BreakerState.TRIAL)
    assert link.data(DataOp.EXISTS, ["k"]) == [1]  # the trial
    assert guard.breaker.state is BreakerState.CLOSED
    assert link.data(DataOp.EXISTS, ["k"]) == [1]
    assert poll(lambda: not guard._probing)


def test_a_breaker_is_per_node_actor_and_shared_by_the_links_of_a_process(fake, monkeypatch):
    guard = fast_guard(monkeypatch)
    fake.actors[node_actor_name(HERE)].answers["health"] = HANG
    fake.actors[node_actor_name(OTHER)] = FakeActor("other", {"group_exists": "hit"})
    link, other_link = make_link(), make_link()
    link.data(DataOp.EXISTS, ["k"])
    FakeChannel.opened[0].answers["exists"] = DeadlineExceededError("late")
    with pytest.raises(DeadlineExceededError):  # granted its whole deadline: opens
        link.data(DataOp.EXISTS, ["k"])
    with pytest.raises(CircuitOpenError):  # another client of this process, same actor
        other_link.data(DataOp.EXISTS, ["k"])
    # the actor of another node (a group's home node) is not affected
    assert link.data(DataOp.GROUP_EXISTS, "dep", node_id=OTHER) == "hit"
    assert guard.breaker.state is BreakerState.OPEN
    fake.actors[node_actor_name(HERE)].answers["health"] = {"pid": 1}
    assert poll(lambda: not guard._probing)  # answered: the probe thread ended


@pytest.mark.parametrize("connected", [False, True])
def test_the_probe_never_calls_ray_once_the_process_left_ray(fake, monkeypatch, connected):
    """After ``ray.shutdown()`` the probe ends without a Ray call (one would start a new
    local Ray in the engine's process); control: while connected it keeps asking."""
    guard = fast_guard(monkeypatch)
    actor = fake.actors[node_actor_name(HERE)]
    actor.answers["health"] = HANG
    link = make_link()
    link.data(DataOp.EXISTS, ["k"])
    FakeChannel.opened[0].answers["exists"] = DeadlineExceededError("late")
    fake.connected = connected
    lookups = len(fake.lookups)
    with pytest.raises(DeadlineExceededError):  # opens the breaker, starts the probe
        link.data(DataOp.EXISTS, ["k"])
    if connected:
        assert poll(lambda: len(fake.lookups) > lookups)  # the probe looked the actor up
        fake.connected = False  # let the thread end
    assert poll(lambda: not guard._probing)
    if not connected:
        assert len(fake.lookups) == lookups and guard.breaker.state is BreakerState.OPEN


def test_errors_that_come_back_at_once_do_not_open_the_breaker(fake, monkeypatch):
    """Control: a dead actor, a broken channel or a restarting store cost a caller no
    wait, so they never make calls fail without being sent."""
    guard = fast_guard(monkeypatch)
    err = NodeUnavailableError("mooncake_client is down")
    link = make_link()
    for answer in (err, ChannelClosedError("peer closed"), err, err, ValueError("bad")):
        FakeChannel.preset = {"exists": answer}  # a channel opened anew answers so too
        if FakeChannel.opened:
            FakeChannel.opened[-1].answers["exists"] = answer
        with pytest.raises((NodeUnavailableError, ValueError)):
            link.data(DataOp.EXISTS, ["k"])
    assert guard.breaker.state is BreakerState.CLOSED
    assert guard.breaker.counts()["rejected"] == 0


# ------------------------------------------------------------------ budgets
def test_a_budget_bounds_the_calls_inside_it_and_a_spent_one_sends_nothing(fake, monkeypatch):
    guard = fast_guard(monkeypatch)
    link = make_link(timeout_s=2.5)
    link.data(DataOp.EXISTS, ["k"])
    channel = FakeChannel.opened[0]
    with Budget(1.0):
        link.data(DataOp.EXISTS, ["k"])
    assert channel.timeouts == [2.5, 1.0]
    with Budget(0.0), pytest.raises(DeadlineExceededError, match="budget"):
        link.data(DataOp.EXISTS, ["k"])
    assert len(channel.calls) == 2  # not sent
    assert guard.breaker.counts()["in_a_row"] == 0  # and not the actor's failure
    spent = Budget(1.0)
    channel.answers["exists"] = DeadlineExceededError("late")
    with spent, pytest.raises(DeadlineExceededError):
        link.data(DataOp.EXISTS, ["k"])
    assert spent.left() < 1.0  # a call spends what it took
    # granted 1 s of its 2.5 s: counted, not yet a whole deadline, so still closed
    counts = guard.breaker.counts()
    assert counts["state"] == "closed" and counts["granted_in_a_row_s"] == pytest.approx(1.0)


def test_control_calls_inside_a_budget_wait_no_longer_than_it(fake):
    link = make_link()
    fake.actors[CONTROLLER_NAME] = FakeActor("controller", {"register_rank": "reg"})
    with Budget(0.5):
        link.ask_controller("register_rank")
        link.call("stats")
    # the second call is granted what the first left of the budget (at most 0.5 s)
    assert [m for m, _ in fake.timeouts] == ["register_rank", "stats"]
    assert fake.timeouts[0][1] == pytest.approx(0.5, abs=0.02)
    assert 0 < fake.timeouts[1][1] <= fake.timeouts[0][1]


# --------------------------------------------------- re-attach and retry on a step
def test_a_remap_before_a_data_op_runs_within_its_deadline(fake):
    fake.actors[node_actor_name(HERE)].answers["get_pool"] = HANG
    link = NodeLink(HERE, "ns", remap=lambda: link.ask("get_pool", "p"), timeout_s=2.5)
    link.stale = True
    with pytest.raises(DeadlineExceededError):
        link.data(DataOp.EXISTS, ["k"])
    assert fake.timeouts == [("get_pool", 2.5)] and link.stale
    # control: the same re-map before a control call has a control call's deadline
    with pytest.raises(DeadlineExceededError):
        link.call("stats")
    assert fake.timeouts[-1] == ("get_pool", CONTROL_TIMEOUT_S)


def batches(calls: list[tuple]) -> list[tuple]:
    """``(op, batch)`` of each channel call (a put's or get's ticket left out)."""
    return [(op, args[0]) for op, args in calls]


@pytest.mark.parametrize("retry", [True, False])
def test_a_request_never_sent_is_sent_once_more_on_a_new_connection(fake, monkeypatch,
                                                                    retry):
    """After a restart, the old connection is broken before the request is written:
    re-attach, re-map and send it on a new connection, within the same call (control:
    with the retry off, the caller sees the error)."""
    if not retry:  # CONTROL: no call is sent again
        monkeypatch.setattr(node_link, "sent_again", lambda error: False)
    remaps: list = []
    link = make_link(remaps)
    link.data(DataOp.PUT, "batch")
    old = FakeChannel.opened[0]
    old.answers["put"] = RequestNotSentError("the request was not sent: Broken pipe")
    if retry:
        assert link.data(DataOp.PUT, "batch") == [1]
        assert remaps == [1] and not link.stale
        (new,) = FakeChannel.opened[1:]
        assert batches(new.calls) == [("put", "batch")]
    else:
        with pytest.raises(NodeUnavailableError, match="Broken pipe"):
            link.data(DataOp.PUT, "batch")
        assert link.stale and len(FakeChannel.opened) == 1
    assert old.closed and batches(old.calls) == [("put", "batch")] * 2


def test_a_request_is_sent_again_once_at_most(fake):
    link = make_link()
    FakeChannel.preset = {"put": RequestNotSentError("not sent: Broken pipe")}
    with pytest.raises(NodeUnavailableError, match="Broken pipe"):
        link.data(DataOp.PUT, "batch")
    assert [batches(c.calls) for c in FakeChannel.opened] == [[("put", "batch")]] * 2


def test_a_group_query_that_ran_out_counts_its_whole_deadline(fake, monkeypatch):
    """The registration before a group query takes part of the query's deadline; the
    data op that then runs out was granted less, but its caller waited the whole
    deadline in vain, which is what opens the breaker."""
    guard = fast_guard(monkeypatch, OTHER)
    fake.actors[node_actor_name(OTHER)] = FakeActor("other", {"group_exists": HANG,
                                                              "health": HANG})
    link = make_link(timeout_s=2.5)
    with pytest.raises(DeadlineExceededError), link.bounded(2.5, "group_exists"):
        time.sleep(0.05)  # the registration
        link.data(DataOp.GROUP_EXISTS, "dep", node_id=OTHER)
    assert fake.timeouts[-1][1] < 2.5  # the data op itself had less
    assert guard.breaker.state is BreakerState.OPEN
    fake.actors[node_actor_name(OTHER)].answers["health"] = {"pid": 1}
    assert poll(lambda: not guard._probing)
