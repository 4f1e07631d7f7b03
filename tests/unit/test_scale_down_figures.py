"""Every figure docs/benchmarks.md quotes for ``raykv bench-scale-down`` is the recorded
run's: ``docs/scale_down.json``, the file that run wrote. The lines carrying them are
rendered here from the JSON and must appear in the doc as rendered."""

from __future__ import annotations

import json
from pathlib import Path

from raykv import MiB

ROOT = Path(__file__).resolve().parents[2]
RUN = json.loads((ROOT / "docs" / "scale_down.json").read_text())


def link_name(link: str) -> str:
    return link.replace("gbit", " Gbit/s")


def doc_lines(run: dict) -> list[str]:
    """The lines of docs/benchmarks.md's *Scale-down* section that carry the run's
    figures."""
    lines = [f"Recorded {run['date']} (`{run['command']}`, {run['seconds'] / 60:.0f} min "
             f"for {len(run['runs'])} clusters; load average "
             f"{min(r['load_before'][0] for r in run['runs']):.0f}-"
             f"{max(r['load_before'][0] for r in run['runs']):.0f} when each started, "
             f"{run['machine']['cpus']} CPUs, {run['machine']['memory_gib']:.0f} GiB):"]
    for r in run["runs"]:
        rep, rates = r["report"], r.get("drain_rates")
        moved = (f"{rep['objects_moved']} objects, {rep['bytes_moved'] / MiB:.0f} MiB"
                 if r["drain"] else "nothing (stopped at once)")
        lines.append(
            f"| {link_name(r['link'])} | {'on' if r['drain'] else 'off'} | "
            f"{r['before']['hit_rate']:.3f} | {r['after']['hit_rate']:.3f} | "
            f"**{r['after_vs_before']:.2f}x** | {moved} | "
            f"{rep['seconds']:.1f} s |" if r["drain"] else
            f"| {link_name(r['link'])} | off | {r['before']['hit_rate']:.3f} | "
            f"{r['after']['hit_rate']:.3f} | **{r['after_vs_before']:.2f}x** | {moved} | - |")
        if rates:
            lines.append(f"- {link_name(r['link'])}, host 2's drain: "
                         f"{rates['gbps']:.3f} GB/s ({rates['objects_per_s']:.1f} objects/s, "
                         f"{rates['link_fraction']:.2f} of the link)")
    for r in run["runs"]:
        for d in r["rate_drains"]:
            rep = d["report"]
            lines.append(f"| {link_name(r['link'])} | {d['object_bytes'] // MiB} MiB | "
                         f"{rep['objects_moved']} | {rep['bytes_moved'] / MiB:.0f} MiB | "
                         f"{rep['seconds']:.1f} | {d['objects_per_s']:.1f} | "
                         f"{d['gbps']:.3f} | {d['link_fraction']:.2f} |")
    for link, m in run["model"].items():
        lines.append(f"- {link_name(link)}: {m['objects_per_s']:.1f} objects/s, so "
                     f"{m['s_per_gib_of_1mib_objects']:.0f} s per GiB of 1 MiB objects")
    return lines


def test_the_docs_quote_the_recorded_scale_down_run():
    doc = (ROOT / "docs" / "benchmarks.md").read_text()
    missing = [line for line in doc_lines(RUN) if line not in doc]
    assert not missing, missing


def test_the_recorded_run_is_whole():
    """Drain on and off at each link rate, every page served checked (the run fails
    otherwise), the hit rate before full."""
    kinds = {(r["link"], r["drain"]) for r in RUN["runs"]}
    assert kinds == {(link, on) for link, _ in kinds for on in (True, False)}
    assert all(r["before"]["hit_rate"] == 1.0 for r in RUN["runs"])
    assert all(r["report"].get("outcome") == "stopped" for r in RUN["runs"])
