"""`raykv up | status | down` against a real `ray start --head` cluster, as a user runs
them; a rank uses the cache in between; the supervised master is restarted if killed;
`up --standalone` runs a mooncake_client per node that `down` stops; `up --disk-dir`
keeps pages over `down` and `up`; `status --watch`
in a terminal shows the node's counters move when a rank writes, and Ctrl-C ends it."""

import fcntl
import json
import os
import pty
import re
import signal
import struct
import subprocess
import sys
import termios
import textwrap
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from raykv.cache_actors.listeners import listeners
from raykv.cache_actors.local_ports import free_port
from raykv.cache_actors.node.node_memory import node_memory_bytes
from raykv.controllers.tenant_quotas import untenanted_bound

from tests.integration.processes import running_clients

ENV = os.environ | {"RAY_AUTH_MODE": "disabled"}
ROOT = Path(__file__).resolve().parents[2]
# A user's driver on the cluster, in a process of its own as with any `ray start` cluster.
# (When the pytest process itself joined this auth-disabled cluster, the next start_local
# in it failed: "Failed to start GCS ... RAY_AUTH_MODE is currently 'disabled'".)
RANK = textwrap.dedent('''
    import sys
    import ray
    from raykv import CacheClient, StorageConfig
    from tests.integration.ranks import MHA, indices

    address, uid, standalone = sys.argv[1], sys.argv[2], sys.argv[3] == "standalone"
    ray.init(address=address, namespace="raykv", log_to_driver=False)
    if standalone:
        client = CacheClient(StorageConfig(extra_config={"standalone_storage": True}))
        client.register_mem_pool_host(client.create_host_pool("mha", **MHA))
        keys = [f"{uid}-{i}" for i in range(2)]
        assert client.batch_set_v1(keys, indices(0, 2)) == [True] * 2
        assert client.batch_get_v1(keys, indices(8, 2)) == [True] * 2
    else:
        client = CacheClient(StorageConfig(model_name=f"cli/{uid}"))
        client.register_mem_pool_host(client.create_host_pool("mha", name=f"p{uid}", **MHA))
        keys = [f"{uid}-{i}" for i in range(3)]
        assert client.batch_set_v1(keys, indices(0, 3)) == [True] * 3
        assert client.batch_get_v1(keys, indices(8, 3)) == [True] * 3
        assert client.group_exists(keys).kv_hit_pages == 3
    print("rank ok")
''')

# A driver that puts (mode "put") or reads back (mode "get": prints how many pages were
# read, each compared with its bytes) pages beyond what a 16 MiB segment holds.
DISK_RANK = textwrap.dedent('''
    import sys, time
    import ray, torch
    from raykv import CacheClient, StorageConfig
    from tests.integration.ranks import indices

    address, uid, mode = sys.argv[1], sys.argv[2], sys.argv[3]
    ray.init(address=address, namespace="raykv", log_to_driver=False)
    client = CacheClient(StorageConfig(model_name=f"disk/{uid}"))
    pool = client.create_host_pool("mha", page_size=16, size=16 * 128, layer_num=4,
                                   head_num=8, head_dim=64, dtype=torch.float16)
    client.register_mem_pool_host(pool)
    written = torch.randn(pool.kv_buffer.shape, generator=torch.Generator().manual_seed(5))
    written = written.to(torch.float16)
    keys = [f"{uid}-{i}" for i in range(128)]
    if mode == "put":
        pool.kv_buffer.copy_(written)
        deadline = time.monotonic() + 120
        for i, key in enumerate(keys):
            while client.batch_set_v1([key], indices(16 * i, 1, 16)) != [True]:
                assert time.monotonic() < deadline, f"page {i} was never stored"
                time.sleep(0.5)
    else:
        hits = client.batch_get_v1(keys, indices(0, 128, 16))
        for i, hit in enumerate(hits):
            page = slice(16 * i, 16 * (i + 1))
            assert not hit or torch.equal(pool.kv_buffer[:, page], written[:, page]), i
        print("pages read", sum(hits))
    print("rank ok")
''')


