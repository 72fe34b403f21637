"""KV dtype accuracy: teacher-forced next-token distributions, each KV dtype against fp32 K/V.

Fixed text: ShareGPT conversations (shuffled by the seed, every turn joined by blank lines, one
token stream) cut into windows of `context_len` tokens, each led by the special tokens the
tokenizer puts before any text (Gemma's <bos>; none for SmolLM2), as a served prompt is: Gemma
without its <bos> is off its training distribution (perplexity 2.4x), and its first position then
holds an outlier K/V row that no real prompt has. Each window is prefilled once per KV
dtype with the same weights and compute dtype; the engine's prompt-logprob path hands the bench
the full fp32 log_softmax over the vocabulary at every position (ModelRunner's
`prompt_logprob_rows` hook), so KL is exact, not over a top-k. Per KV dtype against the fp32-KV
run: mean and max KL(fp32 || dtype) of the next-token distributions, top-1 agreement, and
perplexity of the text's own next tokens. bf16 K/V against fp32 K/V is the noise floor the
quantized KV dtype (int8, issue #49) is judged beside.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from rich.console import Console
from rich.table import Table

from kvserve.config import KV_CACHE_DTYPES

REFERENCE = "float32"
# issue #49's targets: KL at most 1e-3 at 512 tokens and 2e-3 at 2,048 (longer contexts get the
# looser bound), top-1 agreement at least 98.5%, perplexity within 0.5% of fp32 K/V
TARGET_TOP1 = 0.985
TARGET_PPL_REL = 0.005


def target_kl(context_len: int) -> float:
    return 1e-3 if context_len <= 512 else 2e-3


def engine_kv_dtypes() -> tuple[str, ...]:
    """The KV dtypes the engine accepts by name (auto resolves to one of them)."""
    return tuple(d for d in KV_CACHE_DTYPES if d != "auto")


@dataclass
class KVAccuracyConfig:
    model: str = "smollm2-135m"
    dtype: str = "float32"  # compute dtype of every run: bf16 K/V rounding is then the only difference
    kv_cache_dtypes: tuple[str, ...] = field(default_factory=engine_kv_dtypes)
    context_lens: tuple[int, ...] = (512, 2048)
    num_samples: int = 4  # windows per context length
    seed: int = 0
    kv_cache_memory: str = "512MiB"


@dataclass
class KVAccuracyResult:
    context_len: int
    kv_cache_dtype: str
    positions: int  # next-token distributions compared
    kl_mean: float  # nats, mean over positions of KL(fp32 K/V || this K/V)
    kl_max: float
    top1_agreement: float  # share of positions whose argmax matches fp32 K/V's
    perplexity: float  # exp(mean NLL of the text's next token)
    reference_perplexity: float  # the fp32-KV run's
    perplexity_rel: float  # perplexity / reference_perplexity - 1
    seconds: float  # prefill time of this KV dtype's runs
    meets_targets: bool = False


@dataclass
class KVAccuracyReport:
    model: str
    dtype: str
    num_samples: int
    seed: int
    results: list[KVAccuracyResult]


def leading_special_tokens(tokenizer) -> list[int]:
    """The ids the tokenizer puts before any text when it adds special tokens (Gemma's <bos>)."""
    plain = tokenizer.encode("a", add_special_tokens=False)
    full = tokenizer.encode("a", add_special_tokens=True)
    return full[: full.index(plain[0])]


def sharegpt_windows(tokenizer, context_len: int, num_samples: int, seed: int) -> list[list[int]]:
    """`num_samples` windows of `context_len` tokens: the leading special tokens, then the next
    stretch of shuffled ShareGPT text."""
    from kvserve.bench.datasets import iter_json_array, sharegpt_path

    records = list(iter_json_array(sharegpt_path().read_text(encoding="utf-8")))
    random.Random(seed).shuffle(records)
    sep = tokenizer.encode("\n\n", add_special_tokens=False)
    head = leading_special_tokens(tokenizer)
    text_len = context_len - len(head)
    stream: list[int] = []
    need = text_len * num_samples
    for record in records:
        turns = (record.get("conversations") or []) if isinstance(record, dict) else []
        text = "\n\n".join(t["value"] for t in turns if isinstance(t, dict) and t.get("value"))
        if text:
            stream += tokenizer.encode(text, add_special_tokens=False, verbose=False) + sep
        if len(stream) >= need:
            break
    if len(stream) < need:
        raise ValueError(f"ShareGPT holds {len(stream)} tokens, asked {need}")
    return [head + stream[i * text_len : (i + 1) * text_len] for i in range(num_samples)]


class _Accumulator:
    def __init__(self) -> None:
        self.positions = 0
        self.kl_sum = 0.0
        self.kl_max = 0.0
        self.agree = 0
        self.nll_sum = 0.0
        self.seconds = 0.0

    def add(self, ref: torch.Tensor, test: torch.Tensor, targets: torch.Tensor) -> None:
        p = ref.exp()
        kl = torch.where(p > 0, p * (ref - test), torch.zeros_like(p)).sum(-1).clamp_min(0)
        self.positions += len(kl)
        self.kl_sum += float(kl.double().sum())
        self.kl_max = max(self.kl_max, float(kl.max()))
        self.agree += int((ref.argmax(-1) == test.argmax(-1)).sum())
        self.nll_sum -= float(test.gather(1, targets[:, None]).double().sum())


def _prefill(llm, window: list[int], sink: Callable[[int, torch.Tensor], None]) -> float:
    """Teacher-forced prefill of `window`; `sink(first position, rows)` gets each chunk's full
    log_softmax rows as the engine computes them (no whole-window copy: Gemma's 262k vocabulary
    makes one 2 GiB at 2,048 tokens). Returns the seconds it took."""
    from kvserve import SamplingParams

    runner = llm.llm_engine.runner
    runner.prompt_logprob_rows = lambda _req, lo, logprobs: sink(lo, logprobs)
    try:
        t0 = time.perf_counter()
        llm.generate([window], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0), use_tqdm=False)
        return time.perf_counter() - t0
    finally:
        runner.prompt_logprob_rows = None


