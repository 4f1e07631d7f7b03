"""Token ids of prompt text through a Hugging Face fast tokenizer, with a prefix memo
(``text_memo``) and its guards (no Ray, Serve or vLLM import; the tokenizer is given).

Exactness is the contract: ``completion(text)`` equals ``tok.encode(text)`` (special
tokens added) and ``chat(messages)`` equals ``tok.apply_chat_template(messages,
add_generation_prompt=True, tokenize=True)``. The memo tokenizes the text without
special tokens (the chat's rendered template, or the completion with the tokenizer's
special prefix and suffix ids put around it). Two guards keep it exact:

1. a self-test when built: probe texts (words, whitespace runs, digits, punctuation,
   non-Latin letters, the tokenizer's own added tokens between them), cut at every cut
   candidate, each tokenized through a scratch memo after each of its prefixes (every
   fifth length) and compared with the plain tokenization; a chat is compared
   rendered-then-encoded, templated with ``tokenize=True`` and through the memo. A
   mismatch turns the memo off for good (``off`` says why, logged once): every text is
   then tokenized plainly;
2. a sampled check: one in ``check_every`` memo hits is tokenized again plainly on a
   daemon thread of its own (with a copy of the tokenizer and of the result), never on
   the caller's; when that thread is still busy the check is skipped (``check_skipped``).
   A mismatch turns the memo off, counted (``mismatches``) and logged once, and empties
   it. The check comes after the caller had its ids: the wrong ones it found, and any
   between it and the memo's end, were used (by the router: a route that costs hits,
   never a wrong load, which the engine's connector decides).

Thread-safety: one caller thread (the router's keys thread) calls ``completion`` and
``chat``; ``known_completion`` and ``known_chat`` may be called from another (the
router's event loop) meanwhile; the checker thread reads only its own copies.
"""

from __future__ import annotations

import copy
import logging
import queue
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from raykv.integrations.serve.text_memo import (
    CHUNK_CHARS,
    MAX_IDS,
    Cut,
    Encoding,
    PrefixMemo,
    next_cut,
)

log = logging.getLogger(__name__)

CHECK_EVERY = 64
"""Memo hits per sampled check, about."""

_WORDS = ("The quick brown fox, said Émile, jumps over 12 lazy dogs; naïve café's "
          "Straße und 東京 Привет мир!  Two  spaces,\ttab\nnew line\n\n  indented "
          "x2 don't it's  y'all I'm 3.14 (paren) [b] {c} #tag @me a_b -- end ")
_CHAT = ({"role": "user", "content": "What is in this document? " + _WORDS},
         {"role": "assistant", "content": "Words, " + _WORDS[:60]},
         {"role": "user", "content": "And then? Tell me more about it."})


