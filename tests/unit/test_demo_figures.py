"""Every figure the README and docs/demo.md quote for ``raykv demo`` (the example engine,
default job) is one recorded run's: ``docs/demo.json``, the file that run wrote. The
README's sample output is what the command prints for that JSON (its own printer), the
headline quotes that sample (``test_docs_once``), and demo.md's tables and figures are
rendered here from the JSON and must appear in it as rendered."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from raykv import MiB
from raykv_lab.demo.example_demo import _print
from rich.console import Console

ROOT = Path(__file__).resolve().parents[2]
RUN = json.loads((ROOT / "docs" / "demo.json").read_text())


def printed(run: dict) -> list[str]:
    """The lines ``raykv demo`` prints for ``run`` after its progress bars."""
    console = Console(file=io.StringIO(), width=400, record=True)
    _print(console, run["requests"], run["summary"], run["long_prompt"],
           run["config"]["load_guard"])
    return [line.rstrip() for line in console.export_text().splitlines()]


def readme_sample() -> list[str]:
    readme = (ROOT / "README.md").read_text()
    block = readme.split("It prints a table of every request", 1)[1].split("```", 2)[1]
    return [line for line in block.strip().splitlines()
            if not line.startswith(("wrote ", "OK: "))]


def spread(values, fmt: str = "{:.0f}") -> str:
    """``lo-hi`` of ``values`` (one figure when they round alike)."""
    values = list(values)
    lo, hi = fmt.format(min(values)), fmt.format(max(values))
    return lo if lo == hi else f"{lo}-{hi}"


def demo_md_lines(run: dict) -> list[str]:
    """The lines of docs/demo.md that carry the run's figures, rendered from ``run``."""
    reqs, summary, long = run["requests"], run["summary"], run["long_prompt"]
    lines = []
    for r in reqs:
        mib = sum(r["fetched_bytes"].values()) / MiB
        guard = ", ".join(f"{t.upper()} {n} pages" for t, n in
                          sorted(r["skipped_pages"].items())) or "load"
        lines.append(
            f"| {r['session']} | {r['turn']} | {r['node']} | {r['prompt_tokens']} | "
            f"{r['l2_pages']} | {r['l3_pages']} | {guard} | {r['state_tier'] or '-'} | "
            f"{r['computed_tokens']} | {r['ttft_ms']:.0f} | {r['ttft_recompute_ms']:.0f} | "
            f"{r['ttft_ratio']:.2f} | {mib:.1f} |")
    tiers = summary["tier_hit_rate"]
    loaded, skipped = summary["guard_loaded_tokens"], summary["guard_recomputed_tokens"]
    lines.append(f"- Load guard (`{run['config']['load_guard']}`): loaded {loaded['l2']:,} "
                 f"tokens from L2 and {loaded['l3']:,} from L3, recomputed instead "
                 f"{sum(skipped.values()):,}; TTFT with raykv / recomputing at worst "
                 f"{summary['worst_ttft_ratio']:.2f}, {summary['later_than_recompute']} of "
                 f"{len(reqs)} requests later than recomputing.")
    lines.append(f"- Total TTFT over the {len(reqs)} requests: "
                 f"{summary['ttft_ms_total'] / 1e3:.1f} s with raykv vs "
                 f"{summary['ttft_recompute_ms_total'] / 1e3:.1f} s recomputing "
                 f"({summary['speedup']:.1f}x).")
    lines.append(f"- Prompt tokens served: **L2 (local host pool) {tiers['l2_local_pool']:.0%}**, "
                 f"**L3 (Mooncake) {tiers['l3_mooncake']:.0%}**, computed "
                 f"{tiers['computed']:.0%}.")
    pools, fb = summary["pool_hit_rate"], summary["fetched_bytes"]
    lines.append(f"- Per pool (pages of all prompts; Mamba: requests): `kv` L2 "
                 f"{pools['kv']['l2']:.0%}, L3 {pools['kv']['l3']:.0%}, miss "
                 f"{pools['kv']['miss']:.0%} ({fb['kv'] / MiB:.1f} MiB fetched); `draft` "
                 f"L2 {pools['draft']['l2']:.0%}, L3 {pools['draft']['l3']:.0%} "
                 f"({fb['draft'] / MiB:.1f} MiB); `mamba` checkpoint from L2 "
                 f"{pools['mamba']['l2']:.0%}, from L3 {pools['mamba']['l3']:.0%}, none "
                 f"{pools['mamba']['miss']:.0%} ({fb['mamba'] / MiB:.1f} MiB).")
    io_ = summary["l3_bytes"]
    lines.append(f"- Mooncake traffic seen by the node actors (whole run, both nodes, including "
                 f"the long prompt): put {io_['put_bytes'] / MiB:.1f} MiB in "
                 f"{io_['put_objects']:,} objects, get {io_['get_bytes'] / MiB:.1f} MiB in "
                 f"{io_['get_objects']:,} objects.")
    fetched = [r for r in reqs if r["l3_pages"]]
    lines.append(f"- Requests that fetched from L3 spent {spread(r['query_ms'] for r in fetched)} "
                 f"ms in the group query and {spread(r['fetch_ms'] for r in fetched)} ms "
                 "fetching.")
    mib = sum(long["l3_fetched_bytes"].values()) / MiB
    lines += [
        f"| recompute (node 0; nothing cached, group query misses) | "
        f"{long['recompute_ms']:,.0f} | {long['recompute_hit_pages']} | 1x |",
        f"| fully cached, from L3 (node 1; group query {long['cached_l3_query_ms']:.0f} ms, "
        f"fetch of {mib:.0f} MiB {long['cached_l3_fetch_ms']:.0f} ms) | "
        f"{long['cached_l3_ms']:,.0f} | {long['cached_l3_hit_pages']} of {long['max_hit_pages']} "
        f"| **{long['speedup_l3']:.1f}x lower** |",
        f"| fully cached, from L2 (node 0's host pool) | {long['cached_l2_ms']:,.0f} | "
        f"{long['cached_l2_hit_pages']} of {long['max_hit_pages']} | "
        f"**{long['speedup_l2']:.1f}x lower** |"]
    decode = [r["decode_ms"] / 1e3 for r in reqs]
    proposed = [r["draft_proposed"] for r in reqs]
    accepted = [r["draft_accepted"] for r in reqs]
    lines.append(f"({spread(accepted)} of {spread(proposed)} proposed tokens per request, "
                 f"{sum(accepted) / sum(proposed):.0%} in all)")
    lines.append(f"Decode took {spread(decode, '{:.1f}')} s per {reqs[0]['reply_tokens']}-token "
                 "reply.")
    m = run["machine"]
    lines.append(f"Python {m['python']}, torch {m['torch']}, Ray {m['ray']}; load average "
                 f"{m['load_avg'][0]:.1f} when the run ended.")
    return lines


