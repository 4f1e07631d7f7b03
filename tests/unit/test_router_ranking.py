"""Ranking replicas by residency (pure), a request's token ids, and the router's keys
against the connector's key scheme."""

import math
from types import SimpleNamespace

import pytest
from raykv.controllers.contract import PoolName
from raykv.controllers.keys import KeyScheme
from raykv.controllers.residency import Residency
from raykv.integrations.serve.prompt_tokens import PromptTokens
from raykv.integrations.serve.ranking import Credit, Weights, held, rank, spread
from raykv.integrations.serve.route_keys import RouteKeys, RouteOptions
from raykv.integrations.serve.sent_keys import RecentRoutes, RoutedKeys
from raykv.integrations.vllm.page_hash import PageHashChain, no_extra_keys

W = Weights()


def answer(node: str, l2: int = 0, seg: int = 0, l3: int = 0, pages: int = 10) -> Residency:
    return Residency(node, pages, l2, seg, l3)


def ranked(answers, queues=None, nodes=("a", "b", "c"), engine=None, w=W):
    queues, engine = queues or {}, engine or {}
    return rank(list(nodes), lambda r: r, {a.node_id: a for a in answers},
                lambda r: queues.get(r), w, lambda r: engine.get(r, 0))


def test_the_nearest_tier_wins_then_the_rest_by_value():
    got = ranked([answer("a", l3=10), answer("b", seg=10, l3=10), answer("c", l2=10, l3=10)])
    assert got == [["c"], ["b", "a"]]
    assert held(answer("x", l2=5, seg=10, l3=10), W) == pytest.approx(0.8)  # best tier


def test_a_long_queue_outweighs_a_small_gain():
    answers = [answer("a", l2=1, l3=1), answer("b"), answer("c")]
    assert ranked(answers)[0] == ["a"]
    first, rest = ranked(answers, {"a": 2})  # 2 queued cost 0.2, a's page is worth 0.1
    assert set(first) == {"b", "c"} and rest == ["a"]


def test_what_the_router_sent_a_replica_lately_outranks_its_nodes_tiers():
    """Replicas x and y share node a, which holds the request in L2; x was sent it."""
    answers = [answer("a", l2=10), answer("b", l3=10)]
    got = rank(["x", "y", "z"], {"x": "a", "y": "a", "z": "b"}.get,
               {a.node_id: a for a in answers}, lambda r: None, W,
               lambda r: {"x": 10}.get(r, 0))
    assert got == [["x"], ["y", "z"]]
    # CONTROL: without the engine tier, x and y are worth the same
    assert rank(["x", "y", "z"], {"x": "a", "y": "a", "z": "b"}.get,
                {a.node_id: a for a in answers}, lambda r: None, W)[0] == ["x", "y"]


def test_a_replica_queued_beyond_the_gap_is_not_first_while_others_can_load_it():
    answers = [answer("a", l2=10, l3=10), answer("b", l3=10), answer("c", l3=10)]
    assert ranked(answers, {"a": 2})[0] == ["a"]  # within the gap: the nearest tier wins
    first, rest = ranked(answers, {"a": 3})  # 3 beyond the shortest (0) > gap 2
    assert set(first) == {"b", "c"} and rest == ["a"]
    # CONTROL: a wider gap lets the L2 hit win, the queue's cost (0.3) below its worth
    assert ranked(answers, {"a": 3}, w=Weights(max_queue_gap=5))[0] == ["a"]


def test_a_prefix_only_the_queued_replica_has_stays_with_it():
    """x is computing the prefix (the engine tier; no node holds it yet) and is queued
    beyond the gap: y and z would compute it again, so it stays with x. Once y's node
    holds it in L2, y can load it and takes it."""
    nodes = {"x": "a", "y": "b", "z": "c"}.get
    empty = {n: answer(n) for n in "abc"}
    got = rank(["x", "y", "z"], nodes, empty, {"x": 3}.get, W,
               lambda r: {"x": 10}.get(r, 0))
    assert got[0] == ["x"]
    loaded = empty | {"b": answer("b", l2=10)}
    got = rank(["x", "y", "z"], nodes, loaded, {"x": 3}.get, W,
               lambda r: {"x": 10}.get(r, 0))
    assert got[0] == ["y"]