def rank(address: str, uid: str, mode: str, script: str = RANK) -> str:
    """Run ``RANK`` as a driver process of its own against the cluster at ``address``."""
    out = subprocess.run([sys.executable, "-c", script, address, uid, mode], cwd=ROOT,
                         env=ENV, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0 and "rank ok" in out.stdout, out.stderr[-3000:]
    return out.stdout


def raykv(*args: str, check: bool = True, env: dict[str, str] | None = None
          ) -> subprocess.CompletedProcess:
    out = subprocess.run([sys.executable, "-m", "raykv.clusters.cli", *args],
                         env=ENV | (env or {}), capture_output=True, text=True, timeout=180)
    if check:
        assert out.returncode == 0, out.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def ray_head(tmp_path_factory):
    """A Ray head started as a user would (`ray start --head --block`), stopped after the
    module; each test leaves it as it found it (`raykv down`)."""
    port = free_port()
    ray_cli = str(Path(sys.executable).parent / "ray")
    with open(tmp_path_factory.mktemp("ray-head") / "head.log", "w") as log:
        head = subprocess.Popen([ray_cli, "start", "--head", "--block", f"--port={port}",
                                 "--num-cpus=2", "--include-dashboard=false",
                                 "--disable-usage-stats"], env=ENV, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
    from ray._private.services import get_node_ip_address

    address = f"{get_node_ip_address()}:{port}"
    deadline = time.monotonic() + 60
    while subprocess.run([ray_cli, "status", f"--address={address}"], env=ENV,
                         capture_output=True).returncode != 0:
        assert head.poll() is None and time.monotonic() < deadline, "ray head did not start"
        time.sleep(1)
    yield address
    os.killpg(head.pid, signal.SIGTERM)
    try:  # `ray start --block` often outlives SIGTERM here: 5 s, then the whole group
        head.wait(5)
    except subprocess.TimeoutExpired:
        os.killpg(head.pid, signal.SIGKILL)
        head.wait()


def test_up_status_down(ray_head, uid):
    up = raykv("up", f"--address={ray_head}", "--segment-size=128M",
               "--mooncake-host=127.0.0.1")
    assert "raykv is up" in up.stdout and "1 node actor(s)" in up.stdout
    again = raykv("up", f"--address={ray_head}", check=False)
    assert again.returncode != 0 and "already up" in again.stderr

    rank(ray_head, uid, "embedded")

    state = json.loads(raykv("status", f"--address={ray_head}", "--json").stdout)
    (node,) = state["nodes"].values()
    counters = node["pools"][f"p{uid}"]["counters"]
    assert counters["put_ok"] == 6 and counters["get_ok"] == 6
    assert f"cli-{uid}_" in state["deployments"]  # the key prefix of model cli/{uid}
    assert state["master"]["restarts"] == 0
    # one node, the head: its node actor stays, nothing leaves
    assert state["lifecycle"] == {"leaving": {}, "draining": {}, "reports": {}}
    # pools without a tenant: bounded by default, by half the node's memory
    assert node["untenanted"]["quota"] == untenanted_bound(None, False, node_memory_bytes())
    # the master and its metadata server listen on the address up was given, nowhere else
    master = state["master"]
    assert master["exposed"] == []
    assert {x.address for pid in (master["pid"], master["metadata_pid"])
            for x in listeners(pid)} == {"127.0.0.1"}
    table = raykv("status", f"--address={ray_head}").stdout
    assert "nodes and pools" in table and f"cli-{uid}" in table
    # Piped, at 80 columns: every figure whole (the 12-column table does not fit there).
    piped = raykv("status", f"--address={ray_head}", env={"COLUMNS": "80"}).stdout
    assert "…" not in piped, piped
    (node_id,) = state["nodes"]
    pool = node["pools"][f"p{uid}"]
    for whole in (f"node {node_id[:8]}: store 128 MiB", f"pool p{uid} (mha):",
                  f"pool MiB {pool['bytes'] / (1 << 20):.1f}", f"pages {pool['pages']}",
                  "put 6,", "got 6,"):
        assert whole in piped, (whole, piped)

    for restarts, pid in enumerate((master["pid"], master["metadata_pid"]), 1):
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while json.loads(raykv("status", f"--address={ray_head}", "--json").stdout
                         )["master"]["restarts"] < restarts:
            assert time.monotonic() < deadline, f"process {pid} was not restarted"
            time.sleep(1)

    assert "raykv is down" in raykv("down", f"--address={ray_head}").stdout
    gone = raykv("status", f"--address={ray_head}", check=False)
    assert gone.returncode != 0 and "not running" in gone.stderr
    assert not list(Path("/dev/shm").glob(f"raykv.*.p{uid}*"))


def test_up_standalone_then_down_stops_every_mooncake_client(ray_head, uid):
    up = raykv("up", f"--address={ray_head}", "--segment-size=64M", "--standalone",
               "--host-pool-size=16M", "--mooncake-host=127.0.0.1")
    assert "(standalone mode)" in up.stdout
    state = json.loads(raykv("status", f"--address={ray_head}", "--json").stdout)
    (node,) = state["nodes"].values()
    assert node["mode"] == "standalone" and node["host_pool_bytes"] == 16 << 20
    assert node["untenanted"]["quota"] is None  # host_pool_bytes bounds every pool here
    assert node["mooncake_client"]["alive"]
    cluster = SimpleNamespace(master_address=state["info"]["master_address"])
    assert running_clients(cluster) == {node["mooncake_client"]["pid"]}

    rank(ray_head, uid, "standalone")

    assert "raykv is down" in raykv("down", f"--address={ray_head}").stdout
    assert running_clients(cluster) == set()


def test_up_with_a_disk_tier_keeps_the_pages_over_down_and_up(ray_head, uid, tmp_path):
    """``raykv up --disk-dir --disk-size``: pages beyond the segment go to the node's disk
    slot, the seal key is made on the head node (0600), and after ``raykv down`` and
    ``raykv up`` on the same directory a new driver reads them back, each exact.
    Control: the pages that were only in memory are not read (the restart emptied it)."""
    disk = ["--segment-size=16M", "--mooncake-host=127.0.0.1", "--disk-size=256M"]
    raykv("up", f"--address={ray_head}", f"--disk-dir={tmp_path / 'a'}", *disk)
    rank(ray_head, uid, "put", DISK_RANK)
    state = json.loads(raykv("status", f"--address={ray_head}", "--json").stdout)
    (node,) = state["nodes"].values()
    assert node["tiers"]["used_bytes"] > 4 << 20, node["tiers"]  # a bucket reached the disk
    assert (tmp_path / "a" / "raykv-seal.key").stat().st_mode & 0o777 == 0o600
    assert "from disk" in raykv("status", f"--address={ray_head}").stdout
    raykv("down", f"--address={ray_head}")

    raykv("up", f"--address={ray_head}", f"--disk-dir={tmp_path / 'a'}", *disk)
    out = rank(ray_head, uid, "get", DISK_RANK)
    raykv("down", f"--address={ray_head}")
    found = int(out.split("pages read ")[1].split()[0])
    assert found >= 16, found  # the pages of two buckets at least
    assert found < 128, found  # CONTROL: pages only in memory are gone, so disk served


def test_down_with_nothing_running_says_so(ray_head, uid):
    """A mistyped namespace shows: `down` has nothing to stop, `status` finds nothing;
    each exits 1 with one line and no traceback."""
    down = raykv("down", f"--address={ray_head}", f"--namespace=typo-{uid}", check=False)
    status = raykv("status", f"--address={ray_head}", f"--namespace=typo-{uid}", check=False)
    for out in (down, status):
        assert out.returncode == 1, out.stderr
        assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1, \
            out.stderr
    assert f"nothing to stop: raykv is not running in namespace 'typo-{uid}'" in down.stderr
    assert f"raykv is not running in namespace 'typo-{uid}'" in status.stderr


class WatchInTerminal:
    """`raykv status --watch` in a pseudo-terminal of 50 x 200; a thread keeps reading
    everything it draws. ``frames()``: every frame drawn so far, each the text between
    two headers, escape sequences removed."""

    HEADER = "raykv status --watch:"
    ESCAPES = re.compile(r"\x1b(\[[0-9;?]*[ -/]*[@-~]|\][^\x07]*\x07|[()][0-9A-Za-z])")

    def __init__(self, *args: str) -> None:
        self._out, terminal = pty.openpty()
        fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 200, 0, 0))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "raykv.clusters.cli", "status", "--watch", *args],
            stdin=terminal, stdout=terminal, stderr=terminal, start_new_session=True,
            env=ENV | {"TERM": "xterm-256color", "COLUMNS": "200", "LINES": "50",
                       "PYTHONIOENCODING": "utf-8"})
        os.close(terminal)
        self._chunks: list[bytes] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        while True:
            try:
                chunk = os.read(self._out, 65536)
            except OSError:  # the terminal's other end closed: the process is gone
                return
            if not chunk:
                return
            self._chunks.append(chunk)

    def text(self) -> str:
        return self.ESCAPES.sub("", b"".join(self._chunks).decode(errors="replace"))

    def frames(self) -> list[str]:
        return [self.HEADER + part for part in self.text().split(self.HEADER)[1:]]

    def wait_for(self, ok, timeout_s: float = 90.0) -> list[str]:
        """Frames drawn until ``ok(frames)`` holds; fails after ``timeout_s`` (a guard
        against a hang, not a timing check) or if the process ended."""
        deadline = time.monotonic() + timeout_s
        while not ok(self.frames()):
            assert self.proc.poll() is None, self.text()[-3000:]
            assert time.monotonic() < deadline, self.text()[-3000:]
            time.sleep(0.1)
        return self.frames()

    def exit_code(self, timeout_s: float) -> int:
        """The process's exit code; a process still running after ``timeout_s`` fails
        the test with its threads' stacks (``py-spy dump``), to say where it hangs."""
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            spy = subprocess.run([str(Path(sys.executable).parent / "py-spy"), "dump",
                                  "--pid", str(self.proc.pid)],
                                 capture_output=True, text=True, timeout=60)
            raise AssertionError(f"no exit within {timeout_s} s:\n{spy.stdout}"
                                 f"{spy.stderr}\n{self.text()[-3000:]}") from None

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self._reader.join(5)
        os.close(self._out)


