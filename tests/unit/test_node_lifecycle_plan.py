"""Which nodes get a node actor and when one leaves: the reconciler's decisions."""

import pytest
from raykv.clusters.node_lifecycle import (
    KEEP_ALL,
    Leaving,
    LifecycleSettings,
    NodeLifecycle,
    NodeSeen,
)

HEAD, W1, W2 = "h" * 56, "a" * 56, "b" * 56
IDLE = 30.0


def life(**kw) -> NodeLifecycle:
    return NodeLifecycle(LifecycleSettings(retire_idle_s=IDLE, drain_timeout_s=20.0, **kw))


def test_node_actors_start_on_the_head_kept_and_wanted_nodes_only():
    lc = life(keep_nodes=(W2,))
    seen = [NodeSeen(HEAD, True, head=True), NodeSeen(W1, True), NodeSeen(W2, True)]
    assert lc.plan(seen, now=0.0, wall_ms=0).start == [HEAD, W2]
    assert lc.want(W1, now=0.0) is None
    assert lc.plan(seen, now=0.0, wall_ms=0).start == [HEAD, W1, W2]
    lc.started(W1, now=0.0)  # a want is served once
    assert lc.plan(seen, now=0.0, wall_ms=0).start == [HEAD, W2]


def test_keep_all_is_a_fixed_cluster():
    lc = NodeLifecycle(LifecycleSettings.fixed())
    seen = [NodeSeen(W1, True), NodeSeen(W2, True, has_actor=True, engines=0)]
    assert lc.plan(seen, now=0.0, wall_ms=0).start == [W1]
    assert lc.plan(seen, now=1e9, wall_ms=0).leaving == []


def test_a_node_actor_without_engines_retires_after_the_idle_period():
    lc = life()
    busy = NodeSeen(W1, True, listed=True, has_actor=True, engines=2)
    idle = NodeSeen(W1, True, listed=True, has_actor=True, engines=0)
    assert lc.plan([busy], now=0.0, wall_ms=0).leaving == []
    assert lc.plan([idle], now=IDLE - 0.1, wall_ms=0).leaving == []
    assert lc.plan([idle], now=IDLE, wall_ms=0).leaving == [Leaving(W1, 20.0, "idle")]
    # an engine seen again restarts the clock
    assert lc.plan([busy], now=IDLE + 1, wall_ms=0).leaving == []
    assert lc.plan([idle], now=2 * IDLE, wall_ms=0).leaving == []
    unknown = NodeSeen(W1, True, listed=True, has_actor=True, engines=None)
    assert lc.plan([unknown], now=10 * IDLE, wall_ms=0).leaving == []  # never on a guess


def test_the_idle_clock_of_a_slow_starting_node_actor_starts_when_it_answers():
    lc = life()
    lc.started(W1, now=0.0)
    starting = NodeSeen(W1, True, listed=True, has_actor=True, engines=None)
    idle = NodeSeen(W1, True, listed=True, has_actor=True, engines=0)
    assert lc.plan([starting], now=IDLE + 5, wall_ms=0).leaving == []
    # first answer after a start longer than the idle period: the engine still has time
    assert lc.plan([idle], now=IDLE + 6, wall_ms=0).leaving == []
    assert lc.plan([idle], now=2 * IDLE + 6, wall_ms=0).leaving == [Leaving(W1, 20.0, "idle")]
    control = life()  # answering all along: idle from its start
    control.started(W1, now=0.0)
    assert control.plan([idle], now=IDLE + 6, wall_ms=0).leaving == [Leaving(W1, 20.0, "idle")]


def test_head_and_kept_nodes_never_retire_and_zero_means_never():
    for lc, node in ((life(), HEAD), (life(keep_nodes=(W1,)), W1),
                     (NodeLifecycle(LifecycleSettings(retire_idle_s=0)), W1)):
        seen = [NodeSeen(node, True, head=node == HEAD, has_actor=True, engines=0)]
        lc.plan(seen, now=0.0, wall_ms=0)
        assert lc.plan(seen, now=1e6, wall_ms=0).leaving == []


def test_a_ray_drain_drains_before_its_deadline_less_the_margin():
    lc = life(deadline_margin_s=2.0)
    seen = [NodeSeen(W1, True, has_actor=True, engines=3, drain_deadline_ms=50_000)]
    assert lc.plan(seen, now=0.0, wall_ms=30_000).leaving == [Leaving(W1, 18.0, "preemption")]
    assert lc.plan(seen, now=1.0, wall_ms=31_000).leaving == []  # once per drain
    lc = life(deadline_margin_s=2.0)
    late = [NodeSeen(W1, True, has_actor=True, drain_deadline_ms=30_500)]
    assert lc.plan(late, now=0.0, wall_ms=30_000).leaving == [Leaving(W1, 0.0, "preemption")]
    none = [NodeSeen(W2, True, has_actor=True, drain_deadline_ms=0)]
    assert lc.plan(none, now=0.0, wall_ms=0).leaving == [Leaving(W2, 20.0, "preemption")]
    # no node actor starts on a draining node, even one an engine asked for
    assert lc.want(HEAD, now=0.0) is None
    assert lc.plan([NodeSeen(HEAD, True, drain_deadline_ms=9)], now=0.0, wall_ms=0).start == []
    assert "draining" in lc.want(HEAD, now=0.0)  # nor later


