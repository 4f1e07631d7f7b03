"""A prefix memo of token ids for texts that share long prefixes (no tokenizer import).

Requests to a router share long text prefixes (a document asked many questions, a
conversation's earlier turns). ``PrefixMemo.tokens`` tokenizes a text as the token ids
memoised for its longest already-seen prefix that ends at a *cut*, plus an encoding of
the rest only; cuts inside the rest are memoised from the rest's offsets.

*Cuts*: ``next_cut`` picks, about every ``chunk_chars`` characters, a space that
follows a non-space character and precedes a letter. It depends on the text up to the
cut and one character past it only, so two texts sharing a prefix share its cuts.
Byte-level BPE pre-tokenizers (GPT-2's regex, Llama-3's and Qwen2's split regex) always
split before such a space, and no token crosses a pre-token split, so the prefix and the
rest tokenize apart as they do together. Other tokenizers may not: ``TextTokens``
checks on the tokenizer itself before it uses a memo (``text_tokens``). A cut counts
only where the rest's encoding has a token boundary exactly there (offsets); others are
counted (``unaligned``) and skipped.

Prefix identity: an incremental BLAKE2b digest of the text up to the cut (its UTF-8
bytes), never a copy of the text. An entry holds the token ids from the previous
memoised cut of the same text to its own cut and that cut's digest, so a text's ids are
held once, whatever its number of cuts.

Bounds: at most ``max_ids`` token ids in all, least recently used entries evicted first;
a segment longer than ``max_ids`` is not held (nor any later cut of that text).

Thread-safety: any thread may call; the entries and counters change under a lock,
which ``tokens`` does not hold while it encodes (so ``known`` on another thread never
waits for a tokenization); ``counts`` is read without the lock (counters, for
benchmarks). Entries remembered by two calls at once are each whole: a chain broken by
an eviction in between is never used (``_longest`` needs every link).
"""

from __future__ import annotations

import re
import threading
from array import array
from bisect import bisect_left
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from hashlib import blake2b

CHUNK_CHARS = 256
"""Characters between cuts, about (a cut is the first candidate this far past the last)."""
MAX_IDS = 4 << 20
"""Token ids the memo holds in all, at most (4 bytes each)."""

Encoding = tuple[Sequence[int], Sequence[tuple[int, int]]]
"""A text's token ids and each token's (start, end) character offsets in that text."""
Encode = Callable[[str], Encoding]
Cut = Callable[[str, int, int], int]
"""``cut(text, start, chunk_chars)``: the next cut after ``start`` (a character index),
or -1 if the text has none."""

_SPACE_BEFORE_WORD = re.compile(r"(?<=\S) (?=\w)")


def next_cut(text: str, start: int, chunk_chars: int) -> int:
    """The first index ``p >= start + chunk_chars`` where ``text[p]`` is a space after a
    non-space character and before a letter (``str.isalpha``), or -1."""
    pos = start + max(1, chunk_chars)
    while (m := _SPACE_BEFORE_WORD.search(text, pos)) is not None:
        p = m.start()
        if text[p + 1].isalpha():
            return p
        pos = p + 1
    return -1


@dataclass(frozen=True)
class _Entry:
    parent: bytes | None  # the digest of the previous memoised cut of the text; None: 0
    ids: array  # the token ids from the parent's cut to this cut


