"""A request's prompt as token ids, for routing (no Ray Serve, no vLLM import).

Ray Serve LLM hands a router the request's arguments: under direct streaming the
token ids themselves (keyword ``request_token_ids``), else an OpenAI-style request
object with ``prompt`` (text or token ids) or ``messages`` (chat). Text is tokenized
with the model's Hugging Face tokenizer as vLLM does it (a completion: ``encode`` with
special tokens; a chat: its chat template with the generation prompt), loaded on a
thread of its own at start: until it is loaded, text requests have no token ids (the
router then routes as without raykv). Text goes through a prefix memo (``text_tokens``,
bounded by ``memo_ids`` token ids; 0: none), exact or off. A prompt the tokenizer does
not reproduce exactly as the engine sees it costs hits, never a wrong load: loads are
decided by the engine's own connector.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from raykv.integrations.serve.text_memo import MAX_IDS
from raykv.integrations.serve.text_tokens import TextTokens, chat_ids

log = logging.getLogger(__name__)

TOKEN_IDS_KWARG = "request_token_ids"
"""The keyword Ray Serve LLM's direct-streaming ingress passes token ids under."""


class PromptTokens:
    """Token ids of requests; ``tokenizer``: the model whose tokenizer reads text (None:
    token ids only); ``memo_ids``: the text memo's bound in token ids (0: no memo)."""

    def __init__(self, tokenizer: str | None, memo_ids: int = MAX_IDS) -> None:
        self._tokenizer = None
        self.text: TextTokens | None = None
        self.failed: str | None = None
        self._memo_ids = memo_ids
        if tokenizer:
            threading.Thread(target=self._load, args=(tokenizer,), daemon=True,
                             name="raykv-router-tokenizer").start()

    def _load(self, name: str) -> None:
        try:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(name)
        except Exception as e:  # routed without text from now on, said once
            self.failed = f"{type(e).__name__}: {e}"
            log.warning("RayKVRouter: tokenizer %s did not load (%s); only requests that "
                        "carry token ids are routed by residency", name, self.failed)
            return
        if self._memo_ids > 0:
            try:
                self.text = TextTokens(tok, max_ids=self._memo_ids)
            except Exception as e:  # text tokenized in full, said once
                log.warning("RayKVRouter: no prompt text memo (%s: %s)", type(e).__name__, e)
        self._tokenizer = tok

    @property
    def ready(self) -> bool:
        return self._tokenizer is not None

    def text_stats(self) -> dict[str, Any]:
        """The text memo's counters (``TextTokens.stats``) and ``off`` (why it is off,
        or None); {} without a memo."""
        text = self.text
        return text.stats() | {"off": text.off} if text is not None else {}

    def given(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> list[int] | None:
        """The token ids the request carries (no tokenizer: cheap, any thread), or None."""
        ids = kwargs.get(TOKEN_IDS_KWARG)
        if ids:
            return [int(t) for t in ids]
        for arg in args:
            prompt = getattr(arg, "prompt", None)
            if _is_token_ids(prompt):
                return [int(t) for t in prompt]
        return None

    def of(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> list[int] | None:
        """The prompt's token ids, or None if the request has none this can read (text
        is tokenized here: milliseconds for a long prompt, so not on an event loop)."""
        ids = self.given(args, kwargs)
        if ids is not None:
            return ids
        for arg in args:
            prompt = getattr(arg, "prompt", None)
            tok = self._tokenizer
            text = self.text
            if isinstance(prompt, str) and tok is not None:
                return text.completion(prompt) if text else list(tok.encode(prompt))
            messages = getattr(arg, "messages", None)
            if messages and tok is not None:
                chat = _chat(messages)
                return text.chat(chat) if text else chat_ids(tok, chat)
        return None


    def known(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> list[int]:
        """The leading token ids of the request's text that the text memo holds, without
        tokenizing (any thread; ``[]``: none, no memo, or a request without text)."""
        text = self.text
        if text is None:
            return []
        for arg in args:
            prompt = getattr(arg, "prompt", None)
            if isinstance(prompt, str):
                return text.known_completion(prompt)
            messages = getattr(arg, "messages", None)
            if messages:
                return text.known_chat(_chat(messages))
        return []


def _chat(messages: Sequence[Any]) -> list[Any]:
    """OpenAI chat messages as the chat template takes them (plain mappings)."""
    return [m.model_dump(exclude_none=True) if hasattr(m, "model_dump") else m
            for m in messages]


def _is_token_ids(value: Any) -> bool:
    return isinstance(value, list | tuple) and bool(value) and \
        all(isinstance(t, int) and not isinstance(t, bool) for t in value)
