"""Emulated hosts: a multi-host raykv cluster on one machine, each host a network
namespace with an address of its own and a shaped link (``EmulatedHosts``), started by
``start_hosts(N, link=RATE)`` or ``raykv emulate-hosts N --link RATE``.

The plan (names, addresses, commands) is ``lab.host_plan``; this module runs it
with ``ip`` and ``tc`` (root only), starts one Ray node per host (``ray start
--node-ip-address`` inside the host's namespace; host 0, this machine's own namespace,
runs the head, the master and the driver), and removes every process, namespace, link
and bridge again: ``shutdown`` after a normal exit, ``clean`` (``raykv clean-hosts``)
after a driver was killed. What it shows and cannot show: docs/deploy.md, *Emulated
hosts*.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from raykv.cache_actors.local_ports import free_port
from raykv.cache_actors.processes import ProcessIdentity
from raykv.cache_actors.ray_auth_mode import use_mode
from raykv.clusters.local import LOCAL_DEFAULTS, LocalCluster, launch, per_node_sizes
from raykv.clusters.node_lifecycle import LifecycleSettings
from raykv.controllers.naming import NAMESPACE
from raykv.controllers.node_settings import NodeSettings
from raykv.controllers.pool_layout import MiB
from raykv_lab.host_plan import NAME_PREFIX, HostPlan, choose_index, index_of, parse_rate

log = logging.getLogger(__name__)

WORKDIR = "/tmp/raykv-hosts-{index}"
"""Each emulated cluster's folder: Ray's temp dir, logs and ``hosts.json``."""
HEALTH_CHECKS = {"health_check_period_ms": 1000, "health_check_failure_threshold": 30,
                 "health_check_initial_delay_ms": 0}
"""Ray declares a host dead after ~30 s unanswered: a link down for 20 s is survived."""
START_S = 180.0
SLOW_START = {"RAY_agent_register_timeout_ms": "300000",
              "RAY_worker_register_timeout_seconds": "300"}
"""A raylet whose agents or workers take long to start on a loaded machine (several
hosts starting at once) waits for them instead of exiting."""
JOIN_ATTEMPTS = 3
"""Starts of the hosts' Ray that ``join_ray`` tries before it gives up."""


def check_root() -> None:
    """``PermissionError`` unless this process can build namespaces and shape links."""
    if os.geteuid() != 0:
        raise PermissionError("emulated hosts need root: network namespaces, veth links, "
                              "bridges and tc shaping are root's (run as root, or use "
                              "start_local without hosts)")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise FileNotFoundError(f"emulated hosts need `{tool}` (iproute2)")


