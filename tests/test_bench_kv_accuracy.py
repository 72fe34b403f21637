"""`kvserve bench kv-accuracy`: each KV dtype's full next-token distributions against fp32 K/V."""

from __future__ import annotations

import random

import pytest

from kvserve.bench.kv_accuracy import KVAccuracyConfig, KVAccuracyResult, run_kv_accuracy
from kvserve.entrypoints.cli import build_parser

CONTEXT = 40  # over two 16-token blocks, so decode-side paged K/V is read too


@pytest.fixture(scope="module")
def report(tiny_model_dir):
    rng = random.Random(0)
    windows = {CONTEXT: [[rng.randrange(3, 49152) for _ in range(CONTEXT)] for _ in range(2)]}
    config = KVAccuracyConfig(
        model=str(tiny_model_dir),
        kv_cache_dtypes=("float32", "bfloat16", "int8"),
        context_lens=(CONTEXT,),
        num_samples=2,
        kv_cache_memory="16MiB",
    )
    return run_kv_accuracy(config, windows)


def by_dtype(report) -> dict[str, KVAccuracyResult]:
    return {r.kv_cache_dtype: r for r in report.results}


def test_fp32_against_itself_is_exact(report):
    r = by_dtype(report)["float32"]
    assert r.positions == 2 * (CONTEXT - 1)
    assert r.kl_mean == 0 and r.kl_max == 0
    assert r.top1_agreement == 1.0
    assert r.perplexity == r.reference_perplexity and r.perplexity_rel == 0
    assert r.meets_targets


def test_bf16_kv_gives_a_small_positive_kl(report):
    r = by_dtype(report)["bfloat16"]
    assert 0 < r.kl_mean <= r.kl_max < 0.1
    assert 0 <= r.top1_agreement <= 1
    assert r.perplexity > 0 and abs(r.perplexity_rel) < 0.05
    assert r.reference_perplexity == by_dtype(report)["float32"].reference_perplexity


def test_int8_kv_gives_a_small_positive_kl(report):
    r = by_dtype(report)["int8"]
    assert r.positions == 2 * (CONTEXT - 1)
    assert 0 < r.kl_mean <= r.kl_max < 0.1
    assert r.perplexity > 0 and abs(r.perplexity_rel) < 0.05


def test_the_subcommand_parses():
    args = build_parser().parse_args(["bench", "kv-accuracy", "--context-lens", "64", "--num-samples", "1"])
    assert args.dtype == "float32" and args.context_lens == "64" and args.model == "smollm2-135m"
    assert args.kv_cache_dtypes == "float32,bfloat16,int8"


def test_the_table_lists_every_dtype(report):
    from rich.console import Console

    from kvserve.bench.kv_accuracy import print_table

    console = Console(record=True, width=160)
    print_table(report, console)
    text = console.export_text()
    assert all(kv in text for kv in ("float32", "bfloat16", "int8")) and "meets" in text


def test_the_parsers_defaults_are_the_configs():
    """The parser repeats KVAccuracyConfig's defaults (importing it would load torch into every command)."""
    from kvserve.bench.kv_accuracy import KVAccuracyConfig
    from kvserve.entrypoints.cli import build_parser

    args = build_parser().parse_args(["bench", "kv-accuracy"])
    config = KVAccuracyConfig()
    assert (args.model, args.dtype, args.num_samples) == (config.model, config.dtype, config.num_samples)
    assert args.kv_cache_dtypes.split(",") == list(config.kv_cache_dtypes)


class CharTokenizer:
    """One id per character, and a <bos> (id 1) first when asked for special tokens, as Gemma's."""

    def __init__(self, bos: bool):
        self.bos = bos

    def encode(self, text: str, add_special_tokens: bool = True, verbose: bool = True) -> list[int]:
        return [1] * (self.bos and add_special_tokens) + [ord(c) for c in text]


@pytest.mark.parametrize("bos", [True, False])
def test_windows_start_as_a_served_prompt_does(bos):
    from kvserve.bench.kv_accuracy import leading_special_tokens, sharegpt_windows

    tokenizer = CharTokenizer(bos)
    assert leading_special_tokens(tokenizer) == ([1] if bos else [])
    windows = sharegpt_windows(tokenizer, 64, 3, seed=0)
    assert [len(w) for w in windows] == [64, 64, 64]
    assert all((w[0] == 1) == bos and 1 not in w[1:] for w in windows)
    assert len({tuple(w[bos:]) for w in windows}) == 3  # successive stretches of the text, not one repeated
