"""Time kvserve's small-batch kernel against oneDNN's packed bf16 matmul (PackedLinear's
fallback) on the projections of 30 SmolLM2-135M layers, weights cold (the layers' ~212 MB
per copy outrun the caches), interleaved, medians of --repeats: where the two cross is
`SMALL_BATCH_MAX_ROWS` for this CPU (kvserve/kernels/small_batch_linear.py).

    PYTHONPATH=. python tools/bench_linear.py --rows 1,8,64,256

On an AMX host, the paths of a CPU without AMX (AMD Zen 4):

    KVSERVE_DISABLE_AMX=1 ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 PYTHONPATH=. python tools/bench_linear.py

(the same code paths, not a Zen 4's speeds: it runs 512-bit operations at half rate).

On an AVX2-only CPU (`--isa avx2`, its default there) the kernel computes in fp32: it is timed
on weights of bf16 values stored as bf16 ("kvserve") and as fp32 ("kvserve fp32"), against
oneDNN's packed fp32 matmul.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.nn.functional as F

from kvserve.kernels.small_batch_linear import SmallBatchWeight
from kvserve.kernels.small_batch_linear import isa as small_batch_isa
from kvserve.layers.linear import BATCH_SIZE_HINT

# [N, K]: q, k, v, o (hidden 576; 9 query heads, 3 KV heads of 64), gate, up, down (1,536)
SMOLLM2_SHAPES = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,2,4,8,16,32,64,128,256", help="comma-separated row counts")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--isa", default=None, help="the kernel's path: amx, avx512_bf16, avx2 (default: this CPU's)")
    ap.add_argument("--no-onednn", action="store_true", help="time the kernel alone")
    ap.add_argument("--flinear", action="store_true", help="also time F.linear (re-lays the weight out each call)")
    a = ap.parse_args()
    isa = a.isa or small_batch_isa() or small_batch_isa(torch.float32)
    if isa not in ("amx", "avx512_bf16", "avx2"):
        raise SystemExit(f"no small-batch kernel here (isa {isa!r})")
    act = torch.float32 if isa == "avx2" else torch.bfloat16  # what x and oneDNN's weights are
    env = {v: os.environ.get(v, "-") for v in ("KVSERVE_DISABLE_AMX", "ONEDNN_MAX_CPU_ISA")}
    print(f"kernel path {isa}, {torch.get_num_threads()} threads, {a.layers} layers, {env}", flush=True)
    torch.manual_seed(0)
    weights = [[(torch.randn(n, k) * 0.05).to(torch.bfloat16) for n, k in SMOLLM2_SHAPES] for _ in range(a.layers)]
    kernel = [[SmallBatchWeight(w, None, isa) for w in layer] for layer in weights]
    weights = [[w.to(act) for w in layer] for layer in weights]  # what oneDNN and F.linear multiply
    onednn = [[torch.ops.mkldnn._reorder_linear_weight(w, BATCH_SIZE_HINT) for w in layer] for layer in weights]
    kernel_fp32 = []  # on AVX2: the same weights stored as fp32
    if isa == "avx2":
        kernel_fp32 = [[SmallBatchWeight(w, None, isa) for w in layer] for layer in weights]
    ks = [k for _, k in SMOLLM2_SHAPES]

    def kernel_pass(ops):
        def run(x):
            for layer in ops:
                for op, k in zip(layer, ks, strict=True):
                    op(x[k])

        return run

    def onednn_pass(x):
        for layer in onednn:
            for w, k in zip(layer, ks, strict=True):
                torch.ops.mkldnn._linear_pointwise(x[k], w, None, "none", [], "")

    def flinear_pass(x):
        for layer in weights:
            for w, k in zip(layer, ks, strict=True):
                F.linear(x[k], w)

    passes = {"kvserve": kernel_pass(kernel)}
    if kernel_fp32:
        passes["kvserve fp32"] = kernel_pass(kernel_fp32)
    if not a.no_onednn:
        passes["oneDNN"] = onednn_pass
    if a.flinear:
        passes["F.linear"] = flinear_pass
    names = list(passes)
    print("| rows | " + " | ".join(f"{n} ms" for n in names) + " |\n|---|" + "---|" * len(names), flush=True)
    for rows in (int(r) for r in a.rows.split(",")):
        x = {k: torch.randn(rows, k).to(act) for k in set(ks)}
        times: dict[str, list[float]] = {n: [] for n in names}
        for n in names:
            passes[n](x)  # warm-up: oneDNN's kernels, first-touch of outputs
        for rep in range(a.repeats):
            for n in names[rep % len(names) :] + names[: rep % len(names)]:  # rotate who goes first
                start = time.perf_counter()
                passes[n](x)
                times[n].append((time.perf_counter() - start) * 1e3)
        print(f"| {rows} | " + " | ".join(f"{statistics.median(times[n]):.1f}" for n in names) + " |", flush=True)


if __name__ == "__main__":
    main()
