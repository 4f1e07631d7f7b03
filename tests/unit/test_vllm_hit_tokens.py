"""The scheduler side counts a lookup's tokens: those it asked raykv about (full blocks
past vLLM's own prefix cache) and those it tells vLLM to load, by the tier the lookup
found them in, one token left to compute."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="the connector's scheduler side imports vLLM")
from raykv.integrations.vllm.options import ConnectorOptions, KVIdentity  # noqa: E402
from raykv.integrations.vllm.request_blocks import RequestBlocks  # noqa: E402
from raykv.integrations.vllm.scheduler import RayKVConnectorScheduler  # noqa: E402


@pytest.fixture
def side():
    opts = ConnectorOptions.parse({"l2_blocks": 4}, tp_size=1, pp_size=1, served_model="m",
                                  identity=KVIdentity("bfloat16", 16, "cpu.lm1"))
    return RayKVConnectorScheduler(opts, do_load=False, do_save=True, block_size=16,
                                   tp_size=1, pp_size=1)  # never attaches


def answer(side, *, tokens: int, local: int, asked: int, l2: int, hit: int) -> int:
    st = RequestBlocks(SimpleNamespace(num_tokens=tokens), chain=None)
    n = side._answer(st, local, asked, (l2, hit, []), local * 16)[0]
    assert st.l2_hit_blocks == l2
    return n


def test_hit_tokens_by_tier_over_the_tokens_asked(side):
    # 6 blocks past 1 of vLLM's own: 2 in L2, 2 more in L3
    assert answer(side, tokens=7 * 16 + 5, local=1, asked=6, l2=2, hit=4) == 4 * 16
    stats = side.stats
    assert (stats.asked_tokens, stats.l2_hit_tokens, stats.l3_hit_tokens) == (
        6 * 16, 2 * 16, 2 * 16)
    # a prompt of whole blocks all in L2: its last token is left to compute
    assert answer(side, tokens=3 * 16, local=0, asked=3, l2=3, hit=3) == 3 * 16 - 1
    assert (stats.asked_tokens, stats.l2_hit_tokens, stats.l3_hit_tokens) == (
        9 * 16, 2 * 16 + 3 * 16 - 1, 2 * 16)
    # CONTROL: a miss asks and hits nothing
    assert answer(side, tokens=5 * 16, local=0, asked=4, l2=0, hit=0) == 0
    assert (stats.asked_tokens, stats.l2_hit_tokens, stats.l3_hit_tokens) == (
        13 * 16, 5 * 16 - 1, 2 * 16)