def test_a_node_that_would_load_slowly_ranks_as_if_it_held_less():
    """Both nodes hold the request on other segments (L3); a's links are slow: a page
    of 1 MiB takes 0.2 s to load there against 0.1 s to compute, so the guard would
    recompute it and a holds nothing worth loading; b loads it in 10 ms."""
    credit = Credit(page_bytes=1 << 20, prefill_page_s=0.1)
    worth = {"a": credit.worth({"l3": 0.2, "segment": 0.001}),
             "b": credit.worth({"l3": 0.01})}
    assert worth["a"]["l3"] == 0.0 and worth["b"]["l3"] == pytest.approx(1 - 1.1 * 0.1)
    answers = {"a": answer("a", l3=10), "b": answer("b", l3=6)}
    got = rank(["a", "b"], lambda r: r, answers, lambda r: None, W, worth=worth)
    assert got == [["b"], ["a"]]
    # CONTROL: without the credit, a holds more and ranks first
    assert rank(["a", "b"], lambda r: r, answers, lambda r: None, W) == [["a"], ["b"]]
    # its own segment is fast: what a holds there still counts in full
    assert held(answer("a", seg=10, l3=10), W, 0, worth["a"]) == pytest.approx(
        0.8 * (1 - 1.1 * 0.001 / 0.1))
    assert Credit(1 << 20, 0.1).worth({}) == {}  # no estimate: no credit


def test_the_credit_needs_page_bytes_and_prefill_speed_together():
    base = {"model_name": "m", "block_size": 16}
    for bad in ({"page_bytes": 1 << 20}, {"prefill_tokens_per_s": 1e4},
                {"page_bytes": 0, "prefill_tokens_per_s": 1e4},
                {"page_bytes": 1 << 20, "prefill_tokens_per_s": math.inf}):
        with pytest.raises(ValueError, match="go together"):
            RouteOptions.parse(base | bad)
    opts = RouteOptions.parse(base | {"page_bytes": 1 << 20, "prefill_tokens_per_s": 1e4})
    assert (opts.page_bytes, opts.prefill_tokens_per_s) == (1 << 20, 1e4)


def test_routed_keys_count_leading_pages_and_forget_the_oldest():
    r = RoutedKeys(capacity=6)
    r.routed("x", ["k0", "k1", "k2", "k3"])
    assert r.pages("x", ["k0", "k1", "k2", "k9"], per_page=1) == 3
    assert r.pages("x", ["k0", "k1", "k2", "k3"], per_page=2) == 2
    assert r.pages("x", ["k1"], per_page=1) == 1 and r.pages("y", ["k0"], per_page=1) == 0
    r.routed("x", ["k0", "k5", "k6", "k7"])  # k0 routed again: newest; k1, k2 forgotten
    assert r.pages("x", ["k0", "k1"], per_page=1) == 1
    assert r.pages("x", ["k3", "k0", "k5", "k6", "k7"], per_page=1) == 5
    r.keep_only(["y"])
    assert r.pages("x", ["k0"], per_page=1) == 0
    off = RoutedKeys(capacity=0)
    off.routed("x", ["k0"])
    assert off.pages("x", ["k0"], per_page=1) == 0
    with pytest.raises(ValueError):
        RoutedKeys(capacity=-1)


def test_no_difference_or_a_missing_answer_means_power_of_two():
    assert ranked([answer("a", l3=10), answer("b", l3=10), answer("c", l3=10)]) is None
    assert ranked([answer("a", l2=10), answer("b")]) is None  # c did not answer
    assert ranked([], nodes=()) is None


def test_router_keys_are_the_connectors():
    opts = RouteOptions.parse({"model_name": "org/m", "block_size": 4, "tp_size": 2})
    keys = RouteKeys(opts)
    toks = list(range(3, 20))  # 17 tokens: 4 loadable blocks
    chain = PageHashChain(4).extend(toks, 16, no_extra_keys)
    want = []
    for h in chain:
        for r in range(2):
            scheme = KeyScheme.from_config(keys.configs[r])
            want += scheme.pool_keys(PoolName.KV, "vllm", ["kv"], h.hex())
    assert keys.keys(toks) == want and keys.per_page == 2
    assert want[0].startswith("vllm-tp2-bfloat16-b4-cpu.cpu-attn.lm1_org-m_")
    assert keys.keys(toks[:3]) == []  # no block an engine could load
    assert keys.keys(toks[:4]) == want[:2]  # a whole block: it loads, its last token computed
    # the memo: a second request sharing the first 3 blocks gets the same keys for
    # them and its own for the fourth, whichever request came first, and full, it
    # starts over
    other = toks[:12] + [99] * 5
    fresh = RouteKeys(opts).keys(other)
    assert keys.keys(other) == fresh and fresh[:6] == want[:6] and fresh[6:] != want[6:]
    assert keys.keys(toks) == want  # CONTROL: the memo did not change the first one's
    small = RouteKeys(opts)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("raykv.integrations.serve.route_keys.MEMO_BLOCKS", 3)
        assert small.keys(toks) == want and len(small._memo) == 1