class TextTokens:
    """``tok``'s token ids of texts with a prefix memo; see the module docstring.
    ``cut`` is the memo's cut rule (the default is the only one known exact)."""

    def __init__(self, tok: Any, chunk_chars: int = CHUNK_CHARS, max_ids: int = MAX_IDS,
                 check_every: int = CHECK_EVERY, cut: Cut = next_cut) -> None:
        self._tok = tok
        self._cut = cut
        self.memo = PrefixMemo(chunk_chars, max_ids, cut)
        self.check_every = max(1, check_every)
        self.counts = {"checks": 0, "check_skipped": 0, "mismatches": 0}
        self.off: str | None = None
        self._prefix: list[int] = []
        self._suffix: list[int] = []
        self._checks: queue.Queue[tuple[str, bool, list[int]]] = queue.Queue(maxsize=1)
        self._checking = threading.Condition()
        self._pending = 0
        backend = getattr(tok, "backend_tokenizer", None)
        if backend is None:
            self._turn_off("not a fast tokenizer (no offsets)")
            return
        self._backend = backend
        self._turn_off(self._self_test())
        if self.off is None:
            try:
                self._checker_tok = copy.deepcopy(tok)
            except Exception as e:  # no check, no memo
                self._turn_off(f"the tokenizer does not copy ({type(e).__name__}: {e})")
                return
            threading.Thread(target=self._check_loop, daemon=True,
                             name="raykv-router-token-check").start()

    def stats(self) -> dict[str, int]:
        """The memo's and the checks' counters and the ids held (for benchmarks)."""
        return self.memo.counts | self.counts | {"held_ids": self.memo.held_ids,
                                                 "entries": len(self.memo)}

    def completion(self, text: str) -> list[int]:
        """``tok.encode(text)``: special tokens added."""
        if self.off is not None:
            return list(self._tok.encode(text))
        ids, reused = self.memo.tokens(text, self._encode)
        ids = self._prefix + ids + self._suffix
        if reused:
            self._sample(text, True, ids)
        return ids

    def chat(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        """``tok.apply_chat_template(messages, add_generation_prompt=True,
        tokenize=True)`` as token ids."""
        if self.off is not None:
            return chat_ids(self._tok, messages)
        text = self._rendered(messages)
        ids, reused = self.memo.tokens(text, self._encode)
        if reused:
            self._sample(text, False, ids)
        return ids

    def known_completion(self, text: str) -> list[int]:
        """The leading ids of ``completion(text)`` the memo holds, without tokenizing
        (``[]``: none, or the memo is off)."""
        ids, _ = self.memo.known(text) if self.off is None else ([], 0)
        return self._prefix + ids if ids else []

    def known_chat(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        """The leading ids of ``chat(messages)`` the memo holds, without tokenizing (the
        template is rendered: sub-millisecond for a conversation; ``[]``: none, or the
        memo is off)."""
        if self.off is not None:
            return []
        return self.memo.known(self._rendered(messages))[0]

    def _rendered(self, messages: Sequence[Mapping[str, Any]]) -> str:
        """``messages`` through the chat template, with the generation prompt, as text."""
        return self._tok.apply_chat_template(list(messages), add_generation_prompt=True,
                                             tokenize=False)

    def settled(self, timeout_s: float) -> bool:
        """Whether every sampled check handed over so far is done, waiting at most
        ``timeout_s`` seconds (for tests and benchmarks)."""
        with self._checking:
            return self._checking.wait_for(lambda: self._pending == 0, timeout_s)

    def _encode(self, text: str) -> Encoding:
        """The backend's encoding of ``text`` without special tokens; through
        ``encode_batch``, which releases the GIL while it runs (``encode`` holds it: a
        long text's tokenization on the keys thread would stall the router's event loop
        for its whole length, measured 179 ms for a 200 kB text)."""
        (enc,) = self._backend.encode_batch([text], add_special_tokens=False)
        return enc.ids, enc.offsets

    def _sample(self, text: str, specials: bool, ids: list[int]) -> None:
        if self.memo.counts["hits"] % self.check_every:
            return
        with self._checking:
            try:
                self._checks.put_nowait((text, specials, list(ids)))
            except queue.Full:
                self.counts["check_skipped"] += 1
                return
            self._pending += 1

    def _check_loop(self) -> None:
        while True:
            text, specials, ids = self._checks.get()
            try:
                plain = list(self._checker_tok.encode(text, add_special_tokens=specials))
                self.counts["checks"] += 1
                if plain != ids:
                    self.counts["mismatches"] += 1
                    self._turn_off(f"a sampled check found a mismatch at token "
                                   f"{_first_difference(plain, ids)} of {len(plain)}")
                    self.memo.clear()
            except Exception as e:  # the check could not run: no memo, said once
                self._turn_off(f"a sampled check failed ({type(e).__name__}: {e})")
            finally:
                with self._checking:
                    self._pending -= 1
                    self._checking.notify_all()

    def _turn_off(self, why: str | None) -> None:
        if why is None or self.off is not None:
            return
        self.off = why
        log.warning("RayKVRouter: the prompt text memo is off (%s); text is tokenized "
                    "in full", why)

    def _self_test(self) -> str | None:
        """None if the memo reproduces the plain tokenization on the probes, else why
        not. Also learns the special ids ``encode`` puts around a text."""
        tok = self._tok
        try:
            full = list(tok.encode(_WORDS))
            core = list(tok.encode(_WORDS, add_special_tokens=False))
            at = next((i for i in range(len(full) - len(core) + 1)
                       if full[i:i + len(core)] == core), -1)
            if at < 0:
                return "the tokenizer's special tokens are not a prefix and a suffix"
            self._prefix, self._suffix = full[:at], full[at + len(core):]
            for text in _probes(tok):
                plain = list(tok.encode(text))
                for seen in range(1, len(text), 5):
                    scratch = PrefixMemo(1, MAX_IDS, self._cut)
                    scratch.tokens(text[:seen], self._encode)
                    ids, _ = scratch.tokens(text, self._encode)
                    if self._prefix + ids + self._suffix != plain:
                        return (f"the self-test found a mismatch on {text[:seen][-30:]!r} "
                                f"+ {text[seen:][:30]!r}")
            scratch = PrefixMemo(1, MAX_IDS, self._cut)
            if getattr(tok, "chat_template", None):
                rendered = self._rendered(_CHAT)
                templated = chat_ids(tok, _CHAT)
                if list(tok.encode(rendered, add_special_tokens=False)) != templated or \
                        scratch.tokens(rendered, self._encode)[0] != templated:
                    return "the self-test found a chat template mismatch"
        except Exception as e:
            return f"the self-test failed ({type(e).__name__}: {e})"
        return None


def _probes(tok: Any) -> list[str]:
    """Probe texts: ``_WORDS`` alone, and with added tokens of ``tok`` between words,
    after a space, before a space and alone: the first 8, and up to 24 more of those
    that strip whitespace around them or match single words only."""
    added = [t for t in getattr(tok, "added_tokens_decoder", {}).values()
             if t.content.strip()]
    flagged = [t for t in added[8:] if t.lstrip or t.rstrip or t.single_word]
    texts = [_WORDS, "a", " leading space", "x"]
    for t in [a.content for a in added[:8] + flagged[:24]]:
        texts.append(f"{t}Start word{t}word {t} Word {t}{_WORDS}{t} end {t}")
    return texts


def chat_ids(tok: Any, messages: Sequence[Mapping[str, Any]]) -> list[int]:
    """``tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)``
    as token ids, whether the tokenizer returns a list or a mapping with ``input_ids``
    (transformers 5 does, unless ``return_dict=False``)."""
    out = tok.apply_chat_template(list(messages), add_generation_prompt=True,
                                  tokenize=True, return_dict=False)
    return list(out["input_ids"] if isinstance(out, Mapping) else out)


def _first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                min(len(a), len(b)))