def test_drain_off_leaves_at_once():
    lc = life(drain=False)
    seen = [NodeSeen(W1, True, has_actor=True, drain_deadline_ms=90_000)]
    assert lc.plan(seen, now=0.0, wall_ms=0).leaving == [Leaving(W1, 0.0, "preemption")]


def test_a_leaving_node_is_left_alone_and_an_engine_calls_an_idle_retirement_off():
    lc = life()
    idle = NodeSeen(W1, True, listed=True, has_actor=True, engines=0)
    lc.plan([idle], now=0.0, wall_ms=0)
    (leaving,) = lc.plan([idle], now=IDLE, wall_ms=0).leaving
    assert lc.begin(leaving) and not lc.begin(leaving)
    assert lc.plan([idle], now=5 * IDLE, wall_ms=0).leaving == []  # once at a time
    assert lc.leaving() == {W1: "idle"}
    assert not lc.called_off(W1, engines=0)
    assert lc.want(W1, now=0.0) is None  # an engine asks while it drains
    assert lc.called_off(W1, engines=0)
    lc.end(W1, stopped=False, now=5 * IDLE)
    assert lc.plan([idle], now=5 * IDLE + 1, wall_ms=0).leaving == []  # the clock restarted
    assert lc.leaving() == {}


def test_preemption_and_operator_drains_refuse_engines_and_stay_off():
    lc = life()
    assert lc.begin(Leaving(W1, 5.0, "preemption"))
    assert "draining" in lc.want(W1, now=0.0)
    assert not lc.called_off(W1, engines=4)  # it goes anyway
    op = lc.operator_drain(W2)
    assert op == Leaving(W2, 20.0, "operator")
    assert lc.begin(op)
    lc.end(W2, stopped=True, now=0.0)
    assert "draining" in lc.want(W2, now=0.0)
    assert lc.plan([NodeSeen(W2, True, listed=False)], now=0.0, wall_ms=0).start == []


def test_a_dead_node_is_retired_and_forgotten():
    lc = life()
    lc.operator_drain(W1)
    plan = lc.plan([NodeSeen(W1, False, listed=True)], now=0.0, wall_ms=0)
    assert plan.left == [W1]
    assert lc.want(W1, now=0.0) is None  # a new node with that id is a new node
    assert lc.plan([NodeSeen(W2, False)], now=0.0, wall_ms=0).left == []


def test_a_listed_node_whose_actor_is_gone_gets_a_new_one():
    lc = life()
    assert lc.plan([NodeSeen(W1, True, listed=True)], now=0.0, wall_ms=0).start == [W1]


@pytest.mark.parametrize("bad", [{"keep_nodes": ("",)}, {"retire_idle_s": -1},
                                 {"drain_timeout_s": float("nan")},
                                 {"deadline_margin_s": "2"}])
def test_bad_settings_are_refused(bad):
    with pytest.raises(ValueError):
        LifecycleSettings(**bad)


def test_keep_all_keeps_every_node():
    assert LifecycleSettings(keep_nodes=(KEEP_ALL,)).keeps(W1)
    assert not LifecycleSettings().keeps(W1)


def test_status_lines_show_leaving_nodes_their_progress_and_reports():
    from raykv.clusters.status_view import lifecycle_lines

    lines = lifecycle_lines({
        "leaving": {W1: "preemption", W2: "idle"},
        "draining": {W1: {"state": "running", "bytes_moved": 3 << 20, "objects_moved": 12,
                          "objects_left": 40, "objects_dropped": 1, "deadline_in_s": 7.2}},
        "reports": {HEAD: {"reason": "operator", "outcome": "stopped", "objects_moved": 5}}})
    assert lines[0] == (f"node {W1[:8]}: draining (Ray drain), moved 3.0 MiB (12 objects), "
                        "left 40, dropped 1, 7 s to its deadline")
    assert lines[1] == f"node {W2[:8]}: retiring (no engines)"
    assert lines[2] == f"node {HEAD[:8]} left (operator): outcome stopped, objects_moved 5"
    assert lifecycle_lines({"error": "gone"}) == ["node lifecycle: unknown (gone)"]


def test_an_engine_that_asks_starts_the_idle_clock_again():
    """A look that saw no engine, planned after an engine asked: the node actor is not
    retired (the engine's ask is newer than the look). Control: without the ask it is."""
    idle = NodeSeen(W1, True, listed=True, has_actor=True, engines=0)
    for asked, leaving in ((True, []), (False, [Leaving(W1, 20.0, "idle")])):
        lc = life()
        assert lc.plan([idle], now=0.0, wall_ms=0).leaving == []
        if asked:
            assert lc.want(W1, now=IDLE - 0.5) is None
        assert lc.plan([idle], now=IDLE, wall_ms=0).leaving == leaving
