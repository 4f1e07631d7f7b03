"""Which nodes get a node actor, and when one leaves (pure: no Ray, no Mooncake).

Ray counts a node that runs any actor as busy, and its autoscaler removes only idle
nodes: a node actor kept on every node would keep every node for good. So, as Ray
Serve does with its per-node proxies, a node actor runs only where it is needed:

- on the head node, on the nodes the operator keeps (``LifecycleSettings.keep_nodes``:
  node ids, or ``all``), and on a node where an engine asked for one (``want``: a rank
  that starts on a node without a node actor asks the reconciler for it);
- a node actor that has had no engine (no live engine process holding pools on its node,
  ``NodePools.engines``) for ``retire_idle_s`` seconds *retires*: it drains its cache to
  the other nodes and stops, and its node becomes idle in Ray's sense once the engines'
  own actors are gone too; the autoscaler's ``idle_timeout`` counts from then. An engine
  that asks for the node actor while it drains keeps it (the retirement is called off,
  its drain at once: ``NodeReconciler.want``);
- a node that Ray marks draining (a PREEMPTION drain: ``ray drain-node``, a KubeRay pod
  deletion, a spot notice) has its node actor drain before the deadline Ray gives, less
  ``deadline_margin_s``, then stop; no node actor starts on it again;
- a node that left (dead in Ray) has its node actor retired at once: nothing can move.

``NodeLifecycle.plan`` turns one look at the cluster into what the reconciler does;
``begin``/``end`` bracket a node's leaving, which runs for seconds beside later looks.
Clocks: ``now`` is ``time.monotonic()`` seconds; Ray's drain deadlines are wall-clock
milliseconds (``time.time() * 1000``), compared with ``wall_ms``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

KEEP_ALL = "all"
"""``keep_nodes`` entry that keeps a node actor on every node (a fixed cluster)."""
RETIRE_IDLE_S = 30.0
"""Default seconds without engines before a node actor retires (as long as Ray Serve's
shortest proxy draining period): short beside an autoscaler's ``idle_timeout`` (60 s in
KubeRay, 5 min in Ray's cluster launcher), long enough that an engine restarting on
the node finds its node actor still there."""
DRAIN_TIMEOUT_S = 30.0
"""Default seconds a retiring node actor drains its cache for (idle retirement and
``raykv drain``)."""
DEADLINE_MARGIN_S = 2.0
"""Seconds a drain for a Ray drain deadline ends before it: the node actor still has to
stop and let Ray know."""


@dataclass(frozen=True)
class LifecycleSettings:
    """``keep_nodes``: node ids that always have a node actor (``KEEP_ALL``: every node;
    the head node always does); ``retire_idle_s``: seconds without engines before a node
    actor retires (0: never); ``drain``: whether a leaving node actor drains its cache
    first (off: it stops at once and its cache is lost); ``drain_timeout_s``: seconds a
    drain without a Ray deadline takes at most; ``deadline_margin_s``: as
    ``DEADLINE_MARGIN_S``."""

    keep_nodes: tuple[str, ...] = ()
    retire_idle_s: float = RETIRE_IDLE_S
    drain: bool = True
    drain_timeout_s: float = DRAIN_TIMEOUT_S
    deadline_margin_s: float = DEADLINE_MARGIN_S

    def __post_init__(self) -> None:
        object.__setattr__(self, "keep_nodes", tuple(self.keep_nodes))
        if any(not isinstance(n, str) or not n for n in self.keep_nodes):
            raise ValueError(f"keep_nodes must be node ids or {KEEP_ALL!r}, got "
                             f"{self.keep_nodes!r}")
        for name in ("retire_idle_s", "drain_timeout_s", "deadline_margin_s"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or value < 0 or value != value:
                raise ValueError(f"{name} must be a number >= 0, got {value!r}")

    @classmethod
    def fixed(cls) -> LifecycleSettings:
        """A node actor on every node for good (a fixed cluster: ``start_local``)."""
        return cls(keep_nodes=(KEEP_ALL,), retire_idle_s=0.0)

    def keeps(self, node_id: str) -> bool:
        return KEEP_ALL in self.keep_nodes or node_id in self.keep_nodes


@dataclass(frozen=True)
class NodeSeen:
    """One node at one look: ``alive`` in Ray; ``head``: the head node; ``listed``: the
    controller lists it (its node actor was started and not retired); ``has_actor``: its
    node actor answers to its name; ``engines``: its node actor's live engines (None: not
    known this look); ``drain_deadline_ms``: Ray marks it draining, until that wall-clock
    time (0: no deadline; None: not draining)."""

    node_id: str
    alive: bool
    head: bool = False
    listed: bool = False
    has_actor: bool = False
    engines: int | None = None
    drain_deadline_ms: int | None = None


@dataclass(frozen=True)
class Leaving:
    """A node actor to drain (for ``deadline_s`` seconds; 0 with drains off) and stop;
    ``reason``: ``idle``, ``preemption`` (Ray's drain) or ``operator`` (``raykv drain``)."""

    node_id: str
    deadline_s: float
    reason: str


@dataclass
class Plan:
    """What one look calls for: node actors to ``start``, nodes that ``left`` (dead:
    retire their actors), node actors ``leaving`` (drain, then stop)."""

    start: list[str] = field(default_factory=list)
    left: list[str] = field(default_factory=list)
    leaving: list[Leaving] = field(default_factory=list)


class NodeLifecycle:
    """The reconciler's memory of each node between looks: since when its node actor has
    had no engine, which nodes engines asked for, which are leaving now, which were
    drained by an operator (kept off). One thread (the reconciler's event loop)."""

    def __init__(self, settings: LifecycleSettings) -> None:
        self.settings = settings
        self._busy_at: dict[str, float] = {}  # node -> last look it had engines (or start)
        self._wanted: set[str] = set()  # engines asked for a node actor there
        self._asked_while_leaving: set[str] = set()
        self._leaving: dict[str, str] = {}  # node -> reason, while it drains and stops
        self._drained: set[str] = set()  # Ray or an operator drains it: no node actor again

    # ------------------------------------------------------------- engines ask
    def want(self, node_id: str, now: float) -> str | None:
        """An engine on ``node_id`` asks for its node actor at ``now``: None if it gets
        one (now or kept: a retirement for idleness is called off, and the idle clock
        starts again, so a look made before the engine came cannot retire it), else
        why not."""
        reason = self._leaving.get(node_id)
        if node_id in self._drained or reason in ("preemption", "operator"):
            return f"node {node_id[:12]} is draining: it is about to leave the cluster"
        if reason == "idle":
            self._asked_while_leaving.add(node_id)
        self._wanted.add(node_id)
        self._busy_at[node_id] = now
        return None

    def started(self, node_id: str, now: float) -> None:
        """Its node actor was started: the idle clock starts now (again at the first look
        it answers, if it is slow to start)."""
        self._wanted.discard(node_id)
        self._busy_at[node_id] = now

    # ----------------------------------------------------------------- looks
    def plan(self, seen: Iterable[NodeSeen], now: float, wall_ms: int) -> Plan:
        """What to do after a look that saw ``seen`` (see the module docstring)."""
        plan = Plan()
        s = self.settings
        for node in seen:
            n = node.node_id
            if not node.alive:
                if node.listed or node.has_actor:
                    plan.left.append(n)
                self._forget(n)
                continue
            if n in self._leaving:
                continue
            if node.drain_deadline_ms is not None:  # Ray drains it: it is about to go
                first = n not in self._drained
                self._drained.add(n)
                if node.has_actor and first:  # once: a stopped actor may show a moment
                    left_s = (node.drain_deadline_ms - wall_ms) / 1000 - s.deadline_margin_s
                    deadline = s.drain_timeout_s if node.drain_deadline_ms == 0 else left_s
                    plan.leaving.append(Leaving(n, max(0.0, deadline) if s.drain else 0.0,
                                                "preemption"))
                continue
            if not node.has_actor:
                if (node.head or s.keeps(n) or n in self._wanted or node.listed) \
                        and n not in self._drained:
                    plan.start.append(n)
                continue
            if node.engines is None:  # starting or not answering: the idle clock starts
                self._busy_at.pop(n, None)  # once it answers (a slow start is not idleness)
                continue
            busy_at = self._busy_at.setdefault(n, now)
            if node.engines:
                self._busy_at[n] = now
            elif (node.engines == 0 and not node.head and not s.keeps(n)
                  and s.retire_idle_s > 0 and now - busy_at >= s.retire_idle_s):
                plan.leaving.append(Leaving(n, s.drain_timeout_s if s.drain else 0.0,
                                            "idle"))
        return plan

    def operator_drain(self, node_id: str) -> Leaving:
        """``raykv drain``: the node actor of ``node_id`` drains and stops, and none
        starts there again (the operator is taking the node away)."""
        self._drained.add(node_id)
        s = self.settings
        return Leaving(node_id, s.drain_timeout_s if s.drain else 0.0, "operator")

    # --------------------------------------------------------------- leaving
    def begin(self, leaving: Leaving) -> bool:
        """``leaving`` starts; False if that node is leaving already."""
        if leaving.node_id in self._leaving:
            return False
        self._leaving[leaving.node_id] = leaving.reason
        self._asked_while_leaving.discard(leaving.node_id)
        return True

    def called_off(self, node_id: str, engines: int) -> bool:
        """After its drain: whether an idle retirement of ``node_id`` is called off (an
        engine asked for it meanwhile, or it has ``engines`` again)."""
        if self._leaving.get(node_id) != "idle":
            return False
        return engines > 0 or node_id in self._asked_while_leaving

    def end(self, node_id: str, stopped: bool, now: float) -> None:
        """The leaving of ``node_id`` is over: its node actor ``stopped``, or kept (the
        idle clock starts again)."""
        self._leaving.pop(node_id, None)
        self._asked_while_leaving.discard(node_id)
        if stopped:
            self._busy_at.pop(node_id, None)
        else:
            self._busy_at[node_id] = now
        self._wanted.discard(node_id)

    def leaving(self) -> dict[str, str]:
        """Node -> reason, for the nodes leaving now."""
        return dict(self._leaving)

    def _forget(self, node_id: str) -> None:
        """``node_id`` left Ray: nothing about it holds any more."""
        self._busy_at.pop(node_id, None)
        self._wanted.discard(node_id)
        self._drained.discard(node_id)
