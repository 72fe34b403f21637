"""`kvserve bench serve` against the tiny model's server: counts, failures, cached tokens, JSON, plot (no timings)."""

from __future__ import annotations

import argparse
import asyncio
import json
import math

import httpx
import numpy as np
import pytest
from test_server_common import TINY_ARGS, ServerThread

from kvserve.bench import serve
from kvserve.bench.cli import add_bench_parser
from kvserve.bench.serve import (
    LatencyStats,
    RequestRecord,
    ServeConfig,
    Session,
    arrival_times,
    compute_metrics,
    run_benchmark,
)


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with ServerThread(tiny_model_dir, "--served-model-name", "tiny", *TINY_ARGS) as s:
        yield s


def bench(tmp_path, capsys, *argv: str) -> dict:
    """`kvserve bench serve ...` through the CLI; returns the JSON file it wrote."""
    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers(dest="command", required=True))
    out = tmp_path / "result.json"
    args = parser.parse_args(["bench", "serve", "--disable-tqdm", "--output-json", str(out), *argv])
    args.func(args)
    printed = capsys.readouterr().out
    assert "Serving Benchmark Result" in printed
    summary = json.loads(printed.strip().splitlines()[-1])
    result = json.loads(out.read_text())
    assert summary == {k: v for k, v in result.items() if k != "requests"}
    return result


def test_random_workload_counts_json_and_plot(server, tmp_path, capsys):
    plot = tmp_path / "serve.png"
    r = bench(
        tmp_path, capsys, "--base-url", server.url, "--workload", "random", "--num-prompts", "6",
        "--input-len", "16", "--output-len", "8", "--max-concurrency", "2", "--request-rate", "50",
        "--plot", str(plot),
    )  # fmt: skip
    assert r["model"] == "tiny" and r["request_rate"] == 50 and r["num_prompts"] == 6
    assert (r["completed"], r["failed"], r["total_output_tokens"]) == (6, 0, 6 * 8)
    assert 1 <= r["max_concurrent_requests"] <= 2
    assert r["total_input_tokens"] == sum(q["prompt_tokens"] for q in r["requests"]) > 0
    for q in r["requests"]:
        assert q["success"] and q["error"] == "" and q["output_tokens"] == 8
        assert 0 < q["ttft_s"] <= q["e2el_s"]
        # one gap between consecutive text chunks; a token whose text is an unfinished character adds none
        assert len(q["itl_s"]) == q["num_chunks"] - 1 and 1 <= q["num_chunks"] <= 8
        assert all(g >= 0 for g in q["itl_s"])
    assert 0 < r["median_ttft_ms"] <= r["p99_ttft_ms"] and r["mean_tpot_ms"] > 0
    assert sum(r["output_tokens_per_s"]) == pytest.approx(6 * 8)  # 1 s bins
    assert plot.read_bytes().startswith(b"\x89PNG") and plot.stat().st_size > 10_000


def test_shared_prefix_is_cached_after_the_first_request(server, tmp_path, capsys):
    r = bench(
        tmp_path, capsys, "--base-url", server.url, "--workload", "shared-prefix", "--num-prompts", "4",
        "--prefix-len", "64", "--suffix-len", "8", "--output-len", "4", "--max-concurrency", "1", "--seed", "11",
    )  # fmt: skip
    assert r["request_rate"] == "inf" and r["completed"] == 4
    reqs = sorted(r["requests"], key=lambda q: q["start_s"])
    assert [q["session"] for q in reqs] == [0, 1, 2, 3]  # concurrency 1: in order, one at a time
    assert reqs[0]["cached_tokens"] == 0
    assert all(q["cached_tokens"] >= 48 for q in reqs[1:])  # the prefix's whole blocks, at least
    assert r["total_cached_tokens"] == sum(q["cached_tokens"] for q in reqs)
    assert r["cached_token_ratio"] == pytest.approx(r["total_cached_tokens"] / r["total_input_tokens"])
    assert r["mean_ttft_cache_hit_ms"] > 0 and r["mean_ttft_cache_miss_ms"] > 0


