"""What the router's prefix memo of text tokenization saves, in process (no Ray, no
Serve): the demo model's tokenizer (``make_llama``) on the routing benchmark's seeded
text workload (``serve_workload``), each prompt tokenized plainly (``tok.encode``) and
through a fresh ``TextTokens`` (its defaults: cuts about every 1024 characters, one
sampled check in 64 hits), one after the other, in order.

Run: ``python -m raykv_lab.bench.text_memo [--model DIR] [--doc-words 2600]
[--questions 100] [--sessions 20] [--turns 8] [--opening-words 2000] [--out DIR]``.
Two workloads: ``documents`` (one document of ``doc_words`` words, about 6.5
characters each, asked ``questions`` questions) and ``sessions`` (``sessions``
conversations of ``turns`` turns, each turn's prompt the previous one plus an answer
and new user text). Per workload: ``plain``, ``memo`` (every prompt), ``memo_hits`` and
``memo_misses`` (p50/p99 ms), the prompts' sizes in characters and the memo's counters.
Every memo result is compared with the plain one (``RuntimeError`` on a difference).
Writes ``text_memo.json`` to ``--out``. Numbers only: nothing asserts a speed.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from raykv_lab.bench.serve_workload import WorkloadShape, workload
from raykv_lab.bench.toolkit import latency_ms


def _measure(tok, prompts: list[str]) -> dict:
    from raykv.integrations.serve.text_tokens import TextTokens

    memo = TextTokens(tok)
    if memo.off is not None:
        raise RuntimeError(f"the memo is off for this tokenizer: {memo.off}")
    plain_s, memo_s, hit_s, miss_s = [], [], [], []
    for prompt in prompts:
        t = time.perf_counter()
        want = tok.encode(prompt)
        plain_s.append(time.perf_counter() - t)
        hits = memo.memo.counts["hits"]
        t = time.perf_counter()
        got = memo.completion(prompt)
        took = time.perf_counter() - t
        memo_s.append(took)
        (hit_s if memo.memo.counts["hits"] > hits else miss_s).append(took)
        if got != want:
            raise RuntimeError(f"the memo's ids differ from tok.encode on {prompt[-60:]!r}")
    if not memo.settled(60):
        raise RuntimeError("the sampled checks did not finish in 60 s")
    return {"prompts": len(prompts), "chars": [min(map(len, prompts)), max(map(len, prompts))],
            "plain": latency_ms(plain_s), "memo": latency_ms(memo_s),
            "memo_hits": latency_ms(hit_s) if hit_s else {},
            "memo_misses": latency_ms(miss_s) if miss_s else {}, "counts": memo.stats()}


def run(model: str | None, doc_words: int = 2600, questions: int = 100, sessions: int = 20,
        turns: int = 8, opening_words: int = 2000, seed: int = 0) -> dict:
    """The two workloads' numbers (see the module docstring); ``model``: a folder with a
    Hugging Face tokenizer (None: the demo model, made in a temporary folder)."""
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory() as tmp:
        if model is None:
            from raykv_lab.engines.vllm_model import make_llama

            model = make_llama(str(Path(tmp) / "tiny-llama"))
        tok = AutoTokenizer.from_pretrained(model)
    docs = workload(WorkloadShape(sessions=0, docs=1, doc_words=doc_words,
                                  questions=questions), seed)
    talks = workload(WorkloadShape(sessions=sessions, turns=turns,
                                   opening_words=opening_words, docs=0), seed)
    return {"documents": _measure(tok, [s.prompts[0] for s in docs]),
            "sessions": _measure(tok, [p for s in talks for p in s.prompts])}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--doc-words", type=int, default=2600)
    p.add_argument("--questions", type=int, default=100)
    p.add_argument("--sessions", type=int, default=20)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--opening-words", type=int, default=2000)
    p.add_argument("--out", default=".")
    args = p.parse_args()
    result = run(args.model, args.doc_words, args.questions, args.sessions, args.turns,
                 args.opening_words)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "text_memo.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
