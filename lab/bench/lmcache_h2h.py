"""Head to head with LMCache 0.5.6 on vLLM: a fresh engine's first-token latency when
it restores a prefix another engine computed, on the same node (raykv's L2 against
LMCache's local CPU tier, its server's L1) and on another node (raykv's L3 against
LMCache's remote path).

Run: ``python -m raykv_lab.bench.lmcache_h2h --lmcache-python PY [--rounds 4]
[--tokens 4096] [--tail 0] [--out DIR]`` (a two-node embedded cluster of its own; Ray
must not be running in this process; ~10 minutes on 2 cores). ``PY`` is the Python
of a virtual environment that has vLLM and ``lmcache==0.5.6`` installed (raykv never
imports LMCache: its engines and servers run as processes of ``PY``, the engines
through the script ``lmcache_engine.py`` next to this module).

Engines (vLLM CPU build, in-process, eager, one OMP thread,
``VLLM_CPU_OMP_THREADS_BIND=nobind``, the 8-layer width-512 random Llama of
``l2_reuse``, 128-token blocks, vLLM's prefix cache off unless said):

- raykv (Ray actors, one deployment, ``l2_blocks``): E on node 0 (prefix cache on)
  computes each prompt, then restores it from its own prefix cache
  (``own_prefix_cache``, the reference); F on node 0 restores it from the node's L2
  (``same_node``); G on node 1 from L3 (``cross_node``: node 1's L2 misses, its node
  actor reads node 0's Mooncake segment, where the placement put the blocks);
- LMCache (processes of ``PY``, ``LMCacheMPConnector``): two multiprocess servers, one
  per node (256-token chunks, 1 GB of L1 each), both with LMCache's ``fs`` L2 adapter on
  one shared folder of this machine's tmpfs (its remote path here: see
  ``REMOTE_PATH``); A on server 0 computes; B on server 0 restores from server 0's L1
  (``same_node``); C on server 1 from the shared L2 (``cross_node``).

Per round a fresh prompt of ``tokens`` random ids (a multiple of LMCache's 256-token
chunk) and ``tail`` more, 8 greedy tokens. vLLM computes at least a prompt's last token:
with ``tail`` 0 both load ``tokens - 1`` (the last whole block or chunk loaded, its
last token computed again) and compute 1 (vLLM's own prefix cache computes the last
128); with ``tail`` 1 both load ``tokens`` and compute 1. The sides alternate which
goes first (raykv first in even rounds). Before the cross-node restore each side's
remote copy is complete: node 0's L2 has no dirty page left (write-behind done),
LMCache's L2 folder holds every chunk.
Per case: TTFT (vLLM's ``first_token_latency``), ``cached`` (tokens the engine
loaded), whether its greedy tokens equal E's restore from its own prefix cache and
E's cold run; per round the ratios raykv / LMCache. LMCache's processes run at the
nice value of raykv's node actors (Ray's workers are niced; at another priority a
loaded machine would favour one side). Writes ``lmcache_h2h.json`` and the LMCache
processes' logs to ``--out``. Numbers only: nothing asserts a speed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import select
import statistics
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

CHUNK = 256  # LMCache's chunk: it stores full chunks only
OUTPUT = 8
SIDES = ("raykv", "lmcache")
CASES = ("same_node", "cross_node")
ENGINE = dict(max_model_len=8192, kv_cache_memory_bytes=256 << 20, max_num_seqs=1)
START_S = 600.0  # deadline of an engine's or server's start
ASK_S = 300.0  # deadline of one request
SETTLE_S = 30.0  # deadline of a side's remote copy
REMOTE_PATH = (
    "LMCache 0.5.6's remote tiers are its server's L2 adapters. mooncake_store needs "
    "LMCache's C++ Mooncake extension (lmcache.lmcache_mooncake), which the PyPI wheel "
    "does not ship; p2p (reading a peer server's L1) needs an LMCache coordinator and a "
    "NIXL or Mooncake transfer channel; the others need an outside service (Redis, S3, "
    "Bigtable, ...) or hardware (DAX, GDS, 3FS). So the remote path here is the fs "
    "adapter on a folder both servers share (tmpfs: no disk, its best case).")
LMCACHE_ENV = {"LMCACHE_TRACK_USAGE": "false", "LMCACHE_DISABLE_BANNER": "1",
               "OMP_NUM_THREADS": "1"}


# ------------------------------------------------------------------- pure parts
def check_tokens(tokens: int) -> int:
    """``tokens`` if it is a positive multiple of ``CHUNK``, else ``ValueError``."""
    if tokens <= 0 or tokens % CHUNK:
        raise ValueError(f"--tokens must be a positive multiple of {CHUNK} (LMCache "
                         f"stores full {CHUNK}-token chunks only), got {tokens}")
    return tokens


def side_order(round_: int) -> tuple[str, ...]:
    """Which side runs first in round ``round_``: raykv in even rounds."""
    return SIDES if round_ % 2 == 0 else SIDES[::-1]


def server_args(port: int, l2_folder: str) -> list[str]:
    """Arguments of LMCache's multiprocess server (after ``python``) on ``port`` with
    its ``fs`` L2 adapter on ``l2_folder``."""
    return ["-m", "lmcache.v1.multiprocess.server", "--host", "127.0.0.1",
            "--port", str(port), "--chunk-size", str(CHUNK), "--l1-size-gb", "1",
            "--eviction-policy", "LRU", "--supported-transfer-mode", "auto",
            "--disable-metrics",
            "--l2-adapter", json.dumps({"type": "fs", "base_path": l2_folder})]


def parse_answer(line: str) -> dict | None:
    """The JSON of a ``RESULT <json>`` line of ``lmcache_engine.py``; None for any
    other line (vLLM's own output)."""
    return json.loads(line[len("RESULT "):]) if line.startswith("RESULT ") else None


def case_row(res: dict, own: dict, cold: dict) -> dict:
    """One restore ``res`` (``generate``'s answer) against E's own-prefix-cache restore
    ``own`` and its cold run ``cold``: TTFT in ms, tokens loaded, same tokens."""
    return {"ttft_ms": 1000 * res["ttft_s"], "cached": res["cached"],
            "same_tokens_as_own": res["tokens"] == own["tokens"],
            "same_tokens_as_cold": res["tokens"] == cold["tokens"]}


def round_ratios(row: dict) -> dict[str, float]:
    """Per case raykv's TTFT over LMCache's in one round's ``row``."""
    return {c: row["raykv"][c]["ttft_ms"] / row["lmcache"][c]["ttft_ms"] for c in CASES}


def summary(rows: Sequence[dict]) -> dict:
    """Over every round: per side and case the median TTFT (ms) and tokens loaded; per
    case the median, min and max of the rounds' ratios; how many restores had the
    reference's tokens."""
    out: dict = {}
    for side in SIDES:
        for case in CASES:
            cases = [r[side][case] for r in rows]
            out[f"{side}_{case}"] = {
                "ttft_ms_median": statistics.median(c["ttft_ms"] for c in cases),
                "cached": sorted({c["cached"] for c in cases}),
                "same_tokens_as_own": f"{sum(c['same_tokens_as_own'] for c in cases)}"
                                      f"/{len(cases)}",
                "same_tokens_as_cold": f"{sum(c['same_tokens_as_cold'] for c in cases)}"
                                       f"/{len(cases)}"}
    for case in CASES:
        ratios = [r["ratios"][case] for r in rows]
        out[f"ratio_{case}"] = {"median": statistics.median(ratios), "min": min(ratios),
                                "max": max(ratios)}
    out["own_prefix_cache_ttft_ms_median"] = statistics.median(
        r["own_prefix_cache"]["ttft_ms"] for r in rows)
    return out


# ------------------------------------------------------------- LMCache processes
class _Lines:
    """The lines of a process's stdout (a pipe read unbuffered), each within a
    deadline."""

    def __init__(self, proc: subprocess.Popen, what: str) -> None:
        self.proc, self.what, self._buf = proc, what, b""

    def wait(self, deadline: float, want=lambda line: line.startswith("READY")) -> str:
        """The first line that ``want`` accepts; ``RuntimeError`` if the process exits
        or ``deadline`` (monotonic) passes first."""
        fd = self.proc.stdout.fileno()
        while True:
            while b"\n" in self._buf:
                raw, self._buf = self._buf.split(b"\n", 1)
                line = raw.decode(errors="replace")
                if want(line):
                    return line
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError(f"{self.what}: no answer by its deadline")
            ready, _, _ = select.select([fd], [], [], min(left, 1.0))
            if ready:
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    raise RuntimeError(f"{self.what} exited with code "
                                       f"{self.proc.wait(timeout=10)}")
                self._buf += chunk


def _stop(proc: subprocess.Popen) -> None:
    """Terminate ``proc``; kill it if it is still there 20 s later."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=20)


def niced(niceness: int, argv: list[str]) -> list[str]:
    """``argv`` run at nice value ``niceness`` (``nice -n``, relative to this process's)."""
    return ["nice", "-n", str(niceness - os.nice(0)), *argv]


class LMCacheServer:
    """One LMCache multiprocess server (a process of ``python`` at nice ``niceness``)
    on ``port``, its log in ``log``; running once ``wait`` returns."""

    def __init__(self, python: str, port: int, l2_folder: str, log: Path,
                 niceness: int) -> None:
        self.log = log
        self.proc = subprocess.Popen(niced(niceness, [python, *server_args(port, l2_folder)]),
                                     stdout=log.open("w"), stderr=subprocess.STDOUT,
                                     env=os.environ | LMCACHE_ENV)

    def wait(self) -> None:
        deadline = time.monotonic() + START_S
        while "cache server is running" not in self.log.read_text():
            if self.proc.poll() is not None:
                raise RuntimeError(f"LMCache server exited: see {self.log}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"LMCache server not up in {START_S} s: see {self.log}")
            time.sleep(0.5)

    def stop(self) -> None:
        _stop(self.proc)


class LMCacheEngine:
    """One vLLM engine with LMCache's connector (``lmcache_engine.py`` in a process of
    ``python`` at nice ``niceness``) on the server at ``port``; it is starting when this
    returns."""

    def __init__(self, python: str, model: str, port: int, env: dict, log: Path,
                 niceness: int) -> None:
        script = Path(__file__).with_name("lmcache_engine.py")
        from raykv_lab.engines.vllm_actors import LLM_DEFAULTS

        self.proc = subprocess.Popen(
            niced(niceness, [python, str(script), model, str(port),
                             json.dumps(LLM_DEFAULTS | ENGINE)]),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log.open("w"),
            bufsize=0, env=os.environ | env | LMCACHE_ENV)
        self.log = log
        self._lines = _Lines(self.proc, f"LMCache engine ({log})")

    def wait(self) -> None:
        self._lines.wait(time.monotonic() + START_S)

    def _send(self, req: dict) -> None:
        data = memoryview((json.dumps(req) + "\n").encode())
        while data:  # an unbuffered pipe may take part of it
            data = data[self.proc.stdin.write(data):]

    def generate(self, prompt: list[int], max_tokens: int = OUTPUT) -> dict:
        """As ``VLLMEngine.generate``: ``tokens``, ``cached``, ``ttft_s``."""
        self._send({"op": "generate", "prompt": prompt, "max_tokens": max_tokens})
        line = self._lines.wait(time.monotonic() + ASK_S,
                                want=lambda ln: parse_answer(ln) is not None)
        return parse_answer(line)

    def close(self) -> None:
        try:
            if self.proc.poll() is None:
                self._send({"op": "close"})
                self._lines.wait(time.monotonic() + 60,
                                 want=lambda ln: parse_answer(ln) is not None)
        except (RuntimeError, OSError):
            pass
        finally:
            _stop(self.proc)


# --------------------------------------------------------------------- the run
def _wait_l2_clean(actor) -> None:
    """Until node ``actor``'s L2 pools hold no dirty page (write-behind done)."""
    import ray

    deadline = time.monotonic() + SETTLE_S
    while any(p.dirty for p in ray.get(actor.stats.remote()).l2.pools.values()):
        if time.monotonic() > deadline:
            raise RuntimeError(f"node 0's write-behind not done in {SETTLE_S} s")
        time.sleep(0.05)


def _wait_chunks(folder: Path, chunks: int) -> None:
    """Until ``folder`` (LMCache's fs L2) holds at least ``chunks`` chunk files."""
    deadline = time.monotonic() + SETTLE_S
    while sum(1 for f in folder.iterdir() if f.suffix == ".data") < chunks:
        if time.monotonic() > deadline:
            raise RuntimeError(f"LMCache's L2 has not {chunks} chunks in {SETTLE_S} s")
        time.sleep(0.05)


def _gets(actor) -> int:
    import ray

    return ray.get(actor.stats.remote()).counters.get("get_objects", 0)


def run(python: str, rounds: int, tokens: int, out: Path, ports: tuple[int, int],
        tail: int = 0) -> dict:
    import ray
    from raykv.clusters.local import local_settings, start_local
    from raykv.controllers.node_records import as_dict
    from raykv_lab.engines.vllm_actors import ENV, ready, start_engine
    from raykv_lab.engines.vllm_model import LlamaDims, make_llama

    check_tokens(tokens)
    rnd = random.Random(0)
    blocks = (tokens + tail) // 128 + 1
    out.mkdir(parents=True, exist_ok=True)
    procs: list = []
    with (tempfile.TemporaryDirectory() as tmp,
          tempfile.TemporaryDirectory(dir="/dev/shm") as l2_folder,
          start_local(settings=local_settings(global_segment_size=1 << 30),
                      num_nodes=2) as cluster):
        dims = LlamaDims.of(512, 8)
        model = make_llama(os.path.join(tmp, "llama"), dims)
        n0, n1 = cluster.node_ids
        conf = {"model_name": "bench-h2h", "l2_blocks": (rounds + 1) * blocks}
        a0, a1 = cluster.node_actors[n0], cluster.node_actors[n1]
        # Ray runs its workers (engines, node actors) niced: LMCache's processes too
        nice = os.getpriority(os.PRIO_PROCESS, ray.get(a0.health.remote())["pid"])
        try:
            servers = [LMCacheServer(python, port, l2_folder, out / f"lmcache_server{i}.log",
                                     nice) for i, port in enumerate(ports)]
            procs += servers
            for s in servers:
                s.wait()
            e = start_engine(n0, model, conf, enable_prefix_caching=True, **ENGINE)
            f = start_engine(n0, model, conf, **ENGINE)
            g = start_engine(n1, model, conf, **ENGINE)
            lm = {name: LMCacheEngine(python, model, ports[i], ENV,
                                      out / f"lmcache_engine_{name}.log", nice)
                  for name, i in (("a", 0), ("b", 0), ("c", 1))}
            procs += lm.values()
            ready(e, f, g)
            for x in lm.values():
                x.wait()
            for engine in (e, f, g):  # warm-up, a prompt of its own each (below a chunk)
                ray.get(engine.generate.remote([rnd.randrange(3, 2000) for _ in range(200)],
                                               OUTPUT))
            for x in lm.values():
                x.generate([rnd.randrange(3, 2000) for _ in range(200)])
            rows = []
            for r in range(rounds):
                p = [rnd.randrange(3, 2000) for _ in range(tokens + tail)]
                raw: dict = {}
                for side in side_order(r):
                    if side == "raykv":
                        cold = ray.get(e.generate.remote(p, OUTPUT))
                        own = ray.get(e.generate.remote(p, OUTPUT))
                        _wait_l2_clean(a0)
                        g0 = _gets(a0)
                        same = ray.get(f.generate.remote(p, OUTPUT))
                        same_gets = _gets(a0) - g0
                        g1 = _gets(a1)
                        cross = ray.get(g.generate.remote(p, OUTPUT))
                        raw["raykv"] = {"cold": cold, "own": own, "same_node": same,
                                        "cross_node": cross,
                                        "same_node_mooncake_gets": same_gets,
                                        "cross_node_mooncake_gets": _gets(a1) - g1}
                    else:
                        cold = lm["a"].generate(p)
                        _wait_chunks(Path(l2_folder), (r + 1) * tokens // CHUNK)
                        raw["lmcache"] = {"cold": cold, "same_node": lm["b"].generate(p),
                                          "cross_node": lm["c"].generate(p)}
                own, cold = raw["raykv"]["own"], raw["raykv"]["cold"]
                row: dict = {"round": r, "order": list(side_order(r)),
                             "own_prefix_cache": case_row(own, own, cold),
                             "same_tokens_cold_raykv_vs_lmcache":
                                 raw["lmcache"]["cold"]["tokens"] == cold["tokens"]}
                for side in SIDES:
                    row[side] = {c: case_row(raw[side][c], own, cold) for c in CASES}
                    row[side]["cold_ttft_ms"] = 1000 * raw[side]["cold"]["ttft_s"]
                for k in ("same_node_mooncake_gets", "cross_node_mooncake_gets"):
                    row["raykv"][k] = raw["raykv"][k]
                row["ratios"] = round_ratios(row)
                rows.append(row)
                print(json.dumps(row), flush=True)
            result = {"rounds": rounds, "tokens": tokens, "tail": tail,
                      "output_tokens": OUTPUT,
                      "chunk": CHUNK, "block": 128, "remote_path": REMOTE_PATH,
                      "model": {"hidden": dims.hidden, "layers": dims.layers,
                                "kv_bytes_per_token": dims.kv_bytes_per_token},
                      "niceness": nice, "load_average": os.getloadavg(), "rows": rows,
                      "summary": summary(rows),
                      "l2_stats": [as_dict(ray.get(a.stats.remote()).l2) for a in (a0, a1)]}
        finally:
            for proc in reversed(procs):
                (proc.close if isinstance(proc, LMCacheEngine) else proc.stop)()
    (out / "lmcache_h2h.json").write_text(json.dumps(result, indent=1))
    return result


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lmcache-python", required=True,
                    help="python of a venv with vLLM and lmcache==0.5.6")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=4096,
                    help=f"tokens per prompt, a multiple of {CHUNK}")
    ap.add_argument("--tail", type=int, default=0,
                    help="tokens after the whole chunks (1: both sides load every chunk)")
    ap.add_argument("--ports", default="5611,5612", help="the two LMCache servers' ports")
    ap.add_argument("--out", type=Path, default=Path("."))
    a = ap.parse_args(argv)
    try:
        check_tokens(a.tokens)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    if not 0 <= a.tail < CHUNK:
        raise SystemExit(f"--tail must be 0 to {CHUNK - 1}, got {a.tail}")
    p0, p1 = (int(x) for x in a.ports.split(","))
    res = run(a.lmcache_python, a.rounds, a.tokens, a.out, (p0, p1), a.tail)
    print(json.dumps(res["summary"], indent=1))


if __name__ == "__main__":
    main()