def node_row(frame: str, node: str) -> dict[str, str]:
    """The table row of ``node`` (first 8 characters of its id) in ``frame``, by
    column."""
    from raykv.clusters.status_watch import COLUMNS

    for line in frame.splitlines():
        cells = [c.strip() for c in line.split("\u2502")[1:-1]]
        if cells and cells[0] == node:
            assert len(cells) == len(COLUMNS), line
            return dict(zip(COLUMNS, cells, strict=True))
    raise AssertionError(f"no row for node {node} in:\n{frame}")


RATES = ("hits/s", "misses/s", "put", "get")
ZERO = {"hits/s": "0.0", "misses/s": "0.0", "put": "0 B/s", "get": "0 B/s"}


def test_status_watch_in_a_terminal_until_ctrl_c(ray_head, uid):
    """Also: the master on the ports `up` is given (as a firewall needs them)."""
    master_port, metadata_port = free_port(), free_port()
    raykv("up", f"--address={ray_head}", "--segment-size=128M", "--mooncake-host=127.0.0.1",
          f"--master-port={master_port}", f"--metadata-port={metadata_port}")
    view = None
    try:
        state = json.loads(raykv("status", f"--address={ray_head}", "--json").stdout)
        assert state["master"]["master_address"] == f"127.0.0.1:{master_port}"
        assert state["master"]["metadata_server"] == \
            f"http://127.0.0.1:{metadata_port}/metadata"
        (node_id,) = state["nodes"]
        node = node_id[:8]
        view = WatchInTerminal(f"--address={ray_head}", "--interval=0.5")

        # Control: frames with rates while nothing moves show every rate at zero.
        quiet = view.wait_for(lambda fs: len(fs) >= 4)
        rows = [node_row(f, node) for f in quiet]
        assert all(rows[0][r] == "-" for r in RATES), rows[0]  # no interval yet
        for row in rows[1:]:
            assert {r: row[r] for r in RATES} == ZERO, row
            assert (row["L3 hits"], row["misses"], row["pools"]) == ("0", "0", "0"), row
        seen = len(quiet)

        rank(ray_head, uid, "embedded")  # 6 objects put, 6 read back (MHA: K and V)

        frames = view.wait_for(lambda fs: node_row(fs[-1], node)["L3 hits"] == "6")
        moving = [node_row(f, node) for f in frames[seen:]]
        assert any(row["hits/s"] != "0.0" for row in moving), moving
        assert any(row["put"] != "0 B/s" for row in moving), moving
        assert any(row["get"] != "0 B/s" for row in moving), moving
        assert moving[-1]["pools"] == "1" and moving[-1]["hit rate"] == "100%", moving[-1]
        # And still again once the rank is done: the last frames' rates are zero.
        settled = view.wait_for(lambda fs: len(fs) >= len(frames) + 2)
        assert {r: node_row(settled[-1], node)[r] for r in RATES} == ZERO

        os.kill(view.proc.pid, signal.SIGINT)
        assert view.exit_code(90) == 0, view.text()[-3000:]
        assert "Traceback" not in view.text()
    finally:
        if view is not None:
            view.close()
        raykv("down", f"--address={ray_head}")