def test_router_options_refuse_what_they_do_not_know():
    with pytest.raises(ValueError, match="unknown request_router_kwargs"):
        RouteOptions.parse({"model_name": "m", "block_size": 4, "blok_size": 4})
    with pytest.raises(ValueError, match="need model_name and block_size"):
        RouteOptions.parse({"model_name": "m"})
    with pytest.raises(ValueError, match="must be >= 1"):
        RouteOptions.parse({"model_name": "m", "block_size": 0})
    for bad in ({"max_queue_gap": -1}, {"keys_wait_ms": -1.0}, {"keys_wait_ms": math.inf},
                {"keys_wait_ms": math.nan}):
        with pytest.raises(ValueError, match="keys_wait_ms >= 0"):
            RouteOptions.parse({"model_name": "m", "block_size": 4} | bad)
    assert RouteOptions.parse({"model_name": "m", "block_size": 4,
                               "keys_wait_ms": 0}).keys_wait_ms == 0


def test_router_names_the_engines_attention_backend():
    """On CPU the router keys blocks as the connector does by default (vLLM's only CPU
    backend, CPU_ATTN); on a device with several it needs the engines' backend (or their
    tag) and names it as the connector does. Control: without it, refused."""
    base = {"model_name": "m", "block_size": 4}
    cpu = RouteOptions.parse(base).connector_options()
    assert cpu.identity.layout == "cpu.cpu-attn.lm1"
    cuda = RouteOptions.parse(base | {"device": "cuda", "attention_backend": "FLASH_ATTN"})
    assert cuda.connector_options().extra_backend_tag == "vllm-tp1-bfloat16-b4-cuda.flash-attn.lm1"
    assert RouteOptions.parse(base | {"device": "cuda", "extra_backend_tag": "t"}) \
        .connector_options().extra_backend_tag == "t"
    with pytest.raises(ValueError, match="give attention_backend"):
        RouteOptions.parse(base | {"device": "cuda"})


class FakeTokenizer:
    def encode(self, text):
        return [len(w) for w in text.split()]

    def apply_chat_template(self, chat, add_generation_prompt, tokenize, return_dict):
        assert add_generation_prompt and tokenize and not return_dict
        return [99] + [len(m["content"]) for m in chat]


def test_prompt_tokens_of_each_request_shape():
    t = PromptTokens(None)
    assert t.of([], {"request_token_ids": [5, 6]}) == [5, 6]  # direct streaming
    assert t.of([SimpleNamespace(prompt=[1, 2, 3])], {}) == [1, 2, 3]
    assert t.of([SimpleNamespace(prompt="hello there")], {}) is None  # no tokenizer yet
    t._tokenizer = FakeTokenizer()
    assert t.of([SimpleNamespace(prompt="hello there")], {}) == [5, 5]
    msgs = [SimpleNamespace(model_dump=lambda exclude_none: {"role": "user",
                                                             "content": "abc"})]
    assert t.of([SimpleNamespace(prompt=None, messages=msgs)], {}) == [99, 3]
    assert t.of([SimpleNamespace(prompt=[True, 2])], {}) is None  # not token ids
    # what the request carries, without the tokenizer (the router's event loop asks it)
    assert t.given([], {"request_token_ids": [5, 6]}) == [5, 6]
    assert t.given([SimpleNamespace(prompt=[1, 2, 3])], {}) == [1, 2, 3]
    assert t.given([SimpleNamespace(prompt="hello there")], {}) is None  # CONTROL: text


def test_a_new_prefix_goes_to_the_replicas_sent_the_fewest_lately():
    recent = RecentRoutes(window=4)
    for replica in ("x", "x", "y"):
        recent.routed(replica)
    idle = {}.get
    assert spread(["x", "y", "z"], recent.count, idle) == [["z"], ["y", "x"]]
    recent.routed("z")
    assert spread(["x", "y", "z"], recent.count, idle) == [["y", "z"], ["x"]]
    # a queue comes first: z is busy, so x (sent more) goes before it
    assert spread(["x", "y", "z"], recent.count, {"y": 1, "z": 1}.get) == [["x"], ["y", "z"]]
    recent.routed("y")  # the window holds 4: the first "x" is forgotten
    assert [recent.count(r) for r in "xyz"] == [1, 2, 1]
    assert recent.counts() == {"x": 1, "y": 2, "z": 1}
    assert spread(["x", "z"], recent.count, idle) == [["x", "z"]]  # equal: one group
    recent.keep_only(["y"])
    assert [recent.count(r) for r in "xyz"] == [0, 2, 0]
    with pytest.raises(ValueError):
        RecentRoutes(window=0)


def test_new_prefixes_spread_evenly_over_idle_replicas():
    """Twelve new prefixes (conversations that later turns follow) over four idle
    replicas, each taking the first of the first group: three each. CONTROL: with
    nothing recorded (every replica sent 0) the same choice sends all twelve to one."""
    for record in (True, False):
        recent, got = RecentRoutes(window=64), []
        for _ in range(12):
            replica = spread(["a", "b", "c", "d"], recent.count, {}.get)[0][0]
            if record:
                recent.routed(replica)
            got.append(replica)
        counts = sorted(got.count(r) for r in "abcd")
        assert counts == ([3, 3, 3, 3] if record else [0, 0, 0, 12])
