"""The supervised master (`raykv up` on a real `ray start --head` cluster, a real
`mooncake_master`) after it died: a restart that fails (its RPC port held by another
socket) is tried again with back-off, `raykv status` says so (restarting, failed
attempts, last error), and once the port is free the master comes back. Then a rank that
wrote pages before makes data calls again: the old pages are gone (misses, never other
bytes) and new puts are stored and read back exact once the node's segment is mounted on
the new master; on two nodes (start_local), the same across nodes, and while the master
is down gets miss and puts fail per page. The supervisor itself killed, Ray restarts it
and its master comes back on the same ports. Before the fix the supervisor's thread died
with the first failed restart: L3 stayed down for good and `status` went on saying
nothing; and a restart counted as done while another process held the master's port (a
socket accepting there was taken for the master's own); a restarted supervisor picked
new ports, which no node actor knew."""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import ray
import torch
from raykv import StorageConfig, local_settings, start_local
from raykv.clusters.mooncake_master import MooncakeMaster

from tests.integration.processes import wait_for
from tests.integration.ranks import indices, start_rank
from tests.integration.test_cli_cluster import ENV, ROOT, ray_head, raykv  # noqa: F401
from tests.integration.test_cli_cluster import rank as run_rank

WAIT_S = 120.0


def master_state(address: str) -> dict | None:
    """The master entry of `raykv status --json`; None while status fails (the master
    supervisor being restarted by Ray)."""
    out = raykv("status", f"--address={address}", "--json", check=False)
    return json.loads(out.stdout)["master"] if out.returncode == 0 else None


def wait_master(address: str, done, what: str) -> dict:
    """Poll `raykv status --json` until ``done(master)``; that master entry."""
    deadline = time.monotonic() + WAIT_S
    while (master := master_state(address)) is None or not done(master):
        assert time.monotonic() < deadline, f"{what}: {master}"
        time.sleep(1)
    return master


def parent(pid: int) -> int:
    """The parent process of ``pid`` (``/proc/<pid>/stat``)."""
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def hold(host: str, port: int) -> socket.socket:
    """A socket listening on ``host:port`` as soon as the dead master's socket is gone
    (``SO_REUSEADDR``, as the master's own: its closed connections may linger there in
    TIME_WAIT; a port still listened on is refused all the same)."""
    deadline = time.monotonic() + 10
    while True:
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
            s.listen()
            return s
        except OSError:
            s.close()
            assert time.monotonic() < deadline, f"port {port} stayed taken"
            time.sleep(0.01)


def test_master_restart_is_retried_and_data_calls_work_after(ray_head, uid):  # noqa: F811
    raykv("up", f"--address={ray_head}", "--segment-size=128M", "--mooncake-host=127.0.0.1")
    rank = subprocess.Popen(
        [sys.executable, "-m", "tests.integration.master_restart_rank", ray_head, uid],
        cwd=ROOT, env=ENV, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True)
    try:
        assert rank.stdout.readline().strip() == "written", rank.stderr.read()[-3000:]
        master = wait_master(ray_head, lambda m: True, "raykv status did not answer")
        assert master["restarts"] == 0, master
        host, _, port = master["master_address"].rpartition(":")
        os.kill(master["pid"], signal.SIGKILL)
        held = hold(host, int(port))
        try:
            down = wait_master(ray_head, lambda m: m.get("attempts", 0) >= 2,
                               "the supervisor did not try the restart again")
            assert down["state"] == "restarting" and down["restarts"] == 0
            assert "did not restart" in down["last_error"]
            shown = raykv("status", f"--address={ray_head}", env={"COLUMNS": "200"}).stdout
            assert "mooncake_master is down, restarting" in shown, shown
        finally:
            held.close()
        up = wait_master(ray_head, lambda m: m.get("state") == "running",
                         "the master did not come back once its port was free")
        assert up["restarts"] == 1 and up["attempts"] == 0 and up["pid"] != master["pid"]

        rank.stdin.write("go\n")
        rank.stdin.flush()
        seen = json.loads(rank.stdout.readline() or "null")
        assert seen is not None, rank.stderr.read()[-3000:]
        # the old pages are gone with the master's metadata: misses, never other bytes
        assert seen["old_got"] == [False] * 4 and seen["old_wrong"] == 0, seen
        # new puts are stored again, and read back exact
        assert seen["new_got"] == [True] * 4 and seen["new_wrong"] == 0, seen
        assert rank.wait(60) == 0, rank.stderr.read()[-3000:]

        # The supervisor itself dies, its master with it: Ray restarts the supervisor, and
        # its master listens on the ports it recorded, so the node actors reach it again.
        # Before, the restarted supervisor picked free ports anew: L3 was gone for good.
        os.kill(parent(up["pid"]), signal.SIGKILL)
        again = wait_master(ray_head, lambda m: m["pid"] not in (None, up["pid"]),
                            "the supervisor was not restarted with a master")
        assert (again["master_address"], again["metadata_server"]) == (
            up["master_address"], up["metadata_server"]), (again, up)
        run_rank(ray_head, f"{uid}b", "embedded")  # a round trip through the node actor
    finally:
        if rank.poll() is None:
            rank.kill()
            rank.wait()
        raykv("down", f"--address={ray_head}")