def _reference(llm, window: list[int]) -> tuple[torch.Tensor, float]:
    """The fp32-KV run's rows for every position, one [len - 1, vocab] tensor filled in place."""
    ref: list[torch.Tensor] = []
    seen = []

    def keep(lo: int, rows: torch.Tensor) -> None:
        if not ref:
            ref.append(torch.empty(len(window) - 1, rows.shape[1]))
        ref[0][lo : lo + len(rows)] = rows
        seen.append(len(rows))

    seconds = _prefill(llm, window, keep)
    if sum(seen) != len(window) - 1:
        raise RuntimeError(f"expected {len(window) - 1} prompt positions, got {sum(seen)}")
    return ref[0], seconds


def run_kv_accuracy(
    config: KVAccuracyConfig,
    windows: dict[int, list[list[int]]] | None = None,
    log: Callable[[str], None] = lambda _msg: None,
) -> KVAccuracyReport:
    """`windows`: token windows by context length (default: ShareGPT windows of each length)."""
    from kvserve import LLM

    others = [d for d in config.kv_cache_dtypes if d != REFERENCE]
    engines = {}
    for kv in (REFERENCE, *others):
        engines[kv] = LLM(
            model=config.model,
            dtype=config.dtype,
            kv_cache_dtype=kv,
            kv_cache_memory=config.kv_cache_memory,
            max_model_len=max(config.context_lens) + 1,
            enable_prefix_caching=False,  # every run computes its whole window with its own K/V
            seed=config.seed,
        )
    tokenizer = engines[REFERENCE].get_tokenizer()
    results = []
    for context_len in config.context_lens:
        samples = (windows or {}).get(context_len) or sharegpt_windows(
            tokenizer, context_len, config.num_samples, config.seed
        )
        ref_acc = _Accumulator()
        accs = {kv: _Accumulator() for kv in (REFERENCE, *others)}
        for i, window in enumerate(samples):
            targets = torch.tensor(window[1:])
            ref, _ = _reference(engines[REFERENCE], window)
            ref_acc.nll_sum -= float(ref.gather(1, targets[:, None]).double().sum())
            ref_acc.positions += len(ref)
            for kv, acc in accs.items():  # fp32 again too: the comparison's own floor (0 when deterministic)
                before = acc.positions
                acc.seconds += _prefill(
                    engines[kv],
                    window,
                    lambda lo, rows, acc=acc, ref=ref, t=targets: acc.add(
                        ref[lo : lo + len(rows)], rows, t[lo : lo + len(rows)]
                    ),
                )
                if acc.positions - before != len(ref):
                    raise RuntimeError(f"{kv}: expected {len(ref)} prompt positions, got {acc.positions - before}")
            del ref
            log(f"{context_len} tokens: window {i + 1}/{len(samples)} done")
        ref_ppl = math.exp(ref_acc.nll_sum / ref_acc.positions)
        for kv in config.kv_cache_dtypes:
            a = accs[kv]
            ppl = math.exp(a.nll_sum / a.positions)
            r = KVAccuracyResult(
                context_len,
                kv,
                positions=a.positions,
                kl_mean=a.kl_sum / a.positions,
                kl_max=a.kl_max,
                top1_agreement=a.agree / a.positions,
                perplexity=ppl,
                reference_perplexity=ref_ppl,
                perplexity_rel=ppl / ref_ppl - 1,
                seconds=a.seconds,
            )
            r.meets_targets = (
                r.kl_mean <= target_kl(context_len)
                and r.top1_agreement >= TARGET_TOP1
                and abs(r.perplexity_rel) <= TARGET_PPL_REL
            )
            results.append(r)
    return KVAccuracyReport(config.model, config.dtype, config.num_samples, config.seed, results)


def print_table(report: KVAccuracyReport, console: Console | None = None) -> None:
    table = Table(
        title=f"KV dtype accuracy: {report.model}, compute {report.dtype}, against fp32 K/V "
        f"({report.num_samples} ShareGPT windows per context)"
    )
    for col in ("context", "KV dtype", "positions", "KL mean", "KL max", "top-1", "ppl", "ppl vs fp32", "targets"):
        table.add_column(col, justify="right")
    for r in report.results:
        table.add_row(
            str(r.context_len),
            r.kv_cache_dtype,
            str(r.positions),
            f"{r.kl_mean:.2e}",
            f"{r.kl_max:.2e}",
            f"{r.top1_agreement:.2%}",
            f"{r.perplexity:.3f}",
            f"{r.perplexity_rel:+.3%}",
            "meets" if r.meets_targets else "MISSES",
        )
    console = console or Console()
    if not console.is_terminal:
        console.width = max(console.width, 120)  # piped to a file: the whole table, not 80 columns of it
    console.print(table)
    console.print(
        f"targets (issue #49): KL <= 1e-3 at 512 tokens, 2e-3 at 2,048; top-1 >= {TARGET_TOP1:.1%}; "
        f"perplexity within {TARGET_PPL_REL:.1%}"
    )
