"""The seeded workload of the end-to-end routing benchmark (``serve_routing``): pure
logic, no Ray.

Two kinds of traffic, as text prompts (every router sees the request as a client sends
it; Ray Serve LLM's ``PrefixCacheAffinityRouter`` matches text only):

- multi-turn sessions: turn 0 is the session's own opening text; turn ``k + 1`` is
  turn ``k``'s prompt, then the answer to it, then new user text. The answer is the
  generator's own stand-in text (``answer_words``), not the model's output, so the
  workload is the same for every router whatever the engines generate;
- shared documents: each of ``docs`` long documents asked ``questions`` different
  questions (the document, then the question).

A ``Stream`` is what one client sends in order: a session (its turns, each sent
``think_s`` after the previous one's answer ended) or one question (one request).
Streams start at the times of a Poisson process of ``rate`` streams a second, in a
seeded random order of sessions and questions. Same arguments, same workload.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field


@dataclass(frozen=True)
class WorkloadShape:
    """Sizes in words (random letters: the tiny model's tokenizer makes about 5 tokens
    of each); ``rate``: streams a second; ``think_s``: mean seconds between an answer
    and a session's next turn; ``lexicon``: distinct words."""

    sessions: int = 12
    turns: int = 5
    opening_words: int = 100
    user_words: int = 40
    answer_words: int = 8
    docs: int = 3
    doc_words: int = 300
    questions: int = 16
    question_words: int = 10
    rate: float = 0.8
    think_s: float = 1.0
    lexicon: int = 3000

    def __post_init__(self) -> None:
        for name in ("sessions", "turns", "opening_words", "user_words", "answer_words",
                     "docs", "doc_words", "questions", "question_words", "lexicon"):
            value = getattr(self, name)
            least = 0 if name in ("sessions", "docs") else 1
            if type(value) is not int or value < least:
                raise ValueError(f"{name} must be an int >= {least}, got {value!r}")
        if self.sessions + self.docs == 0:
            raise ValueError("no sessions and no documents: an empty workload")
        if not self.rate > 0 or not self.think_s >= 0:
            raise ValueError(f"rate must be > 0 and think_s >= 0, got {self.rate}, "
                             f"{self.think_s}")


@dataclass(frozen=True)
class Stream:
    """One client's requests, sent in order: ``prompts[i]`` once ``think_s[i]`` seconds
    passed after the answer to ``prompts[i - 1]`` (``think_s[0]`` is 0); the first at
    ``start_s`` seconds after the run starts. ``name``: ``s<i>`` (session) or
    ``d<j>q<k>`` (question ``k`` on document ``j``)."""

    name: str
    start_s: float
    prompts: list[str]
    think_s: list[float] = field(default_factory=list)

    @property
    def kind(self) -> str:
        return "session" if self.name.startswith("s") else "question"


def _lexicon(rng: random.Random, size: int) -> list[str]:
    letters = "abcdefghijklmnopqrstuvwxyz"
    return ["".join(rng.choice(letters) for _ in range(rng.randint(3, 8)))
            for _ in range(size)]


def _text(rng: random.Random, words: list[str], n: int) -> str:
    """``n`` words, each after a space: texts join without changing each other's words."""
    return "".join(" " + rng.choice(words) for _ in range(n))


def workload(shape: WorkloadShape, seed: int) -> list[Stream]:
    """The streams of ``shape`` for ``seed``, by start time."""
    rng = random.Random(seed)
    words = _lexicon(rng, shape.lexicon)
    bodies: list[tuple[str, list[str], list[float]]] = []
    for i in range(shape.sessions):
        prompt = f"Session {i}." + _text(rng, words, shape.opening_words)
        prompts, think = [prompt], [0.0]
        for _ in range(shape.turns - 1):
            prompt += ("\nAnswer:" + _text(rng, words, shape.answer_words)
                       + "\nUser:" + _text(rng, words, shape.user_words))
            prompts.append(prompt)
            think.append(rng.expovariate(1 / shape.think_s) if shape.think_s else 0.0)
        bodies.append((f"s{i}", prompts, think))
    for j in range(shape.docs):
        doc = f"Document {j}." + _text(rng, words, shape.doc_words)
        for k in range(shape.questions):
            question = f"\nQuestion {k}:" + _text(rng, words, shape.question_words)
            bodies.append((f"d{j}q{k}", [doc + question], [0.0]))
    rng.shuffle(bodies)
    t, streams = 0.0, []
    for name, prompts, think in bodies:
        streams.append(Stream(name, t, prompts, think))
        t += rng.expovariate(shape.rate)
    return streams


def computed_floor(prompts: list[list[int]], block: int) -> int:
    """The fewest prompt tokens any router and cache can leave to compute for
    ``prompts`` (token ids) with ``block``-token blocks: every distinct chain of full
    blocks computed once, by whichever request comes first, and each request's tokens
    after its last full block (its last token when it ends on a block boundary), which
    no block cache holds. Independent of order and timing."""
    if block < 1:
        raise ValueError(f"block must be >= 1, got {block}")
    chains: dict[tuple[int, tuple[int, ...]], int] = {}  # (parent, block) -> chain id
    tails = 0
    for tokens in prompts:
        full, parent = len(tokens) // block, -1
        for i in range(full):
            parent = chains.setdefault((parent, tuple(tokens[i * block:(i + 1) * block])),
                                       len(chains))
        tails += len(tokens) - full * block or (1 if tokens else 0)
    return len(chains) * block + tails