def test_a_port_held_by_another_process_is_not_taken_for_the_masters():
    """What the supervisor's restart relies on, alone: the master killed (its metadata
    server kept) and its RPC port held, each restart fails and leaves nothing running.
    Before, a restart took the held socket for the master's own as soon as the new
    master's metrics port was up, and returned while that master was exiting (it could
    not bind): the supervisor counted a restart, and then another."""
    master = MooncakeMaster("127.0.0.1").start()
    try:
        os.kill(master.proc.pid, signal.SIGKILL)
        master.proc.wait()
        held = hold(master.host, master.rpc_port)
        try:
            for _ in range(5):
                with pytest.raises(RuntimeError, match="did not restart"):
                    master.restart()
                assert not master.alive()
        finally:
            held.close()
        master.restart()
        assert master.alive()
    finally:
        master.stop()


def test_after_a_master_restart_another_node_reads_new_pages_exact(uid):
    """Two nodes (embedded): the master and its metadata server both killed (meanwhile
    gets miss and puts fail, per page) and started again on the same ports
    (``MooncakeMaster.restart``, what the supervisor runs). A
    rank on the other node misses the pages written before (never other bytes) and
    reads the pages put after exact, across nodes: both nodes' segments are mounted on
    the new master and their transfer descriptors are in the new metadata server."""
    with start_local(settings=local_settings(global_segment_size=64 << 20), num_nodes=2) as cluster:
        # a put while the master is down waits out the Mooncake client's own retries
        # (seconds on a loaded machine): a deadline well past them, so each page answers
        config = StorageConfig(model_name=f"restart/{uid}", extra_config={"timeout_s": 60})
        writer = start_rank(cluster.node_ids[0], config, pool_name=f"w{uid}")
        reader = start_rank(cluster.node_ids[1], config, pool_name=f"r{uid}")
        ray.get([writer.fill.remote(1), reader.fill.remote(2)])
        old, new = ([f"{uid}-{what}-{i}" for i in range(4)] for what in ("old", "new"))
        assert ray.get(writer.call.remote("batch_set_v1", old, indices(0, 4))) == [True] * 4
        assert ray.get(reader.call.remote("batch_get_v1", old, indices(32, 4))) == [True] * 4
        assert torch.equal(ray.get(reader.pages.remote(32, 4)),
                           ray.get(writer.pages.remote(0, 4)))

        master = cluster.master
        for proc in (master.proc, master.metadata_proc):
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        before = ray.get(reader.pages.remote(48, 4))
        # while it is down: gets miss, puts fail, per page; nothing is written
        assert ray.get(reader.call.remote("batch_get_v1", old, indices(48, 4))) == [False] * 4
        assert ray.get(writer.call.remote("batch_set_v1", new, indices(16, 4))) == [False] * 4
        assert torch.equal(ray.get(reader.pages.remote(48, 4)), before)
        master.restart()

        got = ray.get(reader.call.remote("batch_get_v1", old, indices(48, 4)))
        assert got == [False] * 4  # the old pages are gone with the master's index
        assert torch.equal(ray.get(reader.pages.remote(48, 4)), before)  # nothing written
        wait_for(lambda: ray.get(writer.call.remote("batch_set_v1", new, indices(16, 4)))
                 == [True] * 4, "puts stored on the restarted master", WAIT_S)
        wait_for(lambda: ray.get(reader.call.remote("batch_get_v1", new, indices(48, 4)))
                 == [True] * 4, "the new pages read from the other node", WAIT_S)
        assert torch.equal(ray.get(reader.pages.remote(48, 4)),
                           ray.get(writer.pages.remote(16, 4)))
