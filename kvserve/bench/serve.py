"""`kvserve bench serve`: an online benchmark over plain OpenAI HTTP, after vLLM's `vllm bench serve`.

Sessions (one prompt, or the turns of one conversation) arrive at Poisson times (gamma
with `burstiness`; all at once at rate inf), at most `max_concurrency` in flight. Every
request streams; the arrival time of each chunk that carries text gives time to first
token (TTFT), the inter-token latencies (ITL, gaps between chunks), time per output token
(TPOT = (e2e - TTFT) / (output tokens - 1)) and end-to-end latency. Token counts and
cached prompt tokens come from the final usage chunk. Nothing here is kvserve-specific,
so it measures any OpenAI-compatible server.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
import math
import time
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import httpx
import numpy as np

if TYPE_CHECKING:
    from tqdm import tqdm
    from transformers import PreTrainedTokenizerBase

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
REQUEST_TIMEOUT_S = 6 * 3600  # as vLLM: a long benchmark's requests may wait long in a queue
WARMUP_PROMPT = "Say hello."
THROUGHPUT_BIN_S = 1.0


# --- what to send ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Session:
    """What one arrival sends: one prompt, or the user turns of one conversation, in order."""

    prompts: tuple[str, ...]
    max_tokens: tuple[int, ...]  # output length of each turn (exact when the server honours ignore_eos / min_tokens)
    prompt_len: int | None = None  # single-turn: the workload's token count, used if the server sends no usage
    multiturn: bool = False  # each prompt is then the whole chat so far, the server's replies included


@dataclass
class ServeConfig:
    base_url: str = "http://127.0.0.1:8000"
    endpoint: str = "completions"  # completions | chat
    model: str = ""
    api_key: str | None = None
    workload: str = "custom"
    request_rate: float = math.inf  # sessions per second
    burstiness: float = 1.0  # gamma shape of the gaps: 1 is Poisson, lower is burstier
    max_concurrency: int | None = None  # sessions in flight at once
    seed: int = 0
    temperature: float = 0.0
    ignore_eos: bool = True  # so output lengths are the workload's, whatever the model says
    num_warmups: int = 0  # short requests through the same client before the clock starts (vLLM's flag)

    @property
    def url(self) -> str:
        return api_root(self.base_url) + ENDPOINTS[self.endpoint]


def api_root(base_url: str) -> str:
    """The server's root, whether the user gave it with or without /v1."""
    return base_url.rstrip("/").removesuffix("/v1")


# --- what came back -------------------------------------------------------------------------------


@dataclass
class RequestRecord:
    session: int
    turn: int
    success: bool = False
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    start_s: float = 0.0  # when it was sent, seconds after the benchmark began
    ttft_s: float = 0.0
    e2el_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)  # gaps between chunks that carried text
    num_chunks: int = 0  # chunks that carried text
    generated_text: str = ""

    @property
    def tpot_s(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.e2el_s - self.ttft_s) / (self.output_tokens - 1)

    def chunk_times(self) -> list[float]:
        """When each text chunk arrived, seconds after the benchmark began."""
        t = self.start_s + self.ttft_s
        times = [t]
        for gap in self.itl_s:
            t += gap
            times.append(t)
        return times


@dataclass(frozen=True)
class LatencyStats:
    """Milliseconds; all zero when nothing completed (as vLLM reports it)."""

    mean: float = 0.0
    median: float = 0.0
    std: float = 0.0
    p90: float = 0.0
    p99: float = 0.0

    @classmethod
    def of(cls, seconds: Sequence[float]) -> LatencyStats:
        if not seconds:
            return cls()
        ms = np.asarray(seconds, dtype=float) * 1000
        p50, p90, p99 = np.percentile(ms, [50, 90, 99])
        return cls(float(ms.mean()), float(p50), float(ms.std()), float(p90), float(p99))

    def flat(self, name: str) -> dict[str, float]:
        """vLLM's result names: mean_ttft_ms, median_ttft_ms, ..."""
        return {f"{stat}_{name}_ms": value for stat, value in asdict(self).items()}