def _run(cmd: list[str], check: bool = True) -> subprocess.CompletedProcess:
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if check and out.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd)}` failed: {out.stderr.strip()}")
    return out


@dataclass(frozen=True)
class HostsRecord:
    """``hosts.json``: what ``clean`` needs to tell a live cluster from a leftover."""

    index: int
    hosts: int
    driver_pid: int
    driver_start: int
    cluster_tag: str = ""


class EmulatedHosts:
    """The network and Ray nodes of one emulated cluster (``HostPlan``). Host 0 is this
    machine's namespace; ``address(h)`` is host ``h``'s IP, ``node_ids[h]`` its Ray
    node once ``start_ray`` ran. The ``RayNodes`` of ``start_hosts``' cluster
    (``master_host``, ``join``, ``shutdown``), each host a Ray node of ``num_cpus``
    logical CPUs and ``object_store_memory`` bytes of object store."""

    def __init__(self, plan: HostPlan, num_cpus: int = 2,
                 object_store_memory: int = 256 * MiB) -> None:
        self.plan = plan
        self.workdir = Path(WORKDIR.format(index=plan.index))
        self.node_ids: list[str] = []
        self.gcs_address = ""
        self.num_cpus = num_cpus
        self.object_store_memory = object_store_memory

    @classmethod
    def create(cls, hosts: int, link: str | None = None, num_cpus: int = 2,
               object_store_memory: int = 256 * MiB) -> EmulatedHosts:
        """Build the network of ``hosts`` hosts on a free subnet, each link shaped to
        ``link`` (``10gbit``; None: not shaped). ``PermissionError`` without root,
        ``ValueError`` for a bad count or rate; on any failure what was built is removed."""
        rate = None if link is None else parse_rate(link)
        HostPlan(0, hosts, rate)  # checks before anything is made
        check_root()
        taken = set(_run(["ip", "-o", "link", "show"]).stdout.split())
        taken |= {n.rstrip(":").split("@")[0] for n in taken}
        taken |= {f"{NAME_PREFIX}{index_of(n)}" for n in _netns() if index_of(n) is not None}
        taken |= {f"{NAME_PREFIX}{p.name.rsplit('-', 1)[1]}"
                  for p in Path("/tmp").glob("raykv-hosts-*")}
        used = re.findall(r"inet (\S+)", _run(["ip", "-4", "-o", "addr", "show"]).stdout)
        used += [line.split()[0] for line in _run(["ip", "-4", "route", "show"]).stdout
                 .splitlines() if line and not line.startswith("default")]
        self = cls(HostPlan(choose_index(taken, used), hosts, rate), num_cpus,
                   object_store_memory)
        self.workdir.mkdir(mode=0o700)
        self._record("")
        try:
            for cmd in self.plan.setup_commands():
                _run(cmd)
        except BaseException:
            self.shutdown()
            raise
        return self

    def address(self, host: int) -> str:
        return self.plan.address(host)

    @property
    def master_host(self) -> str:
        """Host 0's address: the master and its metadata server bind it."""
        return self.address(0)

    def join(self, cluster_tag: str, namespace: str, log_to_driver: bool) -> list[str]:
        """Record the raykv cluster's tag, start the hosts' Ray and join it as a driver
        (``join_ray``); returns the node ids, host 0's first (``map_nodes``)."""
        import ray

        self.set_cluster_tag(cluster_tag)
        self.join_ray(self.num_cpus, self.object_store_memory, namespace=namespace,
                      log_to_driver=log_to_driver)
        return self.map_nodes(ray.nodes())

    def host_of(self, node_id: str) -> int:
        """The host a Ray node runs on."""
        return self.node_ids.index(node_id)

    def _record(self, cluster_tag: str) -> None:
        me = ProcessIdentity.current()
        record = HostsRecord(self.plan.index, self.plan.hosts, me.pid, me.start_ticks,
                             cluster_tag)
        (self.workdir / "hosts.json").write_text(json.dumps(asdict(record)))

    def set_cluster_tag(self, cluster_tag: str) -> None:
        """Record the raykv cluster's tag, so ``clean`` removes its shared memory too."""
        self._record(cluster_tag)

    # ------------------------------------------------------------------ faults
    def link_down(self, host: int) -> None:
        """Cut host ``host``'s link (both ends): nothing passes until ``link_up``."""
        for cmd in self.plan.link_commands(host, up=False):
            _run(cmd)

    def link_up(self, host: int) -> None:
        for cmd in self.plan.link_commands(host, up=True):
            _run(cmd)

    def set_rate(self, host: int, link: str | None) -> None:
        """Shape host ``host``'s link to ``link`` (``100mbit``) from now on; None: not
        shaped from now on (``RuntimeError`` if it was not shaped)."""
        cmds = (self.plan.unshape_commands(host) if link is None
                else self.plan.shape_commands(host, parse_rate(link)))
        for cmd in cmds:
            _run(cmd)

    # ------------------------------------------------------------------ Ray
    def ray_env(self) -> dict[str, str]:
        """The environment of every Ray process of the hosts: this one's, without an
        inherited Mooncake bind address or Ray address, with Ray's auth mode (token
        unless ``RAY_AUTH_MODE`` says otherwise: the driver joins with the same)."""
        env = {k: v for k, v in os.environ.items()
               if k not in ("MC_TCP_BIND_ADDRESS", "RAY_ADDRESS")}
        return env | {"RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "token"),
                      "RAY_USAGE_STATS_ENABLED": "0", **SLOW_START}

    def join_auth_mode(self) -> None:
        """Give this process the hosts' Ray auth mode before it joins them (as a
        ``ray.init`` that starts a cluster does for its own)."""
        use_mode(self.ray_env()["RAY_AUTH_MODE"])

    def join_ray(self, num_cpus: int, object_store_memory: int, **init_args) -> None:
        """Start Ray on the hosts (``start_ray``) and connect this process to it as a
        driver on host 0 (``ray.init(**init_args)``). If the driver cannot connect
        although every node started (``ConnectionError``: seen once, on a loaded
        machine), the hosts' Ray is stopped (``stop_ray``) and started again, up to
        ``JOIN_ATTEMPTS`` times in all; then ``RuntimeError`` naming the cause and the
        tail of the head's raylet log."""
        import ray

        for attempt in range(JOIN_ATTEMPTS):
            address = self.start_ray(num_cpus, object_store_memory)
            self.join_auth_mode()
            try:
                ray.init(address=address, _node_ip_address=self.address(0), **init_args)
                return
            except ConnectionError as e:
                cause = f"{e} ({e.__cause__!r})"
                raylet = self.workdir / "ray" / "session_latest" / "logs" / "raylet.out"
                tail = raylet.read_text(errors="replace")[-2000:] if raylet.exists() else ""
                log.warning("joining the emulated hosts' Ray failed (attempt %d of %d): %s",
                            attempt + 1, JOIN_ATTEMPTS, cause)
                ray.shutdown()
                self.stop_ray()
        raise RuntimeError(f"could not join the emulated hosts' Ray at {address}: {cause}; "
                           f"the head's raylet log ends:\n{tail}")

    def stop_ray(self) -> None:
        """Kill the hosts' Ray: every process in another host's namespace, those on host
        0 whose command line or open files name the hosts' Ray folder, and all their
        descendants, again while any is found (a raylet starts workers until it dies),
        three rounds at most. The network, the master and this process (which has Ray's
        files open as a driver, and the master as a child) stay."""
        folder = str(self.workdir / "ray")
        for _ in range(3):
            pids: set[int] = set()
            for h in range(1, self.plan.hosts):
                pids |= _netns_pids(self.plan.netns(h))
            pids |= {int(p) for p in os.listdir("/proc")
                     if p.isdigit() and _names_cluster(int(p), folder, None)}
            pids = _with_descendants(_not_mine(pids))
            if not pids:
                return
            _kill(pids)

    def start_ray(self, num_cpus: int, object_store_memory: int, attempts: int = 3) -> str:
        """One Ray node per host (the head on host 0); returns the GCS address once every
        node started (``lab.ray_start``: Ray's ``ray start``, patient). A node that
        fails to start is started again, after its processes are killed, up to
        ``attempts`` times; then ``RuntimeError`` with its log's tail."""
        env = self.ray_env()
        head = self.address(0)
        port = free_port(head)
        common = ["--temp-dir", str(self.workdir / "ray"), f"--num-cpus={num_cpus}",
                  f"--object-store-memory={object_store_memory}", "--disable-usage-stats"]
        head_cmd = ["--head", f"--node-ip-address={head}", f"--port={port}",
                    "--include-dashboard=false", f"--ray-client-server-port={free_port(head)}",
                    f"--system-config={json.dumps(HEALTH_CHECKS)}"]
        self.gcs_address = f"{head}:{port}"
        self._start_nodes({0: head_cmd + common + self._agent_ports(0)}, env, attempts)
        self._start_nodes({h: [f"--address={self.gcs_address}",
                               f"--node-ip-address={self.address(h)}", *common,
                               *self._agent_ports(h)]
                           for h in range(1, self.plan.hosts)}, env, attempts)
        return self.gcs_address

    def _agent_ports(self, host: int) -> list[str]:
        """Ports of a node's agents, given: with ports of 0 the raylet waits a fixed
        time for the agents to write theirs to files, and exits when a loaded machine
        makes it wait longer. Free here (host 0) or in an empty namespace."""
        return [f"--{name}={free_port(self.address(0))}" for name in (
            "dashboard-agent-listen-port", "dashboard-agent-grpc-port",
            "runtime-env-agent-port", "metrics-export-port")]

    def _start_nodes(self, todo: dict[int, list[str]], env: dict, attempts: int) -> None:
        failed: list[int] = []
        for attempt in range(attempts):
            starts = {h: self._ray_start(h, args, env, attempt) for h, args in todo.items()}
            for proc in starts.values():
                proc.wait(START_S + 60)
            failed = [h for h in starts if not self._started(h, attempt)]
            if not failed:
                return
            log.warning("ray start failed on emulated host(s) %s (attempt %d)", failed,
                        attempt + 1)
            for h in failed:  # the head's processes are all there are before the others
                ns = self.plan.netns(h)
                _kill(cluster_pids(self.plan.index) if ns is None else _netns_pids(ns))
            todo = {h: todo[h] for h in failed}
        log_text = self._log(failed[0], attempts - 1).read_text(errors="replace")
        raise RuntimeError(f"ray start on emulated host {failed[0]} "
                           f"({self.address(failed[0])}) failed:\n{log_text[-2000:]}")

    def _log(self, host: int, attempt: int) -> Path:
        return self.workdir / f"ray-start-{host}.{attempt}.log"

    def _ray_start(self, host: int, args: list[str], env: dict, attempt: int
                   ) -> subprocess.Popen:
        with open(self._log(host, attempt), "wb") as out:
            return subprocess.Popen(
                [*self.plan.exec_prefix(host), sys.executable, "-m", "raykv_lab.ray_start",
                 "start", *args], env=env, stdout=out, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True)

    def _started(self, host: int, attempt: int) -> bool:
        return "Ray runtime started" in self._log(host, attempt).read_text(errors="replace")

    def map_nodes(self, nodes: list[dict]) -> list[str]:
        """Fill ``node_ids`` from ``ray.nodes()``: host h's node is the alive one at its
        address. ``RuntimeError`` if a host has none."""
        by_ip = {n["NodeManagerAddress"]: n["NodeID"] for n in nodes if n["Alive"]}
        missing = [self.address(h) for h in range(self.plan.hosts)
                   if self.address(h) not in by_ip]
        if missing:
            raise RuntimeError(f"no Ray node at {', '.join(missing)}")
        self.node_ids = [by_ip[self.address(h)] for h in range(self.plan.hosts)]
        return self.node_ids

    # ------------------------------------------------------------------ removal
    def shutdown(self) -> None:
        """Kill every process of the hosts, remove namespaces, links, bridge and the
        work folder. Idempotent; each step runs even if one before failed."""
        remove_cluster(self.plan.index)


def start_hosts(hosts: int, settings: NodeSettings | None = None, *, link: str | None = None,
                segment_sizes: Sequence[int] | None = None, cpus_per_node: int = 2,
                object_store_memory: int = 256 * MiB, namespace: str = NAMESPACE,
                master_args: Sequence[str] = (), reconcile_period_s: float = 1.0,
                log_to_driver: bool = True,
                lifecycle: LifecycleSettings | None = None) -> LocalCluster:
    """A raykv cluster on ``hosts`` emulated hosts (root only): each host a Ray node in a
    network namespace of its own with its own address (host 0, the head, in this
    machine's namespace, with the master, its metadata server and this driver), every
    node's Mooncake bound to its host's address (``settings.local_hostname`` must stay
    None), each host's link shaped to ``link`` (``10gbit``; None: not shaped). The other
    arguments are ``start_local``'s. Ray declares a host dead after ~30 s unanswered.
    The cluster's ``ray_nodes`` is the ``EmulatedHosts``: it takes links down and up and
    changes their rates; ``shutdown`` removes every process, namespace, link and bridge
    (after a crash of this process: ``raykv clean-hosts``)."""
    import ray

    if ray.is_initialized():
        raise RuntimeError("Ray is already initialised in this process; start_hosts starts "
                           "its own Ray (call ray.shutdown() first)")
    settings = settings or LOCAL_DEFAULTS
    if settings.local_hostname is not None:
        raise ValueError("on emulated hosts every node's Mooncake binds its host's address "
                         "(local_hostname None)")
    sizes = per_node_sizes(settings, segment_sizes, hosts)
    network = EmulatedHosts.create(hosts, link, cpus_per_node, object_store_memory)
    return launch(network, settings, sizes, namespace=namespace, master_args=master_args,
                  reconcile_period_s=reconcile_period_s, log_to_driver=log_to_driver,
                  lifecycle=lifecycle)


def _netns() -> list[str]:
    out = _run(["ip", "netns", "list"], check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _links() -> list[str]:
    """The names of this namespace's network links."""
    out = _run(["ip", "-o", "link", "show"], check=False).stdout
    return [line.split(":")[1].strip().split("@")[0] for line in out.splitlines()
            if line.count(":") >= 2]


def _netns_pids(ns: str) -> set[int]:
    return {int(p) for p in _run(["ip", "netns", "pids", ns], check=False).stdout.split()}


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                kids.setdefault(ppid, []).append(int(entry))
    return kids


def _names_cluster(pid: int, workdir: str, subnet: re.Pattern | None) -> bool:
    """True if process ``pid``'s command line names the cluster's folder or subnet (if
    given), or it holds a file of the folder open."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        if workdir in cmdline or (subnet is not None and subnet.search(cmdline)):
            return True
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/{pid}/fd/{fd}").startswith(workdir + "/"):
                    return True
    except OSError:
        return False
    return False


def cluster_pids(index: int) -> set[int]:
    """Every process of emulated cluster ``index``: those in its namespaces, those whose
    command line names its folder or subnet or that hold a file of the folder open, and
    all their descendants; never this process or its ancestors."""
    plan = HostPlan(index, 1)
    workdir = WORKDIR.format(index=index)
    net = str(plan.subnet.network_address).rsplit(".", 1)[0]
    subnet = re.compile(re.escape(net + ".") + r"\d")
    found = set()
    for ns in _netns():
        if index_of(ns) == index:
            found |= _netns_pids(ns)
    found |= {int(p) for p in os.listdir("/proc")
              if p.isdigit() and _names_cluster(int(p), workdir, subnet)}
    return _not_mine(_with_descendants(found))


def _with_descendants(pids: set[int]) -> set[int]:
    found, kids, todo = set(pids), _children(), list(pids)
    while todo:
        for kid in kids.get(todo.pop(), []):
            if kid not in found:
                found.add(kid)
                todo.append(kid)
    return found


def _not_mine(pids: set[int]) -> set[int]:
    """``pids`` without this process and its ancestors."""
    mine, pid = set(), os.getpid()
    while pid > 1:
        mine.add(pid)
        try:
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rsplit(")", 1)[1].split()[1])
        except OSError:
            break
    return pids - mine


def _kill(pids: set[int], timeout_s: float = 5.0) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + timeout_s
        while pids and time.monotonic() < deadline:
            pids = {p for p in pids if ProcessIdentity.of(p) is not None
                    and ProcessIdentity.of(p).alive()}
            time.sleep(0.1)


def remove_cluster(index: int) -> list[str]:
    """Remove emulated cluster ``index`` whole: its processes (twice: Ray restarts what
    dies), its shared-memory files, namespaces, links, bridge and folder. Returns what
    was removed, as lines."""
    from raykv.cache_actors.shared_memory import remove_shm_files
    from raykv.controllers.naming import cluster_shm_prefix

    removed = []
    for _ in range(2):
        pids = cluster_pids(index)
        _kill(pids)
        removed += [f"process {p}" for p in sorted(pids)]
    workdir = Path(WORKDIR.format(index=index))
    with contextlib.suppress(OSError, ValueError, KeyError):
        tag = json.loads((workdir / "hosts.json").read_text())["cluster_tag"]
        if tag:
            removed += [f"/dev/shm/{n}" for n in remove_shm_files(cluster_shm_prefix(tag))]
    bridge = f"{NAME_PREFIX}{index}"
    # each host's link first: deleting one end of a veth pair deletes both at once, where
    # a deleted namespace's veth goes some time after ``ip netns del`` returned
    for link in _links():
        if link.startswith(f"{bridge}-") and \
                _run(["ip", "link", "del", link], check=False).returncode == 0:
            removed.append(f"link {link}")
    for ns in _netns():
        if index_of(ns) == index:
            _run(["ip", "netns", "del", ns], check=False)
            removed.append(f"namespace {ns}")
    if _run(["ip", "link", "del", bridge], check=False).returncode == 0:
        removed.append(f"bridge {bridge}")
    if workdir.exists():
        shutil.rmtree(workdir, ignore_errors=True)
        removed.append(str(workdir))
    return removed


def leftovers() -> dict[int, bool]:
    """Emulated clusters on this machine: index -> whether its driver still runs."""
    found = {index_of(n) for n in _netns()} | {index_of(n) for n in _links()}
    found |= {int(p.name.rsplit("-", 1)[1]) for p in Path("/tmp").glob("raykv-hosts-*")
              if p.name.rsplit("-", 1)[1].isdigit()}
    out = {}
    for index in sorted(i for i in found if i is not None):
        alive = False
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            rec = HostsRecord(**json.loads(
                Path(WORKDIR.format(index=index), "hosts.json").read_text()))
            alive = ProcessIdentity(rec.driver_pid, rec.driver_start).alive()
        out[index] = alive
    return out


def clean(force: bool = False) -> list[str]:
    """Remove every emulated cluster whose driver is gone (``force``: every one, also
    live ones). Returns what was removed, as lines. ``PermissionError`` without root."""
    check_root()
    removed = []
    for index, alive in leftovers().items():
        if force or not alive:
            removed += remove_cluster(index)
    return removed