def test_wrong_model_fails_every_request_without_crashing(server, tiny_model_dir, tmp_path, capsys):
    r = bench(
        tmp_path, capsys, "--base-url", server.url + "/v1", "--model", "nope", "--workload", "random",
        "--num-prompts", "3", "--input-len", "8", "--output-len", "4", "--tokenizer", str(tiny_model_dir),
    )  # fmt: skip
    assert (r["completed"], r["failed"], r["total_output_tokens"], r["mean_ttft_ms"]) == (0, 3, 0, 0.0)
    assert all("HTTP 404" in q["error"] and "`nope` does not exist" in q["error"] for q in r["requests"])


def test_over_long_prompt_is_one_failure_among_successes(server):
    config = ServeConfig(base_url=server.url, model="tiny", max_concurrency=2)
    sessions = [Session(("hello there",), (4,)), Session(("word " * 2000,), (4,)), Session(("bye",), (4,))]
    result = asyncio.run(run_benchmark(config, sessions))
    m = result.metrics
    assert (m.completed, m.failed, m.total_output_tokens) == (2, 1, 8)
    (failed,) = [r for r in result.records if not r.success]
    assert failed.session == 1 and failed.error.startswith("HTTP 400") and "max_model_len" in failed.error
    assert result.errors() == {failed.error: 1}
    assert "failed x1: HTTP 400" in serve.format_table(result)


def test_multiturn_chat_sends_the_history_and_reuses_its_cache(server):
    config = ServeConfig(base_url=server.url, endpoint="chat", model="tiny", max_concurrency=2)
    chat = Session(("Tell me about caches.", "And about blocks?"), (6, 5), multiturn=True)
    result = asyncio.run(run_benchmark(config, [chat, chat]))
    assert (result.metrics.completed, result.metrics.total_output_tokens) == (4, 22)
    for s in (0, 1):
        first, second = sorted((r for r in result.records if r.session == s), key=lambda r: r.turn)
        assert second.start_s >= first.start_s + first.e2el_s  # turns go one after another
        assert second.prompt_tokens > first.prompt_tokens + 5  # the reply and the new turn were sent
        assert second.cached_tokens > 0  # at least the chat template's system prompt and first turn


def test_multiturn_over_completions_needs_a_chat_template():
    sessions = [Session(("a", "b"), (2, 2), multiturn=True)]
    with pytest.raises(ValueError, match="--endpoint chat"):
        asyncio.run(run_benchmark(ServeConfig(model="m"), sessions, tokenizer=None))


def mock_client(handler):
    return lambda config: httpx.AsyncClient(transport=httpx.MockTransport(handler))


def test_warmups_go_first_through_the_same_client_and_are_not_counted(monkeypatch):
    bodies = []

    def handler(request: httpx.Request) -> httpx.Response:
        bodies.append(json.loads(request.content))
        return httpx.Response(200, text='data: {"choices": [{"text": "a"}]}\n\ndata: [DONE]\n\n')

    monkeypatch.setattr(serve, "make_client", mock_client(handler))
    config = ServeConfig(model="m", max_concurrency=2, num_warmups=3)
    result = asyncio.run(run_benchmark(config, [Session(("one",), (5,)), Session(("two",), (5,))]))
    assert [b["prompt"] for b in bodies[:3]] == [serve.WARMUP_PROMPT] * 3
    assert [b["max_tokens"] for b in bodies[:3]] == [4, 4, 4]
    assert sorted(b["prompt"] for b in bodies[3:]) == ["one", "two"]
    assert result.metrics.completed == 2 and sorted(r.session for r in result.records) == [0, 1]