@dataclass
class ServeMetrics:
    completed: int
    failed: int
    duration: float  # seconds, first send to last response
    total_input_tokens: int  # completed requests only, as vLLM
    total_output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    max_output_tokens_per_s: float  # the busiest 1 s bin
    max_concurrent_requests: int
    total_cached_tokens: int
    cached_token_ratio: float  # cached / input tokens
    ttft: LatencyStats
    tpot: LatencyStats
    itl: LatencyStats
    e2el: LatencyStats
    mean_ttft_cache_hit_ms: float | None  # requests that found part of their prompt cached
    mean_ttft_cache_miss_ms: float | None
    output_tokens_per_s: list[float]  # per 1 s bin since the start

    def flat(self) -> dict[str, Any]:
        out = {k: v for k, v in asdict(self).items() if not isinstance(getattr(self, k), LatencyStats)}
        for name in ("ttft", "tpot", "itl", "e2el"):
            out.update(getattr(self, name).flat(name))
        return out


@dataclass
class ServeResult:
    config: ServeConfig
    metrics: ServeMetrics
    records: list[RequestRecord]
    num_sessions: int
    date: str = field(default_factory=lambda: datetime.datetime.now().isoformat(timespec="seconds"))

    def summary(self) -> dict[str, Any]:
        """Config and metrics, flat with vLLM's names; JSON-safe (rate inf is written "inf", as vLLM)."""
        config = asdict(self.config) | {"api_key": None}  # never write a key to a result file
        if math.isinf(self.config.request_rate):
            config["request_rate"] = "inf"
        return {"date": self.date, **config, "num_prompts": self.num_sessions, **self.metrics.flat()}

    def to_json(self) -> dict[str, Any]:
        return self.summary() | {"requests": [asdict(r) for r in self.records]}

    def errors(self) -> Counter[str]:
        return Counter(r.error for r in self.records if not r.success)


# --- pure functions: arrivals and metrics ----------------------------------------------------------


