"""Checksums of the vLLM blocks raykv's connector saves and loads, and the check that
every loaded block is one that some engine saved under its key: the byte check of the
vLLM eviction and fault benchmarks.

A *digest* is the SHA-256 (hex) of one block's bytes over every layer of vLLM's KV
cache, in vLLM's layer order, as the cache holds them: for a save, when
``wait_for_save`` is called (before the connector copies it out); for a load, right
after ``start_load_kv`` (blocks whose load failed are left out: vLLM recomputes them).
The same tokens may be saved with other bytes (an engine that recomputed a block
after a miss computed it in another prefill split, so other bf16 rounding), so a
page hash may have several saved digests; a loaded digest must be one of them.

Pure (no Ray, no torch): ``raykv_lab.bench.digest_engine`` records them inside
an engine.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence


def check_loads(saved: Iterable[Mapping[str, Sequence[str]]],
                loads: Iterable[Sequence[Sequence[str]]]) -> dict:
    """Every load of ``loads`` (per engine, ``[page hash, digest]`` per loaded block)
    against the digests ``saved`` (per engine, page hash -> digests it saved):
    ``checked`` loads, ``wrong`` (a digest no engine saved under that hash, the hash
    saved), ``never_saved`` (a hash no engine saved: also wrong bytes), and up to five
    ``examples`` of either as ``[hash, digest]``. No loads: nothing wrong."""
    versions: dict[str, set[str]] = {}
    for engine in saved:
        for h, digests in engine.items():
            versions.setdefault(h, set()).update(digests)
    checked, wrong, never, examples = 0, 0, 0, []
    for engine in loads:
        for h, digest in engine:
            checked += 1
            if h not in versions:
                never += 1
            elif digest not in versions[h]:
                wrong += 1
            else:
                continue
            if len(examples) < 5:
                examples.append([h, digest])
    return {"checked": checked, "wrong": wrong, "never_saved": never, "examples": examples}
