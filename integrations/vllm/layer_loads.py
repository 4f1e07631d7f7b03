"""Copies of loaded blocks into vLLM's KV cache, layer by layer, behind the forward (pure:
torch and threading, no vLLM).

A synchronous load from the node's L2 ends in a copy of every layer of its blocks into
vLLM's KV cache; vLLM's forward needs layer ``i`` only when it reaches layer ``i``'s
attention, and asks the connector first (``wait_for_layer_load``). ``LayerLoads`` runs
the copy of one step's blocks on a copy thread in layer order, so that the forward
computes layer ``i`` while layer ``i + 1`` is copied: the forward waits for a layer's
copy only where the copy is behind.

Used only once the worker has seen vLLM ask for every layer it copies in one step
(``LayerWaits``): a model whose forward never asks would read a layer before its copy.
The copies are of host memory the step thread holds (L2 pages it acquired, vLLM's
blocks of the step's requests); nothing in them waits on another process, so a wait for
one lasts as long as the copy (a bounded memcpy), or until the copy thread is found gone
(its copies then count as failed), and the step thread releases the pages only after
``finish``.

Threads: ``start``, ``wait``, ``finish`` and ``close`` are called by vLLM's worker thread
(the step); the copies run on the ``raykv-layer-loads`` thread, one step's at a time.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence

log = logging.getLogger("vllm." + __name__)

ALIVE_CHECK_S = 0.5
"""How often a wait for a copy checks that the copy thread still runs."""

LayerCopy = Callable[[int], None]
"""Copies one layer (its index) of the step's blocks."""


class LayerWaits:
    """Which layers vLLM asked for in one step (``wait_for_layer_load``): ``seen``
    records an ask, ``step_ended`` closes the step; ``learnt`` is True from the first
    step in which vLLM asked for every one of ``layers`` (and stays True)."""

    def __init__(self, layers: Sequence[str]) -> None:
        self._layers = frozenset(layers)
        self._asked: set[str] = set()
        self.learnt = False

    def seen(self, layer: str) -> None:
        if not self.learnt:
            self._asked.add(layer)

    def step_ended(self) -> None:
        if not self.learnt:
            self.learnt = bool(self._layers) and self._layers <= self._asked
            self._asked.clear()


class LayerLoads:
    """The copy thread of one worker: ``start(copy, layers)`` copies layers ``0 ..
    layers - 1`` in order (``copy(i)``); ``wait(i)`` returns once layer ``i`` is copied;
    ``finish()`` once every layer is, returning whether every copy succeeded."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._done: list[threading.Event] = []
        self._ok = True
        self._thread = threading.Thread(target=self._run, name="raykv-layer-loads",
                                        daemon=True)
        self._thread.start()

    @property
    def busy(self) -> bool:
        """Whether a step's copies were started and not yet ``finish``-ed."""
        return bool(self._done)

    def start(self, copy: LayerCopy, layers: int) -> None:
        """Copy ``layers`` layers on the copy thread, in order. The step's earlier copies
        must be finished (``finish``)."""
        if self._done:
            raise RuntimeError("LayerLoads.start before the last step's copies finished")
        self._ok = True
        self._done = [threading.Event() for _ in range(layers)]
        self._jobs.put((copy, self._done))

    def wait(self, layer: int) -> None:
        """Return once layer ``layer`` of the step's copies is done (at once if none
        were started, or ``layer`` is not one of them)."""
        if 0 <= layer < len(self._done):
            self._wait(self._done[layer])

    def finish(self) -> bool:
        """Wait for every layer of the step's copies; whether all succeeded (True when
        none were started). The copy thread touches no memory afterwards."""
        for e in self._done:
            self._wait(e)
        self._done = []
        return self._ok

    def _wait(self, event: threading.Event) -> None:
        """Wait for ``event``, or until the copy thread is found gone (then the step's
        copies count as failed)."""
        while not event.wait(ALIVE_CHECK_S):
            if not self._thread.is_alive():
                self._ok = False
                return

    def close(self) -> None:
        """Finish the step's copies and end the copy thread."""
        self.finish()
        self._jobs.put(None)
        self._thread.join()

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            copy, done = job
            for i, event in enumerate(done):
                try:
                    if self._ok:
                        copy(i)
                except Exception as e:  # reported by finish; the later layers not copied
                    self._ok = False
                    log.warning("RayKVConnector: layer %d of a load not copied (%s)", i, e)
                finally:
                    event.set()


class LoadsBehind:
    """A worker's loads copied behind the forward: whether they may be (``LayerWaits``
    over its KV cache's layers, by name), its copy thread (``LayerLoads``, made on first
    use) and the vLLM blocks of the step's copies (``blocks``).

    Threads: vLLM's worker thread calls every method."""

    def __init__(self, layers: Sequence[str]) -> None:
        self._index = {name: i for i, name in enumerate(layers)}
        self.waits = LayerWaits(layers)
        self._loads: LayerLoads | None = None
        self.blocks: list[int] = []

    def copier(self) -> LayerLoads | None:
        """The copy thread for this step's loads, once vLLM's forward was seen to ask for
        every layer; None before."""
        if not self.waits.learnt:
            return None
        if self._loads is None:
            self._loads = LayerLoads()
        return self._loads

    def wait(self, layer: str) -> float:
        """Note that the forward asked for ``layer``; return once its copy is done: the
        seconds waited."""
        self.waits.seen(layer)
        if self._loads is None or not self._loads.busy:
            return 0.0
        t0 = time.perf_counter()
        self._loads.wait(self._index.get(layer, -1))
        return time.perf_counter() - t0

    def settle(self) -> tuple[bool, list[int]] | None:
        """Wait for the step's copies: ``(all succeeded, their blocks)``; None if none
        were started. No copy runs afterwards."""
        if self._loads is None or not self._loads.busy:
            return None
        ok = self._loads.finish()
        blocks, self.blocks = self.blocks, []
        return ok, blocks

    def close(self) -> None:
        """End the copy thread (after its copies)."""
        loads, self._loads = self._loads, None
        if loads is not None:
            loads.close()
