"""NodeLink against fakes of Ray and of the local channel (no cluster): which route each
call takes, what a dead actor, a broken channel, a restarting store and a deadline turn
into, and that only an unreachable actor makes the link re-attach and re-map."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import ray.exceptions
from raykv.cache_actors.data_ops import ASYNC_OPS, DataOp
from raykv.cache_actors.errors import DeadlineExceededError, NodeUnavailableError
from raykv.cache_actors.local_channel import ChannelClosedError
from raykv.cache_actors.rank import node_link
from raykv.cache_actors.rank.node_link import CONTROL_TIMEOUT_S, NodeLink
from raykv.cache_actors.tickets import TicketRef, process_book
from raykv.controllers.naming import CONTROLLER_NAME, node_actor_name

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
        self._node_id = node_id

    def get_actor(self, name: str, namespace: str) -> FakeActor:
        assert namespace == "ns"
        self.lookups.append(name)
        if name not in self.actors:
            raise ValueError(f"Failed to look up actor {name}")
        return self.actors[name]

    def get_runtime_context(self):
        return SimpleNamespace(get_node_id=lambda: self._node_id)

    def get(self, ref: Ref, timeout: float):
        self.timeouts.append((ref.method, timeout))
        answer = ref.actor.answers.get(ref.method)
        if answer is HANG:
            raise ray.exceptions.GetTimeoutError("timed out")
        if isinstance(answer, BaseException):
            raise answer
        return answer(*ref.args) if callable(answer) else answer

    def cancel(self, ref: Ref) -> None:
        self.cancelled.append(ref)


class FakeChannel:
    """A ``ChannelClient``: answers ``op`` with ``answers[op]`` (a value or an exception)."""

    opened: list[FakeChannel] = []

    def __init__(self, path: str, async_ops: frozenset, timeout_s: float,
                 bind=None) -> None:
        self.path, self.async_ops, self.timeout_s = path, async_ops, timeout_s
        self.bind = bind
        self.answers: dict = {}
        self.calls: list[tuple[str, tuple]] = []
        self.closed = False
        FakeChannel.opened.append(self)

    def call(self, op: str, *args):
        self.calls.append((op, args))
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
    monkeypatch.setattr(node_link, "ray", fake_ray)
    monkeypatch.setattr(node_link, "ChannelClient", FakeChannel)
    FakeChannel.opened = []
    return fake_ray


def make_link(remaps: list | None = None, node_id: str = HERE,
              timeout_s: float = 2.5) -> NodeLink:
    remaps = [] if remaps is None else remaps
    return NodeLink(node_id, "ns", remap=lambda: remaps.append(1), timeout_s=timeout_s)


def test_no_actor_on_the_node_is_unavailable(fake):
    with pytest.raises(NodeUnavailableError, match="no raykv cache actor on node"):
        make_link(node_id=OTHER)


def test_control_calls_go_through_ray_with_the_control_deadline(fake):
    actor = fake.actors[node_actor_name(HERE)]
    actor.answers["health"] = {"mode": "embedded"}
    link = make_link()
    assert link.call("health") == {"mode": "embedded"}
    assert link.ask("get_pool", "p") is None
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


def test_a_deadline_on_the_channel_keeps_the_link(fake):
    remaps: list = []
    link = make_link(remaps)
    link.data(DataOp.PUT, "batch")
    FakeChannel.opened[0].answers["put"] = DeadlineExceededError("late")
    with pytest.raises(DeadlineExceededError):
        link.data(DataOp.PUT, "batch")
    assert not link.stale and not FakeChannel.opened[0].closed
    FakeChannel.opened[0].answers["put"] = [0]
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