def test_the_readme_sample_output_is_what_the_demo_prints_for_the_recorded_run():
    sample, lines = readme_sample(), printed(RUN)
    assert sample and all(line in lines for line in sample), \
        [line for line in sample if line not in lines]
    # CONTROL: the sample of another run (one figure changed) is caught
    other = json.loads(json.dumps(RUN))
    other["long_prompt"]["speedup_l3"] += 1
    assert not all(line in printed(other) for line in sample)


def test_demo_md_quotes_the_recorded_run():
    text = (ROOT / "docs" / "demo.md").read_text()
    flat = " ".join(text.split())
    missing = [line for line in demo_md_lines(RUN) if " ".join(line.split()) not in flat]
    assert missing == []
    assert "[`demo.json`](demo.json)" in text


@pytest.mark.parametrize("key", ["speedup_l3", "recompute_ms"])
def test_control_a_figure_of_another_run_is_caught(key):
    other = json.loads(json.dumps(RUN))
    other["long_prompt"][key] *= 1.5
    flat = " ".join((ROOT / "docs" / "demo.md").read_text().split())
    assert any(" ".join(line.split()) not in flat for line in demo_md_lines(other))


def test_the_readme_quotes_the_recorded_vllm_run():
    """The README's vLLM figure (another node's blocks loaded vs prefill, 4096 tokens) is
    docs/demo_vllm.json's, the run docs/demo.md's "On real vLLM" shows."""
    long = json.loads((ROOT / "docs" / "demo_vllm.json").read_text())["long_prompt"]
    head = " ".join((ROOT / "README.md").read_text().split())
    assert (f"**{long['speedup_raykv']:.0f}x lower** loading another node's blocks: "
            f"{long['recompute_ms'] / 1e3:.1f} s of prefill against "
            f"{long['cached_raykv_ms']:.0f} ms") in head, head
