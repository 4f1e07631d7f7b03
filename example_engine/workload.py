"""A multi-turn chat workload in token ids (seeded random tokens stand in for text).

Every session starts with the same long system prompt; turn ``t`` of a session sends the
whole conversation so far (system prompt, earlier user messages and the engine's
replies) plus a new user message. Requests go turn by turn, session by session, and
session ``s``'s turn ``t`` is routed to node ``(s + t) % nodes``: consecutive turns of a
session, and sessions sharing the system prompt, land on different nodes, so reuse
crosses nodes.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class ChatWorkload:
    """``sessions`` x ``turns`` requests; lengths in tokens; ``reply_tokens`` are
    decoded per turn and become part of the session's history."""

    sessions: int = 4
    turns: int = 3
    system_tokens: int = 1024
    user_tokens: int = 64
    reply_tokens: int = 16
    vocab: int = 512
    seed: int = 0

    def _ids(self, n: int, *where) -> list[int]:
        rng = random.Random(f"{self.seed}/{'/'.join(map(str, where))}")
        return [rng.randrange(self.vocab) for _ in range(n)]

    def system_prompt(self) -> list[int]:
        return self._ids(self.system_tokens, "system")

    def user_message(self, session: int, turn: int) -> list[int]:
        return self._ids(self.user_tokens, "user", session, turn)

    def schedule(self, nodes: int) -> Iterator[tuple[int, int, int]]:
        """``(session, turn, node index)`` in request order."""
        for turn in range(self.turns):
            for session in range(self.sessions):
                yield session, turn, (session + turn) % nodes
