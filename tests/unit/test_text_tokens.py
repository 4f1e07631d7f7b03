"""The router's prefix memo of text tokenization: exact against the plain tokenization
of the demo's real tokenizer (and of other pre-tokenizers), bounded, and guarded by a
self-test and a sampled check (each with a control that makes it fire)."""

from __future__ import annotations

import random
import threading
import time
from types import SimpleNamespace

import pytest
from raykv.integrations.serve.prompt_tokens import PromptTokens
from raykv.integrations.serve.text_memo import PrefixMemo, next_cut
from raykv.integrations.serve.text_tokens import TextTokens

pytestmark = pytest.mark.engine("transformers")

CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n"
                 "{% endfor %}{% if add_generation_prompt %}<s>assistant\n{% endif %}")
_WORDS = ("the of and to in is it you that he was for on are with as his they at be this "
         "from have or by one had not but what all were when we there can an your which "
         "their said if do will each about how up out them then she many some so these "
         "café naïve Straße 東京 Привет mir x2 3.14 don't it's def return self None "
         "<s> </s> <pad>")
WORDS = _WORDS.split()
SEPS = [" ", " ", " ", " ", "  ", "\n", "\n\n", "\t", ", ", ". ", " (", ") ", "   ", ""]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    from raykv_lab.engines.vllm_model import make_llama

    return make_llama(str(tmp_path_factory.mktemp("textmemo") / "tiny-llama"))


@pytest.fixture
def tok(model_dir):
    """The demo model's byte-level BPE tokenizer (fresh per test), with a chat template."""
    from transformers import AutoTokenizer

    t = AutoTokenizer.from_pretrained(model_dir)
    t.chat_template = CHAT_TEMPLATE
    return t


def text(rng: random.Random, words: int) -> str:
    return "".join(rng.choice(WORDS) + rng.choice(SEPS) for _ in range(words))


def settled(tt: TextTokens) -> None:
    assert tt.settled(30), "the sampled checks did not finish in 30 s"


@pytest.mark.parametrize("chunk_chars", [16, 1024])
def test_documents_and_questions_tokenize_as_plain(tok, chunk_chars):
    rng = random.Random(chunk_chars)
    tt = TextTokens(tok, chunk_chars=chunk_chars, check_every=1)
    assert tt.off is None
    docs = [text(rng, 3000), text(rng, 200), "  " + text(rng, 400)]
    prompts = [d + q for d in docs for q in
               ["", "?", " Question: " + text(rng, 12), "\n\n<s>" + text(rng, 30), "  "]]
    prompts += ["", "a", " ", "<s>", "東京", " x y"]
    for p in prompts + prompts[::-1]:
        assert tt.completion(p) == tok.encode(p), p[-40:]
    settled(tt)
    s = tt.stats()
    assert s["hits"] >= 9 and s["chars_reused"] > 0 and s["mismatches"] == 0  # the long doc
    assert s["checks"] + s["check_skipped"] == s["hits"] and tt.off is None


def test_growing_conversations_tokenize_as_the_chat_template(tok):
    rng = random.Random(7)
    tt = TextTokens(tok, chunk_chars=64)
    assert tt.off is None
    for _ in range(3):
        chat = [{"role": "system", "content": text(rng, 40)}]
        for turn in range(6):
            chat.append({"role": "user", "content": text(rng, rng.randint(0, 80))})
            want = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True,
                                           return_dict=False)
            rendered = tok.apply_chat_template(chat, add_generation_prompt=True,
                                               tokenize=False)
            assert tok.encode(rendered, add_special_tokens=False) == want
            assert tt.chat(chat) == want
            chat.append({"role": "assistant", "content": text(rng, 20) + f" turn {turn}"})
    assert tt.stats()["hits"] >= 15


def test_prompt_tokens_reads_text_and_chat_through_the_memo(model_dir, tok):
    """Through the router's ``PromptTokens``: the memo's ids are the plain ones, and
    without the memo (``memo_ids=0``) a chat's ids are ids too (transformers 5 returns
    a mapping from ``apply_chat_template(tokenize=True)``)."""
    msgs = [SimpleNamespace(model_dump=lambda exclude_none: {"role": "user",
                                                             "content": "hello there"})]
    for memo_ids in (1 << 20, 0):
        t = PromptTokens(model_dir, memo_ids)
        deadline = time.monotonic() + 60
        while not t.ready and t.failed is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert t.ready, t.failed
        assert (t.text is not None) == bool(memo_ids)
        assert (t.text_stats().get("off", "no memo") is None) == bool(memo_ids)
        t._tokenizer.chat_template = CHAT_TEMPLATE  # the demo model has none
        assert t.of([SimpleNamespace(prompt="a b " * 300)], {}) == tok.encode("a b " * 300)
        got = t.of([SimpleNamespace(prompt=None, messages=msgs)], {})
        assert got == tok.apply_chat_template([{"role": "user", "content": "hello there"}],
                                              add_generation_prompt=True, tokenize=True,
                                              return_dict=False)
        assert all(isinstance(i, int) for i in got)
        assert t.text_stats().get("misses", 2) == 2  # both through the memo, if on


LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?"
                r"[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def other_tokenizer(kind: str):
    """A small tokenizer of another family, trained here in milliseconds."""
    from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = [text(random.Random(i), 200) for i in range(20)]
    if kind == "wordpiece":  # BERT's
        t = Tokenizer(models.WordPiece(unk_token="[UNK]"))
        t.normalizer = normalizers.BertNormalizer(lowercase=True)
        t.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        trainer = trainers.WordPieceTrainer(vocab_size=400,
                                            special_tokens=["[UNK]", "<s>", "</s>"])
    else:
        t = Tokenizer(models.BPE(unk_token=None, byte_fallback="meta" in kind))
        if kind == "metaspace_normalizer":  # Llama-2's and Mistral's (legacy) fast ones
            t.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"),
                                                 normalizers.Replace(" ", "\u2581")])
        t.pre_tokenizer = None if kind == "metaspace_normalizer" else {
            "llama3": pre_tokenizers.Sequence([
                pre_tokenizers.Split(Regex(LLAMA3_SPLIT), "isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]),
            "metaspace": pre_tokenizers.Metaspace(prepend_scheme="first"),  # SentencePiece's
            "prefix_space": pre_tokenizers.ByteLevel(add_prefix_space=True),
        }[kind]
        trainer = trainers.BpeTrainer(
            vocab_size=400, special_tokens=["<s>", "</s>"],
            initial_alphabet=[] if "meta" in kind else pre_tokenizers.ByteLevel.alphabet())
    t.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=t, bos_token="<s>", eos_token="</s>")


@pytest.mark.parametrize("kind, on", [("llama3", True), ("metaspace", True),
                                      ("prefix_space", True), ("wordpiece", True),
                                      ("metaspace_normalizer", False)])
def test_other_tokenizer_families_are_exact_or_off(kind, on):
    """What holds beyond byte-level BPE (tokenizers 0.23): where the self-test lets the
    memo on, it is exact on random texts; a normalizer that prepends to every text (the
    rest would get it too) turns it off."""
    t = other_tokenizer(kind)
    tt = TextTokens(t, chunk_chars=32)
    rng = random.Random(kind)
    doc = text(rng, 400)
    for p in [doc + text(rng, 10) for _ in range(10)] + [" " + doc, doc[:37]]:
        assert tt.completion(p) == t.encode(p)
    assert (tt.off is None) == on, tt.off
    assert (tt.stats()["hits"] >= 9) == on


def anywhere(text: str, start: int, chunk_chars: int) -> int:
    """An unsafe cut rule: anywhere, inside words too."""
    p = start + chunk_chars
    return p if p < len(text) else -1


def test_control_an_unsafe_cut_rule_is_caught_by_the_self_test(tok, caplog):
    tt = TextTokens(tok, cut=anywhere)
    assert tt.off is not None and "self-test found a mismatch" in tt.off
    assert "memo is off" in caplog.text
    p = text(random.Random(1), 500)
    assert tt.completion(p) == tok.encode(p) and tt.completion(p) == tok.encode(p)
    assert tt.stats()["hits"] == tt.stats()["misses"] == 0  # plain, no memo


def test_control_the_sampled_check_catches_a_wrong_entry(tok, caplog):
    tt = TextTokens(tok, chunk_chars=64, check_every=1)
    doc = text(random.Random(2), 300)
    tt.completion(doc + " first?")
    entry = next(iter(tt.memo._entries.values()))
    entry.ids[0] = (entry.ids[0] + 1) % 2048  # injected: a wrong memo entry
    wrong = tt.completion(doc + " second?")
    assert wrong != tok.encode(doc + " second?")  # the memo served it
    settled(tt)
    assert tt.stats()["mismatches"] == 1 and "sampled check found a mismatch" in tt.off
    assert tt.stats()["held_ids"] == len(tt.memo) == 0  # emptied
    assert "memo is off" in caplog.text
    assert tt.completion(doc + " third?") == tok.encode(doc + " third?")


def test_a_busy_checker_skips_checks(tok):
    tt = TextTokens(tok, chunk_chars=64, check_every=1)
    release = threading.Event()
    plain = tt._checker_tok.encode

    def slow(text, **kw):
        assert release.wait(30)
        return plain(text, **kw)

    tt._checker_tok = SimpleNamespace(encode=slow)
    doc = text(random.Random(3), 200)
    for q in range(5):
        tt.completion(doc + f" question {q}?")
    assert tt.stats()["check_skipped"] >= 2  # one checking, one queued at most
    release.set()
    settled(tt)
    s = tt.stats()
    assert s["checks"] + s["check_skipped"] == s["hits"] == 4 and tt.off is None


def spaces(text: str):
    """A fake encoding for pure memo tests: one token per word, with its spaces before
    it (id: the word's length), and offsets."""
    ids, offsets, start = [], [], 0
    for i in range(1, len(text) + 1):
        if i == len(text) or text[i] == " " and text[i - 1] != " ":
            ids.append(i - start)
            offsets.append((start, i))
            start = i
    return ids, offsets


def test_the_memo_holds_at_most_max_ids_least_recently_used_first():
    memo = PrefixMemo(chunk_chars=8, max_ids=40)
    docs = [" ".join(f"w{d}x{i}" for i in range(30)) for d in range(4)]
    for d in docs:
        ids, reused = memo.tokens(d, spaces)
        assert ids == spaces(d)[0] and reused == 0
        assert memo.held_ids <= 40
    assert memo.counts["evicted"] > 0
    assert memo.tokens(docs[-1] + " more", spaces)[1] > 0  # the latest is held
    assert memo.tokens(docs[0] + " more", spaces)[1] == 0  # the oldest was evicted
    tiny = PrefixMemo(chunk_chars=8, max_ids=1)
    tiny.tokens(docs[0], spaces)  # every segment holds more than one id
    assert len(tiny) == 0 and tiny.held_ids == 0


def test_cuts_depend_on_the_text_before_them_and_fall_before_a_word():
    a = "one two  three, four (five) six seven eight nine ten"
    b = a[:30] + "XX different ending here"
    cut_a = [p for p in _cuts(a, 5)]
    assert [p for p in _cuts(b, 5) if p < 29] == [p for p in cut_a if p < 29]
    for p in cut_a:
        assert a[p] == " " and a[p - 1] != " " and a[p + 1].isalpha()
    assert next_cut("no-cut-here", 0, 1) == -1 and next_cut("a 1 2 3", 0, 1) == -1


def _cuts(text: str, chunk: int):
    p = 0
    while (p := next_cut(text, p, chunk)) > 0:
        yield p


def recording(seen: list[str]):
    """``spaces``, recording each text it encodes in ``seen``."""
    def encode(t):
        seen.append(t)
        return spaces(t)
    return encode


def test_a_hit_reuses_the_shared_prefix_and_encodes_only_the_rest():
    memo = PrefixMemo(chunk_chars=8)
    seen: list[str] = []
    encode = recording(seen)
    doc = " ".join(f"word{i}" for i in range(40))
    memo.tokens(doc + " alpha", encode)
    ids, reused = memo.tokens(doc + " beta gamma", encode)
    assert ids == spaces(doc + " beta gamma")[0] and reused > len(doc) - 16
    assert len(seen[-1]) < 30 and memo.counts["hits"] == 1


def test_known_gives_the_memoised_leading_ids_without_encoding():
    memo = PrefixMemo(chunk_chars=8)
    calls: list[str] = []
    encode = recording(calls)
    doc = " ".join(f"word{i}" for i in range(40))
    assert memo.known(doc + " alpha") == ([], 0)  # nothing held yet
    memo.tokens(doc + " alpha", encode)
    calls.clear()
    counts = dict(memo.counts)
    ids, pos = memo.known(doc + " beta gamma")
    whole = spaces(doc + " beta gamma")[0]
    assert pos > len(doc) - 16 and ids == whole[:len(ids)] and len(ids) < len(whole)
    assert calls == [] and memo.counts == counts  # nothing encoded, nothing counted


def test_known_runs_while_a_tokenization_is_encoding():
    """``known`` on another thread does not wait for ``tokens``' encoding (the router's
    event loop asks while its keys thread tokenizes). Control: holding the lock across
    the encode, as the memo once did, fails this."""
    memo = PrefixMemo(chunk_chars=8)
    doc = " ".join(f"word{i}" for i in range(40))
    memo.tokens(doc, spaces)
    held, release = threading.Event(), threading.Event()

    def slow(t):
        held.set()
        assert release.wait(10)
        return spaces(t)

    worker = threading.Thread(target=memo.tokens, args=(doc + " new text here", slow))
    worker.start()
    try:
        assert held.wait(10)
        got: list = []
        asker = threading.Thread(target=lambda: got.append(memo.known(doc + " other")))
        asker.start()
        asker.join(5)
        assert got and got[0][1] > 0, "known waited for the encode"
    finally:
        release.set()
        worker.join(10)


@pytest.mark.parametrize("holding", [False, True], ids=["memo", "control_encode"])
def test_a_long_tokenization_lets_other_threads_run(tok, holding):
    """While the memo's tokenizer runs on the router's keys thread it leaves the GIL to
    the router's event loop (the backend's ``encode_batch``): a thread sleeping 0.5 ms
    at a time runs many times during it. Control: the backend's ``encode``, which
    holds the GIL, lets it run at most at its edges."""
    tt = TextTokens(tok)
    assert tt.off is None
    real = tt._encode
    encoding = threading.Event()

    def timed(t):
        encoding.set()
        try:
            if holding:
                e = tt._backend.encode(t, add_special_tokens=False)
                encoding.clear()  # the ids' conversion below may hand the GIL over
                return e.ids, e.offsets
            return real(t)
        finally:
            encoding.clear()

    tt._encode = timed
    long = text(random.Random(3), 60000)
    done = threading.Event()
    worker = threading.Thread(target=lambda: (tt.completion(long), done.set()))
    ran = 0
    worker.start()
    while not done.is_set():
        time.sleep(0.0005)
        ran += encoding.is_set()
    worker.join()
    assert (ran <= 5) if holding else (ran >= 20), ran  # control: its edges, a few times


def test_text_tokens_known_is_the_head_of_completion_and_chat(tok):
    rng = random.Random(11)
    tt = TextTokens(tok, chunk_chars=64)
    doc = text(rng, 400)
    assert tt.known_completion(doc + " Question one?") == []
    tt.completion(doc + " Question one?")
    head = tt.known_completion(doc + " Question two?")
    want = tok.encode(doc + " Question two?")
    assert len(head) > len(want) // 2 and want[:len(head)] == head
    chat = [{"role": "system", "content": doc}, {"role": "user", "content": "Hi?"}]
    assert tt.known_chat(chat) == []
    tt.chat(chat)
    later = chat + [{"role": "assistant", "content": "Hello."},
                    {"role": "user", "content": "And?"}]
    head = tt.known_chat(later)
    want = tok.apply_chat_template(later, add_generation_prompt=True, tokenize=True,
                                   return_dict=False)
    assert len(head) > len(want) // 2 and want[:len(head)] == head
    tt.off = "turned off"  # off: nothing known
    assert tt.known_completion(doc + " Question two?") == [] and tt.known_chat(later) == []


def test_the_bench_measures_plain_and_memo_on_both_workloads(model_dir):
    from raykv_lab.bench.text_memo import run

    out = run(model_dir, doc_words=300, questions=4, sessions=2, turns=3, opening_words=200)
    for kind, prompts in (("documents", 4), ("sessions", 6)):
        got = out[kind]
        assert got["prompts"] == prompts and got["plain"]["calls"] == prompts
        assert got["memo_hits"]["calls"] == got["counts"]["hits"] >= prompts - 2
        assert got["counts"]["mismatches"] == 0


def test_the_documented_defaults(tok):
    """What docs/engines.md says: cuts about every 256 characters, 4 Mi ids at most
    (the router's ``text_memo_ids``), one hit in 64 checked."""
    from raykv.integrations.serve.route_keys import RouteOptions

    assert RouteOptions.parse({"model_name": "m", "block_size": 16}).text_memo_ids == 4 << 20
    tt = TextTokens(tok)
    assert (tt.memo.chunk_chars, tt.memo.max_ids) == (256, 4 << 20)
    doc = text(random.Random(4), 400)
    for q in range(129):
        tt.completion(doc + f" q{q}")
    settled(tt)
    s = tt.stats()
    assert s["hits"] == 128 and s["checks"] + s["check_skipped"] == 2


def test_added_tokens_that_strip_whitespace_stay_exact(tok):
    """An added token that takes the spaces around it (``rstrip``/``lstrip``) or matches
    whole words only: the cut after it has no token starting there (its offsets cover
    the space), so it is skipped (``unaligned``), and the ids stay exact."""
    from transformers import AddedToken

    tok.add_tokens([AddedToken("<r>", rstrip=True, lstrip=True, special=True),
                    AddedToken("Zed", rstrip=True, lstrip=True, special=True),
                    AddedToken("Wo", single_word=True)])
    tt = TextTokens(tok, chunk_chars=4)
    assert tt.off is None
    parts = ["Zed", " Zed", "Zed ", " word", "<r>", " <r> ", "x", "  ", " y", " Wo", "Wo ",
             " Wow"]
    for i in range(100):
        rng = random.Random(i)
        t = "".join(rng.choice(parts) for _ in range(40))
        tt.completion(t)
        assert tt.completion(t + " more words") == tok.encode(t + " more words"), t
    assert tt.stats()["unaligned"] > 0 and tt.stats()["hits"] > 50
