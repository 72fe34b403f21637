"""Record or compare SmolLM2's greedy outputs for a fixed set of prompts.

A refactor that must not change behaviour records the outputs on the old commit and
compares them on the new one, on the same machine (kernels differ between CPU kinds,
so a recording is only comparable with one made on the same kind):

    PYTHONPATH=/path/to/old/checkout python tools/greedy_outputs.py record old.json
    python tools/greedy_outputs.py compare old.json

Each dtype runs the prompts twice in one engine: all at once (batched decodes,
prefill chunks side by side) and again after, when their prefixes come from the cache.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

PROMPTS = [
    "The capital of France is",
    "Write a haiku about the ocean.",
    "def fibonacci(n):",
    "List three colours of the rainbow:",
    "In 1969, the first humans to walk on the Moon were",
    "Explain what a KV cache is in one sentence.",
    "1, 2, 3, 5, 8, 13,",
    "Translate 'good morning' into Spanish:",
]
DTYPES = ("float32", "bfloat16", "auto")


def run(dtype: str, max_tokens: int) -> dict[str, list[list[int]]]:
    from kvserve import LLM, SamplingParams

    llm = LLM(dtype=dtype, max_num_batched_tokens=64, seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    chats = [[{"role": "user", "content": p}] for p in PROMPTS]
    rounds = {}
    for name in ("cold", "cached"):
        rounds[f"generate-{name}"] = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
        rounds[f"chat-{name}"] = [o.outputs[0].token_ids for o in llm.chat(chats, params, use_tqdm=False)]
    return rounds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("action", choices=("record", "compare"))
    parser.add_argument("file", type=Path)
    parser.add_argument("--max-tokens", type=int, default=48)
    args = parser.parse_args()
    outputs = {dtype: run(dtype, args.max_tokens) for dtype in DTYPES}
    if args.action == "record":
        args.file.write_text(json.dumps(outputs) + "\n")
        print(f"recorded {len(DTYPES)} dtypes x {len(PROMPTS)} prompts in {args.file}")
        return 0
    recorded = json.loads(args.file.read_text())
    differ = [
        f"{dtype} {run_name} prompt {i}"
        for dtype, runs in recorded.items()
        for run_name, seqs in runs.items()
        for i, seq in enumerate(seqs)
        if outputs[dtype][run_name][i] != seq
    ]
    total = sum(len(seqs) for runs in recorded.values() for seqs in runs.values())
    print(f"{total - len(differ)} of {total} outputs identical")
    for d in differ:
        print(f"differs: {d}")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