def test_a_failed_warmup_stops_the_benchmark_and_bad_counts_are_refused(monkeypatch):
    monkeypatch.setattr(serve, "make_client", mock_client(lambda request: httpx.Response(503, text="loading")))
    with pytest.raises(RuntimeError, match="warm-up request failed: HTTP 503"):
        asyncio.run(run_benchmark(ServeConfig(model="m", num_warmups=1), [Session(("x",), (2,))]))
    with pytest.raises(ValueError, match="--num-warmups must be >= 0, got -1"):
        asyncio.run(run_benchmark(ServeConfig(model="m", num_warmups=-1), [Session(("x",), (2,))]))


# --- pure functions ----------------------------------------------------------------------------------


def record(session: int, start: float, ttft: float, itl: list[float], out: int, **kw) -> RequestRecord:
    e2el = ttft + sum(itl)
    return RequestRecord(
        session, 0, True, "", start_s=start, ttft_s=ttft, itl_s=itl, e2el_s=e2el,
        num_chunks=len(itl) + 1, output_tokens=out, **kw,
    )  # fmt: skip


def test_metrics_from_synthetic_records():
    a = record(0, 0.0, 0.1, [0.02, 0.04, 0.03], out=4, prompt_tokens=10, cached_tokens=0)
    b = record(1, 0.5, 0.3, [0.05], out=2, prompt_tokens=20, cached_tokens=16)
    c = record(2, 0.6, 0.2, [], out=1, prompt_tokens=5)
    failed = RequestRecord(3, 0, error="HTTP 400: no", prompt_tokens=99, output_tokens=7)
    m = compute_metrics([a, b, c, failed], duration=2.0)
    assert (m.completed, m.failed) == (3, 1)
    assert (m.total_input_tokens, m.total_output_tokens, m.total_cached_tokens) == (35, 7, 16)
    assert m.request_throughput == 1.5 and m.output_throughput == 3.5 and m.total_token_throughput == 21.0
    assert m.cached_token_ratio == pytest.approx(16 / 35)
    assert m.ttft.mean == pytest.approx(200) and m.ttft.median == pytest.approx(200)
    assert m.ttft.p90 == pytest.approx(np.percentile([100, 200, 300], 90))
    # TPOT: (e2e - ttft) / (out - 1), requests of one output token left out
    assert m.tpot.mean == pytest.approx(np.mean([90 / 3, 50 / 1]))
    assert m.itl.mean == pytest.approx(np.mean([20, 40, 30, 50])) and m.itl.p99 <= 50
    assert m.e2el.median == pytest.approx(200)
    assert m.mean_ttft_cache_hit_ms == pytest.approx(300) and m.mean_ttft_cache_miss_ms == pytest.approx(150)
    assert m.max_concurrent_requests == 2  # a: 0-0.19 s, b: 0.5-0.85 s, c: 0.6-0.8 s
    assert sum(m.output_tokens_per_s) == pytest.approx(7) and len(m.output_tokens_per_s) == 2


def test_metrics_with_nothing_completed_are_zero():
    m = compute_metrics([RequestRecord(0, 0, error="boom")], duration=1.0)
    assert (m.completed, m.failed, m.output_throughput, m.max_output_tokens_per_s) == (0, 1, 0.0, 0.0)
    assert m.ttft == LatencyStats() and m.mean_ttft_cache_hit_ms is None
    assert set(m.flat()) >= {"mean_ttft_ms", "median_itl_ms", "p99_e2el_ms", "std_tpot_ms", "p90_ttft_ms"}


def test_latency_stats_match_numpy():
    seconds = [0.001 * x for x in range(1, 101)]
    s = LatencyStats.of(seconds)
    ms = np.arange(1, 101, dtype=float)
    assert s.mean == pytest.approx(50.5) and s.median == pytest.approx(50.5)
    assert (s.p90, s.p99, s.std) == pytest.approx((np.percentile(ms, 90), np.percentile(ms, 99), ms.std()))


