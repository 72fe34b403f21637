"""The shared-system-prompt workload of `python tools/routers`: many chats, every one opening with the same long
system prompt (--system-tokens, 1,024 by default), spread over several tenants (--tenants API keys).

Within a tenant the system prompt is one long prefix every chat can find cached (where its router sent the
tenant's earlier chats); across tenants the very same text is a miss, each tenant's blocks salted apart. A
router that scores cache by text alone sees one hot prefix everywhere. The user turns and reply lengths are
`kvserve bench serve --workload multiturn`'s (the same sampler and seed), so the two workloads' rows compare.
The client is in process (httpx, streamed chat, usage from the last chunk), its figures named as
`routers.summarize`'s.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

RULE = (
    "Rule {i}: when a customer asks about subject number {i}, first restate the question in one sentence, "
    "then answer with care, cite the relevant section of the handbook, and never promise a refund. "
)


@dataclass(frozen=True)
class Chat:
    tenant: int
    user_turns: tuple[str, ...]
    reply_tokens: tuple[int, ...]


def system_prompt(tokenizer: Any, tokens: int) -> str:
    """A deterministic system prompt of at least `tokens` tokens."""
    text, i = "You are the support assistant of a large company. Follow these rules.\n", 0
    while len(tokenizer.encode(text, add_special_tokens=False)) < tokens:
        text += RULE.format(i=i)
        i += 1
    return text


def sample_chats(tokenizer: Any, conversations: int, tenants: int, seed: int, turns: int) -> list[Chat]:
    from kvserve.bench.conversations import sample_multiturn

    chats = sample_multiturn(tokenizer, conversations, seed, turns)
    return [Chat(i % tenants, tuple(c.user_turns), tuple(c.reply_tokens)) for i, c in enumerate(chats)]


def write_keys(path: Path, tenants: int) -> Path:
    path.write_text("".join(f"{key(t)} tenant{t}\n" for t in range(tenants)))
    return path


def key(tenant: int) -> str:
    return f"bench-key-{tenant}"


async def _turn(client: httpx.AsyncClient, url: str, body: dict, tenant: int) -> tuple[dict[str, Any], str]:
    record: dict[str, Any] = {"success": False, "error": "", "ttft_ms": None}
    text, usage = "", None
    started = time.perf_counter()
    headers = {"Authorization": f"Bearer {key(tenant)}"}
    try:
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body, headers=headers) as response:
            if response.status_code != 200:
                record["error"] = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return record, text
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    record["error"] = str(chunk["error"])[:200]
                    return record, text
                usage = chunk.get("usage") or usage
                for c in chunk.get("choices", []):
                    piece = (c.get("delta") or {}).get("content") or ""
                    if piece and record["ttft_ms"] is None:
                        record["ttft_ms"] = (time.perf_counter() - started) * 1000
                    text += piece
    except (httpx.HTTPError, ValueError) as e:
        record["error"] = f"{type(e).__name__}: {e}"[:200]
        return record, text
    if usage is None:
        record["error"] = "no usage in the stream"
        return record, text
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    record |= {"success": True, "prompt_tokens": usage["prompt_tokens"], "cached_tokens": cached}
    record["output_tokens"] = usage["completion_tokens"]
    return record, text


async def _chat(client: httpx.AsyncClient, url: str, model: str, system: str, chat: Chat, n: int) -> list[dict]:
    """One chat's turns in order; a failed turn ends the chat (its later turns are never sent)."""
    messages = [{"role": "system", "content": system}]
    records = []
    for turn, (user, reply) in enumerate(zip(chat.user_turns, chat.reply_tokens, strict=True)):
        messages.append({"role": "user", "content": user})
        body = {"model": model, "messages": messages, "max_tokens": reply, "temperature": 0, "ignore_eos": True}
        body |= {"stream": True, "stream_options": {"include_usage": True}}
        record, text = await _turn(client, url, body, chat.tenant)
        records.append(record | {"session": n, "turn": turn, "tenant": chat.tenant})
        if not record["success"]:
            break
        messages.append({"role": "assistant", "content": text})
    return records


async def _run(url: str, model: str, system: str, chats: list[Chat], concurrency: int) -> list[dict]:
    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency * 2)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600, connect=5), limits=limits) as client:

        async def one(n: int, chat: Chat) -> list[dict]:
            async with gate:
                return await _chat(client, url, model, system, chat, n)

        done = await asyncio.gather(*(one(n, c) for n, c in enumerate(chats)))
    return [r for chat in done for r in chat]


def run_workload(url: str, model: str, system: str, chats: list[Chat], concurrency: int) -> dict[str, Any]:
    started = time.perf_counter()
    records = asyncio.run(_run(url, model, system, chats, concurrency))
    return {"requests": records, "duration": time.perf_counter() - started}


def reuse_bound(records: list[dict[str, Any]], system_tokens: int) -> float | None:
    """The hit rate a perfect router could reach: a later turn can find its previous turn's prompt and reply,
    a tenant's chat after its first the system prompt (its template's few tokens aside)."""
    ok = [r for r in records if r["success"]]
    by_turn = {(r["session"], r["turn"]): r for r in ok}
    first_session = {}
    for r in sorted(ok, key=lambda r: r["session"]):
        first_session.setdefault(r["tenant"], r["session"])
    prompts = sum(r["prompt_tokens"] for r in ok)
    reusable = 0
    for (session, turn), r in by_turn.items():
        if (prev := by_turn.get((session, turn - 1))) is not None:
            reusable += min(r["prompt_tokens"], prev["prompt_tokens"] + prev["output_tokens"])
        elif session != first_session[r["tenant"]]:
            reusable += min(r["prompt_tokens"], system_tokens)
    return reusable / prompts if prompts else None


def summarize(result: dict[str, Any], expected_turns: int, system_tokens: int) -> dict[str, Any]:
    records, duration = result["requests"], result["duration"]
    ok = [r for r in records if r["success"]]
    ttfts = sorted(r["ttft_ms"] for r in ok if r["ttft_ms"] is not None)
    errors: dict[str, int] = {}
    for r in records:
        if not r["success"]:
            errors[r["error"]] = errors.get(r["error"], 0) + 1
    prompt = sum(r["prompt_tokens"] for r in ok)
    cached = sum(r["cached_tokens"] for r in ok)
    return {
        "hit_rate": cached / prompt if prompt else 0.0,
        "reuse_bound": reuse_bound(records, system_tokens),
        "ttft_p50_ms": statistics.median(ttfts) if ttfts else 0.0,
        "ttft_p90_ms": ttfts[min(len(ttfts) - 1, int(0.9 * len(ttfts)))] if ttfts else 0.0,
        "output_throughput": sum(r["output_tokens"] for r in ok) / duration if duration else 0.0,
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "unsent": max(0, expected_turns - len(records)),
        "input_tokens": prompt,
        "cached_tokens": cached,
        "duration_s": duration,
        "errors": errors,
    }