class PrefixMemo:
    """Token ids of texts by their memoised prefixes; see the module docstring."""

    def __init__(self, chunk_chars: int = CHUNK_CHARS, max_ids: int = MAX_IDS,
                 cut: Cut = next_cut) -> None:
        if chunk_chars < 1 or max_ids < 1:
            raise ValueError(f"chunk_chars {chunk_chars} and max_ids {max_ids} must be >= 1")
        self.chunk_chars = chunk_chars
        self.max_ids = max_ids
        self._cut = cut
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()
        self._lock = threading.Lock()
        self.held_ids = 0
        self.counts = {"hits": 0, "misses": 0, "chars_reused": 0, "chars_tokenized": 0,
                       "unaligned": 0, "evicted": 0}

    def __len__(self) -> int:
        return len(self._entries)

    def tokens(self, text: str, encode: Encode) -> tuple[list[int], int]:
        """``text``'s token ids (``encode``'s, without special tokens) and how many of
        its leading characters came from the memo (0: a miss). ``encode`` is called
        once, on the text past the longest memoised prefix, without the lock."""
        cuts = self._cuts(text)
        with self._lock:
            pos, parent, ids = self._longest(cuts)
            self.counts["hits" if pos else "misses"] += 1
            self.counts["chars_reused"] += pos
            self.counts["chars_tokenized"] += len(text) - pos
        rest_ids, offsets = encode(text[pos:])
        with self._lock:
            self._remember(cuts, pos, parent, rest_ids, offsets)
        ids.extend(rest_ids)
        return ids, pos

    def known(self, text: str) -> tuple[list[int], int]:
        """The token ids of ``text``'s longest memoised prefix and its length in
        characters (``([], 0)``: none), without encoding anything: the leading ids of
        ``tokens(text)``. Microseconds a kB (the cuts' digests); not counted."""
        cuts = self._cuts(text)
        with self._lock:
            pos, _, ids = self._longest(cuts)
        return ids, pos

    def clear(self) -> None:
        """Forget every entry (any thread)."""
        with self._lock:
            self._entries.clear()
            self.held_ids = 0

    def _cuts(self, text: str) -> list[tuple[int, bytes]]:
        """Every cut of ``text`` with the digest of the text before it."""
        cuts: list[tuple[int, bytes]] = []
        h = blake2b(digest_size=16)
        last = 0
        while (p := self._cut(text, last, self.chunk_chars)) > 0:
            h.update(text[last:p].encode("utf-8", "surrogatepass"))
            cuts.append((p, h.digest()))
            last = p
        return cuts

    def _longest(self, cuts: list[tuple[int, bytes]]) -> tuple[int, bytes | None, list[int]]:
        """The last cut whose whole chain of entries is held: (its index, its digest,
        the ids before it), each entry of the chain made most recent; (0, None, [])."""
        for p, digest in reversed(cuts):
            chain: list[_Entry] = []
            key: bytes | None = digest
            while key is not None and (entry := self._entries.get(key)) is not None:
                chain.append(entry)
                self._entries.move_to_end(key)
                key = entry.parent
            if chain and key is None:
                ids: list[int] = []
                for entry in reversed(chain):
                    ids.extend(entry.ids)
                return p, digest, ids
        return 0, None, []

    def _remember(self, cuts: list[tuple[int, bytes]], pos: int, parent: bytes | None,
                  ids: Sequence[int], offsets: Sequence[tuple[int, int]]) -> None:
        """Hold the segments of the cuts past ``pos`` that fall on a token boundary of
        the rest's encoding (``ids``, ``offsets`` relative to ``pos``)."""
        starts = [s for s, _ in offsets]
        first = 0
        for p, digest in cuts:
            if p <= pos:
                continue
            rel = p - pos
            k = bisect_left(starts, rel)  # tokens [0, k) start before the cut
            if k < len(starts) and starts[k] < rel or k and offsets[k - 1][1] > rel:
                self.counts["unaligned"] += 1
                continue
            if k - first > self.max_ids:
                return
            self._put(digest, _Entry(parent, array("i", ids[first:k])))
            parent, first = digest, k

    def _put(self, digest: bytes, entry: _Entry) -> None:
        old = self._entries.pop(digest, None)
        if old is not None:
            self.held_ids -= len(old.ids)
        while self._entries and self.held_ids + len(entry.ids) > self.max_ids:
            _, gone = self._entries.popitem(last=False)
            self.held_ids -= len(gone.ids)
            self.counts["evicted"] += 1
        self._entries[digest] = entry
        self.held_ids += len(entry.ids)
