"""The pure parts of the load guard's link benchmark (``lab/bench/guard_summary``):
its checks, prompts, the guard's decision from the connector's counters, and the
figures per link rate and length (medians, ratios, whether the guard's choice matched
the faster of load and cold)."""

import pytest
from raykv.integrations.vllm.connector_stats import ConnectorStats
from raykv_lab.bench.guard_summary import (
    BLOCK,
    DEFAULT_LENGTHS,
    DEFAULT_LINKS,
    DEFAULT_SETTLE,
    TABLE_COLUMNS,
    Repeat,
    Served,
    check_lengths,
    check_links,
    grown,
    guard_decision,
    prompt_ids,
    store_blocks,
    summarise,
    table_row,
)


def repeat(cold_s: float, off_s: float, auto_s: float, auto_cached: int, hit: int = 896,
           saved: int = 16, decision: str = "load") -> Repeat:
    return Repeat(cold=Served(cold_s, cold_s, 0), off=Served(off_s, off_s, hit, "load", "off"),
                  auto=Served(auto_s, auto_s, auto_cached, decision, "x"),
                  saved_blocks=saved, expected_blocks=16)


def test_checks_take_rates_unshaped_and_lengths_with_a_block_to_load():
    check_links(["10mbit", "unshaped", "1gbit"])
    check_lengths([BLOCK + 1, 4000])
    for bad in ([], ["fast"], ["10mbit", "10"], ["1gbit", "1gbit"]):
        with pytest.raises(ValueError):
            check_links(bad)
    for bad in ([], [BLOCK], [4001], [256, 256]):  # CONTROL: a length with no full block to load
        with pytest.raises(ValueError):
            check_lengths(bad)


def test_prompts_are_seeded_by_their_tag():
    a = prompt_ids("1gbit-256-0-off", 256)
    assert a == prompt_ids("1gbit-256-0-off", 256) and len(a) == 256
    assert all(3 <= t < 2048 for t in a)
    assert a != prompt_ids("1gbit-256-0-auto", 256)  # CONTROL: another tag, another prompt


def test_store_blocks_counts_every_prompt_the_writer_saves():
    # per link: 2 prompts x 3 repeats x (2 + 8) blocks, 4 settle prompts of 8 blocks;
    # two warm-up prompts of 15 blocks
    assert store_blocks(2, [256, 1024], 3, 4, 1024, 1920) == 2 * (60 + 32) + 30


def test_grown_keeps_the_guard_and_hit_counters_that_grew():
    before = ConnectorStats(guard_load_off=2, l3_hit_tokens=100, queries=1, saved=3)
    after = ConnectorStats(guard_load_off=3, l3_hit_tokens=100, queries=9, saved=5,
                           guard_skipped_l3_tokens=896)
    assert grown(before, after) == {"guard_load_off": 1, "guard_skipped_l3_tokens": 896}


def test_the_guard_decision_is_read_from_its_counters():
    assert guard_decision({"guard_recompute_slower_than_prefill": 1,
                           "guard_skipped_l3_tokens": 896}) == ("recompute",
                                                                "slower_than_prefill")
    assert guard_decision({"guard_load_faster_than_prefill": 1,
                           "l3_hit_tokens": 896}) == ("load", "faster_than_prefill")
    assert guard_decision({"guard_mixed_slower_than_prefill": 1}) == (
        "mixed", "slower_than_prefill")
    # CONTROL: skipped tokens and hits alone are no decision
    assert guard_decision({"guard_skipped_l3_tokens": 896, "l3_hit_tokens": 1}) == ("none", "")
    assert guard_decision({"guard_load_no_estimate": 1,
                           "guard_recompute_slower_than_prefill": 1}) == (
        "load+recompute", "no_estimate+slower_than_prefill")


def test_a_guard_that_recomputes_where_cold_wins_matches():
    row = summarise("10mbit", 1024, [repeat(0.30, 6.0, 0.31, 0), repeat(0.32, 6.2, 0.30, 0),
                                     repeat(0.29, 5.9, 0.33, 0)])
    assert (row["cold_s"], row["off_s"], row["auto_s"]) == (0.30, 6.0, 0.31)
    assert row["auto_over_cold"] == pytest.approx(0.31 / 0.30)
    assert row["auto_over_off"] == pytest.approx(0.31 / 6.0)
    assert row["auto_over_best"] == pytest.approx(0.31 / 0.30)
    assert row["loaded_fraction"] == 0 and row["hit_tokens"] == 896
    assert row["load_beats_cold"] is False and row["guard_loaded"] is False
    assert row["crossover_match"] is True
    assert row["saved_all"] is True and row["cold_cached"] == [0, 0, 0]


def test_a_guard_that_loads_where_cold_wins_is_a_mismatch():
    row = summarise("100mbit", 1920, [repeat(0.4, 1.3, 1.2, 896)])
    assert row["loaded_fraction"] == 1 and row["load_beats_cold"] is False
    assert row["crossover_match"] is False
    assert row["auto_over_best"] == pytest.approx(3.0)


def test_a_guard_that_recomputes_where_loading_wins_is_a_mismatch():
    row = summarise("10gbit", 1920, [repeat(0.4, 0.1, 0.41, 0, decision="recompute")])
    assert row["load_beats_cold"] is True and row["guard_loaded"] is False
    assert row["crossover_match"] is False
    row = summarise("10gbit", 1920, [repeat(0.4, 0.1, 0.11, 896)])  # CONTROL: it loads
    assert row["crossover_match"] is True and row["auto_decisions"] == ["load:x"]


def test_the_loaded_fraction_sums_over_repeats_and_half_is_not_loaded():
    row = summarise("1gbit", 1024, [repeat(0.3, 0.1, 0.1, 896), repeat(0.3, 0.1, 0.3, 0)])
    assert row["loaded_fraction"] == 0.5 and row["guard_loaded"] is False
    assert row["off_cached"] == [896, 896] and row["auto_cached"] == [896, 0]


def test_no_hit_leaves_the_crossover_undecided_and_a_short_save_is_flagged():
    row = summarise("10mbit", 256, [repeat(0.1, 0.1, 0.1, 0, hit=0, saved=15)])
    assert row["loaded_fraction"] is None and row["load_beats_cold"] is None
    assert row["crossover_match"] is None and row["saved_all"] is False
    with pytest.raises(ValueError):
        summarise("10mbit", 256, [])


def test_table_rows_show_milliseconds_ratios_and_dashes_where_no_figure():
    row = summarise("1gbit", 1024, [repeat(0.3, 0.1, 0.12, 896)])
    cells = table_row(row)
    assert len(cells) == len(TABLE_COLUMNS)
    assert cells == ["1gbit", "1024", "896", "300", "100", "120", "0.40x", "1.20x",
                     "1.00", "yes", "yes"]
    none = table_row(summarise("10mbit", 256, [repeat(0.1, 0.1, 0.1, 0, hit=0)]))
    assert none[-3:] == ["-", "-", "-"]



def test_the_command_s_defaults_are_the_benchmark_s():
    from raykv.clusters.cli import main

    given = {p.name: p.default for p in main.commands["bench-guard-links"].params}
    assert given["links"] == ",".join(DEFAULT_LINKS)
    assert given["lengths"] == ",".join(map(str, DEFAULT_LENGTHS))
    assert (given["repeats"], given["settle"]) == (3, DEFAULT_SETTLE)
    check_links(DEFAULT_LINKS)
    check_lengths(DEFAULT_LENGTHS)
