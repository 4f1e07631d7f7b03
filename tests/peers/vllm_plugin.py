"""pytest plugin: vLLM 0.32.0's own tests against raykv (``-p vllm_plugin`` in a pytest
run inside vLLM's unpacked tests; ``test_vllm_peers.py`` starts it).

What it swaps, at run time only (vLLM's test files are not changed):

- the connector: vLLM's registry entries ``NixlConnector`` (the default of the KV-connector
  tests' ``create_vllm_config``) and ``ExampleConnector`` (the scheduler tests'
  ``use_kv_connector=True``), and the ``ExampleConnector`` that the tests'
  ``TestExampleConnector`` wraps, become ``PeerConnector``: ``RayKVConnector`` with the
  test's extra config replaced by the peer cluster's (``RAYKV_PEER_RAY_ADDRESS``,
  ``RAYKV_PEER_NAMESPACE``, a model name of its own per test);
- the default ``kv_role`` of the KV-connector tests' ``create_vllm_config``:
  ``kv_consumer`` (a disaggregated decode instance, which only loads) becomes ``kv_both``
  (raykv is a cache: an engine loads and saves); a role a test passes stays;
- the mock connector of the load-failure tests (``create_mock_connector``): a mock that
  wraps the scheduler's ``PeerConnector``, so every call vLLM's scheduler makes reaches
  raykv; where the test scripts an answer, raykv is made to hold what the script says
  (``WorkerLoop.seed``) and must give that answer itself;
- the model: ``facebook/opt-125m``, which the tests' configs name, is redirected by
  vLLM's own ``VLLM_MODEL_REDIRECT_PATH`` (set by ``test_vllm_peers.py``) to a tiny
  Llama made offline (the scheduler reads its config only).

And it adds raykv's worker to every scheduler step (``vllm_worker_loop.WorkerLoop``): a
test passes only if vLLM's own assertions hold and raykv loaded right bytes, reported
every failed load, and stores no wrong block after the test.
"""

from __future__ import annotations

import importlib
import os
import uuid
from unittest.mock import DEFAULT, Mock

import pytest

SWAPPED_CONNECTORS = ("NixlConnector", "ExampleConnector")

_uid = uuid.uuid4().hex[:8]  # the current test's model-name suffix
_loops: dict[int, object] = {}  # id(scheduler-role PeerConnector) -> its WorkerLoop
_connectors: list = []  # every PeerConnector of the current test


def _peer_connector_class():
    from raykv.integrations.vllm import RayKVConnector
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    class PeerConnector(RayKVConnector):
        """``RayKVConnector`` on the peer cluster, in place of the connector a test
        names (see the module docstring)."""

        def __init__(self, vllm_config, role, kv_cache_config=None) -> None:
            kv = vllm_config.kv_transfer_config
            kv.kv_connector_extra_config = {
                "ray_address": os.environ["RAYKV_PEER_RAY_ADDRESS"],
                "namespace": os.environ["RAYKV_PEER_NAMESPACE"],
                "model_name": f"peer-{_uid}"}
            if role == KVConnectorRole.WORKER:
                from vllm_world import init_one_rank_world  # this plugin's folder

                init_one_rank_world()
            super().__init__(vllm_config, role, kv_cache_config)
            if role == KVConnectorRole.WORKER and \
                    os.environ.get("RAYKV_PEER_CORRUPT_LOADS") == "1":
                from raykv_lab.bench.digest_engine import corrupt_loads

                # control (test_vllm_peers.py): raykv's loads give random bytes
                corrupt_loads(self.connector_worker, True)
            _connectors.append(self)

    return PeerConnector


class InTheLoop(Mock):
    """The load-failure tests' mock connector, wrapping a scheduler's ``PeerConnector``
    (``wraps``): an unscripted call is raykv's answer; a scripted one (the test set a
    ``side_effect`` or ``return_value``) still reaches raykv, and for the hit query
    (``get_num_new_matched_tokens``) and ``request_finished`` raykv's answer must be the
    scripted one. Child mocks are of this class, wrapping the connector's methods."""

    def _execute_mock_call(self, /, *args, **kwargs):
        real = self._mock_wraps
        scripted = self._mock_side_effect is not None or self._mock_return_value is not DEFAULT
        if real is None or not scripted:
            return super()._execute_mock_call(*args, **kwargs)
        want = super()._execute_mock_call(*args, **kwargs)
        name = self._mock_name
        if name == "get_num_new_matched_tokens":
            request, computed = args
            tokens, is_async = want
            assert not is_async, "raykv loads synchronously (this test scripts an async load)"
            if tokens:
                bs = _loop_of(self._mock_parent._mock_wraps).block_size
                _loop_of(self._mock_parent._mock_wraps).seed(request, computed // bs,
                                                             tokens // bs)
        got = real(*args, **kwargs)
        if name in ("get_num_new_matched_tokens", "request_finished"):
            assert tuple(got) == tuple(want), \
                f"raykv's {name} gave {got}; vLLM's test scripts {want}"
        return want


def _loop_of(connector):
    from vllm_worker_loop import WorkerLoop

    loop = _loops.get(id(connector))
    if loop is None:
        loop = _loops[id(connector)] = WorkerLoop(connector)
    return loop


def _real_connector(scheduler):
    c = scheduler.connector
    if isinstance(c, InTheLoop):
        c = c._mock_wraps
    return c if c is not None and c in _connectors else None


def _swap() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.v1.core.sched.scheduler import Scheduler

    unit_utils = importlib.import_module("tests.v1.kv_connector.unit.utils")  # vLLM's
    peer = _peer_connector_class()
    for name in SWAPPED_CONNECTORS:
        KVConnectorFactory._registry[name] = lambda cls=peer: cls
    unit_utils.ExampleConnector = peer

    def create_mock_connector() -> Mock:
        real = next((c for c in reversed(_connectors) if c.connector_scheduler), None)
        assert real is not None, "no scheduler with raykv's connector to wrap"
        return InTheLoop(wraps=real, name="connector")

    unit_utils.create_mock_connector = create_mock_connector
    create_vllm_config = unit_utils.create_vllm_config

    def create_vllm_config_kv_both(*args, kv_role: str = "kv_both", **kwargs):
        return create_vllm_config(*args, kv_role=kv_role, **kwargs)

    unit_utils.create_vllm_config = create_vllm_config_kv_both

    original = Scheduler.update_from_output

    def update_from_output(self, scheduler_output, model_runner_output):
        real = _real_connector(self)
        if real is not None:
            kvo = model_runner_output.kv_connector_output
            invalid = set(kvo.invalid_block_ids) if kvo is not None else set()
            _loop_of(real).run(self, scheduler_output, invalid)
        return original(self, scheduler_output, model_runner_output)

    Scheduler.update_from_output = update_from_output


def pytest_configure(config: pytest.Config) -> None:
    assert os.environ.get("VLLM_MODEL_REDIRECT_PATH"), "run by test_vllm_peers.py"
    _swap()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Each test's blocks get keys of their own (a model name per test)."""
    global _uid
    _uid = uuid.uuid4().hex[:8]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    """After the test's own body passed: raykv stores no wrong block."""
    try:
        result = yield
        for loop in _loops.values():
            loop.check_store()
        return result
    finally:
        for loop in _loops.values():
            loop.close()
        _loops.clear()
        for c in _connectors:
            c.shutdown()
        _connectors.clear()