def test_arrivals_are_seeded_poisson_with_the_right_mean():
    times = arrival_times(4000, rate=20.0, seed=1)
    assert times == arrival_times(4000, rate=20.0, seed=1) != arrival_times(4000, rate=20.0, seed=2)
    gaps = np.diff(times)
    assert times[0] == 0.0 and (gaps > 0).all()
    assert gaps.mean() == pytest.approx(1 / 20, rel=0.1)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.1)  # exponential gaps: CV 1
    bursty = np.diff(arrival_times(4000, rate=20.0, burstiness=0.25, seed=1))
    assert bursty.mean() == pytest.approx(1 / 20, rel=0.15) and bursty.std() / bursty.mean() > 1.5
    assert arrival_times(3, rate=math.inf) == [0.0, 0.0, 0.0] and arrival_times(0, rate=1.0) == []
    with pytest.raises(ValueError):
        arrival_times(3, rate=0.0)


# --- the stream parser, on canned responses ----------------------------------------------------------


def canned(status: int, body: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.MockTransport(lambda request: httpx.Response(status, text=body)))


def parse(status: int, body: str) -> RequestRecord:
    async def go() -> RequestRecord:
        async with canned(status, body) as client:
            return await serve.send_request(client, "http://x/v1/completions", {}, RequestRecord(0, 0), 0.0)

    return asyncio.run(go())


def test_stream_parser_reads_text_chunks_and_usage():
    usage = {"prompt_tokens": 7, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 4}}
    events = [
        {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},  # role only: not a token
        {"choices": [{"index": 0, "delta": {"content": "Hel"}}]},
        {"choices": [{"index": 0, "delta": {"content": "lo"}, "finish_reason": "length"}]},
        {"choices": [], "usage": usage},
    ]
    r = parse(200, "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n")
    assert r.success and r.generated_text == "Hello" and r.num_chunks == 2 and len(r.itl_s) == 1
    assert (r.prompt_tokens, r.output_tokens, r.cached_tokens) == (7, 3, 4)


def test_stream_parser_counts_chunks_without_usage_and_reports_errors():
    r = parse(200, 'data: {"choices": [{"text": "a"}]}\n\ndata: {"choices": [{"text": "b"}]}\n\ndata: [DONE]\n\n')
    assert r.success and r.output_tokens == 2  # no usage chunk: a token a chunk
    r = parse(200, 'data: {"choices": [{"text": "a"}]}\n\ndata: {"error": {"message": "engine died"}}\n\n')
    assert not r.success and r.error == "stream error: engine died"
    r = parse(429, '{"error": {"message": "queue full", "type": "rate_limit_error"}}')
    assert not r.success and r.error == "HTTP 429: queue full"
    r = parse(502, "<html>bad gateway</html>")
    assert r.error == "HTTP 502: <html>bad gateway</html>"
    r = parse(200, "data: [DONE]\n\n")
    assert not r.success and "no text" in r.error


def test_random_prompts_retokenize_to_input_len(smollm2_dir):
    """Decoded random ids re-tokenize longer; the prompts sent are cut back to input_len tokens."""
    from kvserve.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(smollm2_dir)
    sessions = serve.load_sessions(serve.WorkloadSpec(name="random", num_prompts=16, input_len=256), tokenizer)
    lengths = [len(tokenizer.encode(s.prompts[0], add_special_tokens=False)) for s in sessions]
    assert all(abs(n - 256) <= 2 for n in lengths), lengths


def test_multiturn_asks_for_exact_lengths_by_min_tokens_not_ignore_eos():
    config = ServeConfig(endpoint="chat", model="m")
    turn = serve.payload(config, [{"role": "user", "content": "hi"}], 7, multiturn=True)
    assert turn["min_tokens"] == 7 and "ignore_eos" not in turn
    single = serve.payload(config, "hi", 7)
    assert single["ignore_eos"] is True and "min_tokens" not in single
    assert "min_tokens" not in serve.payload(ServeConfig(ignore_eos=False), "hi", 7, multiturn=True)