def arrival_times(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Send times in seconds from the start: gaps ~ gamma(burstiness, 1/(rate*burstiness)), first at 0.

    The mean gap is 1/rate whatever the burstiness; burstiness 1 makes it a Poisson process.
    """
    if n <= 0:
        return []
    if math.isinf(rate):
        return [0.0] * n
    if rate <= 0 or burstiness <= 0:
        raise ValueError(f"--request-rate and --burstiness must be > 0, got {rate} and {burstiness}")
    gaps = np.random.default_rng(seed).gamma(burstiness, 1.0 / (rate * burstiness), size=n - 1)
    return [0.0, *np.cumsum(gaps).tolist()]


def output_tokens_per_second(records: Sequence[RequestRecord], duration: float) -> list[float]:
    """Output tokens per 1 s bin, each request's tokens spread evenly over its chunks."""
    ok = [r for r in records if r.success and r.num_chunks]
    end = max([duration, *(r.chunk_times()[-1] for r in ok)])
    bins = [0.0] * max(1, math.ceil(end / THROUGHPUT_BIN_S))
    for r in ok:
        times = r.chunk_times()
        per_chunk = r.output_tokens / len(times)  # a chunk may carry several tokens, or usage may differ
        for t in times:
            bins[min(int(t // THROUGHPUT_BIN_S), len(bins) - 1)] += per_chunk
    return [b / THROUGHPUT_BIN_S for b in bins]


def max_concurrent(records: Sequence[RequestRecord]) -> int:
    """Most requests in flight at one moment (an end before a start at the same instant)."""
    events = sorted((t, d) for r in records for t, d in ((r.start_s, 1), (r.start_s + r.e2el_s, -1)))
    peak = running = 0
    for _, delta in events:
        running += delta
        peak = max(peak, running)
    return peak


def compute_metrics(records: Sequence[RequestRecord], duration: float) -> ServeMetrics:
    ok = [r for r in records if r.success]
    inputs = sum(r.prompt_tokens for r in ok)
    outputs = sum(r.output_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    per_s = output_tokens_per_second(ok, duration)
    hit = [r.ttft_s * 1000 for r in ok if r.cached_tokens > 0]
    miss = [r.ttft_s * 1000 for r in ok if r.cached_tokens == 0]
    rate = (lambda x: x / duration) if duration > 0 else (lambda x: 0.0)
    return ServeMetrics(
        completed=len(ok),
        failed=len(records) - len(ok),
        duration=duration,
        total_input_tokens=inputs,
        total_output_tokens=outputs,
        request_throughput=rate(len(ok)),
        output_throughput=rate(outputs),
        total_token_throughput=rate(inputs + outputs),
        max_output_tokens_per_s=max(per_s),
        max_concurrent_requests=max_concurrent(ok),
        total_cached_tokens=cached,
        cached_token_ratio=cached / inputs if inputs else 0.0,
        ttft=LatencyStats.of([r.ttft_s for r in ok]),
        tpot=LatencyStats.of([t for r in ok if (t := r.tpot_s) is not None]),
        itl=LatencyStats.of([gap for r in ok for gap in r.itl_s]),
        e2el=LatencyStats.of([r.e2el_s for r in ok]),
        mean_ttft_cache_hit_ms=float(np.mean(hit)) if hit else None,
        mean_ttft_cache_miss_ms=float(np.mean(miss)) if miss else None,
        output_tokens_per_s=per_s,
    )


# --- HTTP -----------------------------------------------------------------------------------------


def payload(
    config: ServeConfig, prompt: str | list[dict[str, str]], max_tokens: int, multiturn: bool = False
) -> dict[str, Any]:
    """A streamed request body; `prompt` is text for completions, messages for chat."""
    body: dict[str, Any] = {
        "model": config.model,
        "temperature": config.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},  # token counts, cached tokens
    }
    if config.ignore_eos:
        # a multiturn reply goes back into the next prompt: min_tokens masks the end-of-turn
        # token (as vLLM's multi-turn benchmark does), where ignore_eos would let it into the text
        body |= {"min_tokens": max_tokens} if multiturn else {"ignore_eos": True}
    if config.endpoint == "chat":
        messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        return body | {"messages": messages, "max_completion_tokens": max_tokens}
    assert isinstance(prompt, str)
    return body | {"prompt": prompt, "max_tokens": max_tokens}


def chunk_text(chunk: dict[str, Any]) -> str:
    """The new text of a completions or chat chunk ('' for role-only and usage chunks)."""
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    return choice.get("text") or (choice.get("delta") or {}).get("content") or ""


def error_message(status: int, body: bytes) -> str:
    """`HTTP 400: <the OpenAI error message>`, or the body's start when it is not an OpenAI error."""
    try:
        message = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = body.decode(errors="replace")[:500]
    return f"HTTP {status}: {message}"


async def send_request(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], record: RequestRecord, bench_start: float
) -> RequestRecord:
    """Stream one request into `record`; any failure is recorded there, never raised."""
    sent = time.perf_counter()
    record.start_s = sent - bench_start
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                record.error = error_message(response.status_code, await response.aread())
                return record
            await _read_events(response, record, sent)
    except Exception as e:  # as vLLM: one broken request must not end the benchmark
        record.error = f"{type(e).__name__}: {e}"
    return record


async def _read_events(response: httpx.Response, record: RequestRecord, sent: float) -> None:
    last = sent
    text: list[str] = []
    usage: dict[str, Any] = {}
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue  # blank separators, comments, event names
        data = line.removeprefix("data:").strip()
        if data == "[DONE]":
            break
        now = time.perf_counter()
        chunk = json.loads(data)
        if "error" in chunk:  # an error after the stream began: sent as an event (vLLM, kvserve)
            record.error = f"stream error: {(chunk['error'] or {}).get('message', chunk['error'])}"
            return
        if new := chunk_text(chunk):
            if record.num_chunks == 0:
                record.ttft_s = now - sent
            else:
                record.itl_s.append(now - last)
            last = now
            record.num_chunks += 1
            text.append(new)
        usage = chunk.get("usage") or usage
    record.e2el_s = time.perf_counter() - sent
    _finish(record, "".join(text), usage)


def _finish(record: RequestRecord, text: str, usage: dict[str, Any]) -> None:
    if record.num_chunks == 0:
        record.error = "the stream carried no text, so no time to first token"
        return
    record.success = True
    record.generated_text = text
    record.output_tokens = usage.get("completion_tokens") or record.num_chunks  # fallback: a token a chunk
    record.prompt_tokens = usage.get("prompt_tokens") or record.prompt_tokens
    record.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0


def make_client(config: ServeConfig) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    # httpx pools 100 connections by default: that would cap concurrency silently at rate inf
    limits = httpx.Limits(max_connections=config.max_concurrency, max_keepalive_connections=config.max_concurrency)
    return httpx.AsyncClient(headers=headers, limits=limits, timeout=httpx.Timeout(REQUEST_TIMEOUT_S, connect=60))


def list_models(base_url: str, api_key: str | None = None) -> list[dict[str, Any]]:
    """GET /v1/models: the model cards the server lists (id, and for kvserve and vLLM, root)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    url = api_root(base_url) + "/v1/models"
    try:
        response = httpx.get(url, headers=headers, timeout=30)
    except httpx.HTTPError as e:
        raise ValueError(f"cannot reach {url}: {e}") from e
    if response.status_code != 200:
        raise ValueError(f"GET {url}: {error_message(response.status_code, response.content)}")
    cards = response.json().get("data") or []
    if not cards:
        raise ValueError(f"GET {url} lists no models; pass --model")
    return cards


# --- the run --------------------------------------------------------------------------------------


@dataclass
class _Run:
    """What every session of one benchmark shares."""

    config: ServeConfig
    client: httpx.AsyncClient
    start: float
    limit: contextlib.AbstractAsyncContextManager[Any]
    tokenizer: PreTrainedTokenizerBase | None  # renders multiturn chats for the completions endpoint
    progress: tqdm | None


async def run_benchmark(
    config: ServeConfig,
    sessions: Sequence[Session],
    tokenizer: PreTrainedTokenizerBase | None = None,
    progress: bool = False,
) -> ServeResult:
    _check_sessions(config, sessions, tokenizer)
    times = arrival_times(len(sessions), config.request_rate, config.burstiness, config.seed)
    limit = asyncio.Semaphore(config.max_concurrency) if config.max_concurrency else contextlib.nullcontext()
    async with make_client(config) as client, _progress_bar(sessions, progress) as bar:
        await warm_up(config, client)
        run = _Run(config, client, time.perf_counter(), limit, tokenizer, bar)
        tasks = []
        for index, (session, at) in enumerate(zip(sessions, times, strict=True)):
            await asyncio.sleep(max(0.0, run.start + at - time.perf_counter()))  # no drift: sleep to the time
            tasks.append(asyncio.create_task(_run_session(run, index, session)))
        per_session = await asyncio.gather(*tasks)
        duration = time.perf_counter() - run.start
    records = [r for rs in per_session for r in rs]
    return ServeResult(config, compute_metrics(records, duration), records, len(sessions))


async def warm_up(config: ServeConfig, client: httpx.AsyncClient) -> None:
    """`num_warmups` short requests, at most max_concurrency at once, before the clock starts.

    A cold client is slow to send its first wave: on 2 cores, at c=8, 2 of the first 8
    requests left 130 ms late, once the server's prefill had taken both cores, so they
    met a busier server (TTFT p50 +4, +5, +11% against bench_client.py's on the same
    server). Warmed, all 8 leave within 6 ms. The prompt is not the workload's, so the
    server caches none of it.
    """
    limit = asyncio.Semaphore(config.max_concurrency or max(config.num_warmups, 1))

    async def one() -> RequestRecord:
        async with limit:
            record = RequestRecord(session=-1, turn=0)
            return await send_request(client, config.url, payload(config, WARMUP_PROMPT, 4), record, 0.0)

    records = await asyncio.gather(*(one() for _ in range(config.num_warmups)))
    if failed := [r for r in records if not r.success]:
        raise RuntimeError(f"a warm-up request failed: {failed[0].error}")


def _check_sessions(config: ServeConfig, sessions: Sequence[Session], tokenizer: Any) -> None:
    if config.num_warmups < 0:
        raise ValueError(f"--num-warmups must be >= 0, got {config.num_warmups}")
    if config.endpoint not in ENDPOINTS:
        raise ValueError(f"endpoint must be one of {', '.join(ENDPOINTS)}, got {config.endpoint!r}")
    if config.max_concurrency is not None and config.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1, got {config.max_concurrency}")
    needs_template = config.endpoint == "completions" and any(s.multiturn for s in sessions)
    if needs_template and (tokenizer is None or not tokenizer.chat_template):
        raise ValueError(
            "multiturn over /v1/completions renders chats with a tokenizer's chat template: "
            "pass a tokenizer that has one, or use --endpoint chat"
        )


@contextlib.asynccontextmanager
async def _progress_bar(sessions: Sequence[Session], show: bool) -> AsyncIterator[tqdm | None]:
    if not show:
        yield None
        return
    from tqdm import tqdm

    bar = tqdm(total=sum(len(s.prompts) for s in sessions), unit="req", desc="requests")
    try:
        yield bar
    finally:
        bar.close()


async def _run_session(run: _Run, index: int, session: Session) -> list[RequestRecord]:
    """The session's turns one after another, holding one concurrency slot throughout."""
    records: list[RequestRecord] = []
    chat: list[dict[str, str]] = []
    async with run.limit:
        for turn, (prompt, max_tokens) in enumerate(zip(session.prompts, session.max_tokens, strict=True)):
            record = RequestRecord(session=index, turn=turn, prompt_tokens=session.prompt_len or 0)
            chat.append({"role": "user", "content": prompt})
            body = payload(run.config, _prompt(run, session, prompt, chat), max_tokens, session.multiturn)
            records.append(await send_request(run.client, run.config.url, body, record, run.start))
            if run.progress is not None:
                run.progress.update()
            if not record.success:
                break  # a conversation cannot go on without its reply
            chat.append({"role": "assistant", "content": record.generated_text})
    return records


def _prompt(run: _Run, session: Session, prompt: str, chat: list[dict[str, str]]) -> str | list[dict[str, str]]:
    if not session.multiturn:
        return prompt
    if run.config.endpoint == "chat":
        return list(chat)
    from kvserve.tokenizer import apply_chat_template

    return apply_chat_template(run.tokenizer, chat)


# --- workloads ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class WorkloadSpec:
    name: str
    num_prompts: int  # conversations for multiturn
    seed: int = 0
    input_len: int = 512  # random
    output_len: int = 128  # random, shared-prefix
    prefix_len: int = 1024  # shared-prefix
    suffix_len: int = 32  # shared-prefix
    max_turns: int = 4  # multiturn


def load_sessions(spec: WorkloadSpec, tokenizer: PreTrainedTokenizerBase) -> list[Session]:
    """The offline benchmarks' samplers, their token ids decoded to text for HTTP."""
    from kvserve.bench import conversations, datasets

    if spec.num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {spec.num_prompts}")
    vocab = tokenizer.vocab_size
    if spec.name == "sharegpt":
        return [_single(tokenizer, r) for r in datasets.sample_sharegpt(tokenizer, spec.num_prompts, spec.seed)]
    if spec.name == "random":
        reqs = datasets.sample_random(spec.num_prompts, spec.input_len, spec.output_len, vocab, spec.seed)
        return [_single(tokenizer, r, retokenized=True) for r in reqs]
    if spec.name == "shared-prefix":
        reqs = conversations.shared_prefix_requests(
            vocab, spec.num_prompts, spec.prefix_len, spec.suffix_len, spec.output_len, spec.seed
        )
        return _shared_prefix(tokenizer, reqs, spec.prefix_len)
    if spec.name == "multiturn":
        chats = conversations.sample_multiturn(tokenizer, spec.num_prompts, spec.seed, spec.max_turns)
        return [Session(tuple(c.user_turns), tuple(c.reply_tokens), multiturn=True) for c in chats]
    raise ValueError(f"unknown workload {spec.name!r} ({', '.join(datasets.SERVE_WORKLOADS)})")


def _single(tokenizer: PreTrainedTokenizerBase, request: Any, retokenized: bool = False) -> Session:
    ids = request.prompt_token_ids
    text = tokenizer.decode(ids, skip_special_tokens=True)
    if retokenized:  # random ids decode to text that tokenizes ~5% longer: cut it back, as vLLM's random set does
        text = tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)[: len(ids)], skip_special_tokens=True)
    return Session((text,), (request.max_tokens,), prompt_len=len(ids))


def _shared_prefix(tokenizer: PreTrainedTokenizerBase, requests: Sequence[Any], prefix_len: int) -> list[Session]:
    # the prefix decoded once: every request then starts with the very same text, so the same tokens
    prefix = tokenizer.decode(requests[0].prompt_token_ids[:prefix_len], skip_special_tokens=True)
    return [
        Session(
            (prefix + tokenizer.decode(r.prompt_token_ids[prefix_len:], skip_special_tokens=True),),
            (r.max_tokens,),
            prompt_len=len(r.prompt_token_ids),
        )
        for r in requests
    ]


def load_bench_tokenizer(name: str | None, served: Sequence[str]) -> PreTrainedTokenizerBase:
    """--tokenizer; else the first served name kvserve resolves here (the model's root); else the default model's."""
    from kvserve.config import DEFAULT_MODEL
    from kvserve.logger import logger
    from kvserve.models.loader import resolve_model
    from kvserve.tokenizer import load_tokenizer

    candidates = [name] if name else [*served, DEFAULT_MODEL]
    for candidate in candidates:
        try:
            tokenizer = load_tokenizer(resolve_model(candidate))
        except FileNotFoundError:
            continue
        if not name and candidate not in served:
            logger.warning("no tokenizer of %s here; prompts come from %s's: pass --tokenizer", served, candidate)
        return tokenizer
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(name)  # a Hugging Face id


# --- report ---------------------------------------------------------------------------------------


def format_table(result: ServeResult) -> str:
    """vLLM's "Serving Benchmark Result" block, plus failures and cached tokens."""
    m, c = result.metrics, result.config
    lines = [f"{' Serving Benchmark Result ':=^60}"]

    def row(name: str, value: object) -> None:
        text = f"{value:.2f}" if isinstance(value, float) else ("-" if value is None else str(value))
        lines.append(f"{name:<45} {text:>14}")

    def section(title: str) -> None:
        lines.append(f"{' ' + title + ' ':-^60}")

    row("Successful requests:", m.completed)
    row("Failed requests:", m.failed)
    row("Maximum request concurrency:", c.max_concurrency)
    row("Request rate configured (RPS):", "inf" if math.isinf(c.request_rate) else c.request_rate)
    row("Benchmark duration (s):", m.duration)
    row("Total input tokens:", m.total_input_tokens)
    row("Total generated tokens:", m.total_output_tokens)
    row("Request throughput (req/s):", m.request_throughput)
    row("Output token throughput (tok/s):", m.output_throughput)
    row("Peak output token throughput (tok/s):", m.max_output_tokens_per_s)
    row("Peak concurrent requests:", m.max_concurrent_requests)
    row("Total token throughput (tok/s):", m.total_token_throughput)
    section("Prefix cache")
    row("Total cached tokens:", m.total_cached_tokens)
    row("Cached / input tokens (%):", 100 * m.cached_token_ratio)
    row("Mean TTFT, some prompt cached (ms):", m.mean_ttft_cache_hit_ms)
    row("Mean TTFT, nothing cached (ms):", m.mean_ttft_cache_miss_ms)
    for name, title, stats in (
        ("TTFT", "Time to First Token", m.ttft),
        ("TPOT", "Time per Output Token (excl. 1st token)", m.tpot),
        ("ITL", "Inter-token Latency", m.itl),
        ("E2EL", "End-to-end Latency", m.e2el),
    ):
        section(title)
        for stat, label in (("mean", "Mean"), ("median", "Median"), ("p90", "P90"), ("p99", "P99")):
            row(f"{label} {name} (ms):", getattr(stats, stat))
    lines.append("=" * 60)
    lines += [f"failed x{n}: {error}" for error, n in result.errors().most_common(5)]
    return "\n".join(lines)
