"""``raykv demo --engine vllm`` at tiny sizes, as a user runs it (the CLI, in a process
of its own: it starts its own 2-node cluster, 4 real vLLM engines and Mooncake).

Checks the structure of what it measured, never how fast: which tier served which
tokens (vLLM's prefix cache, raykv's L2 on the node, L3 through Mooncake, computed;
they add up to the prompt), the long prompt fully loaded from the other node's L3 and
from its own node's L2 with no Mooncake get, the files written.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.engine("vllm")

BLOCK = 128
SYSTEM, USER, REPLY, LONG = 256, 64, 8, 1024


def test_vllm_demo_small(tmp_path: Path):
    cmd = [str(Path(sys.executable).parent / "raykv"), "demo", "--engine", "vllm",
           "--hidden", "128", "--layers", "2", "--sessions", "2", "--turns", "2",
           "--system-tokens", str(SYSTEM), "--user-tokens", str(USER), "--reply-tokens",
           str(REPLY), "--long-prompt", str(LONG), "--out", str(tmp_path)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                         env=os.environ | {"COLUMNS": "160"})
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    assert "-token prompt" in out.stdout
    result = json.loads((tmp_path / "demo_vllm.json").read_text())
    assert (tmp_path / "demo_vllm.png").stat().st_size > 0
    assert result["ok"] is True
    reqs = result["requests"]
    assert [(r["session"], r["turn"], r["node"]) for r in reqs] == \
        [(0, 0, 0), (1, 0, 1), (0, 1, 1), (1, 1, 0)]
    for r in reqs:
        assert r["vllm_cached_tokens"] + r["l2_tokens"] + r["l3_tokens"] + \
            r["computed_tokens"] == r["prompt_tokens"], r
        assert r["l2_tokens"] + r["l3_tokens"] == r["raykv_tokens"], r
        assert r["vllm_cached_tokens"] >= 0 and r["raykv_tokens"] % BLOCK in (0, BLOCK - 1)
        assert r["l2_tokens"] >= 0 and r["l3_tokens"] >= 0
        assert r["l3_gets"] >= r["l3_tokens"] // BLOCK, r  # L3 tokens came from gets
        assert r["ttft_ms"] > 0 and r["ttft_stock_ms"] > 0
    first, second = reqs[0], reqs[1]
    # Nothing is cached before the first request; node 0 saves the system prompt's
    # blocks. Session 1 starts on node 1: those blocks come from raykv, not from node
    # 1's own prefix cache (empty), while stock vLLM on node 1 computes everything.
    assert first["raykv_tokens"] == first["vllm_cached_tokens"] == 0
    assert first["saved_blocks"] >= SYSTEM // BLOCK
    assert second["raykv_tokens"] == SYSTEM and second["vllm_cached_tokens"] == 0
    assert second["l3_tokens"] == SYSTEM and second["l2_tokens"] == 0  # node 1's L2: empty
    assert second["stock_cached_tokens"] == 0
    long = result["long_prompt"]
    assert long["recompute_cached_tokens"] == 0
    # every whole block loads, the last one too: only the last token is computed again
    assert long["raykv_loaded_blocks"] == long["max_hit_blocks"] == LONG // BLOCK
    assert long["cached_raykv_tokens"] == LONG - 1
    assert long["cached_raykv_l3_blocks"] == long["max_hit_blocks"]
    assert long["cached_raykv_gets"] >= long["max_hit_blocks"]
    # node 0's engine with its own prefix cache dropped: every block from node 0's L2,
    # not one Mooncake get
    assert long["cached_l2_blocks"] == long["max_hit_blocks"]
    assert long["cached_l2_gets"] == 0
    assert long["cached_l2_tokens"] == LONG - 1
    assert long["exact"] is True
    tiers = result["summary"]["tier_hit_rate"]
    assert tiers["raykv"] > 0 and tiers["l3_mooncake"] > 0
    assert tiers["l2_node"] + tiers["l3_mooncake"] == pytest.approx(tiers["raykv"])
    assert result["summary"]["l3_bytes"]["get_objects"] >= long["max_hit_blocks"]
