"""`kvserve bench beam` on the tiny model: the counts and the KV figures hang together (no timings)."""

from __future__ import annotations

import argparse
import json

from kvserve.bench import beam
from kvserve.bench.cli import add_bench_parser


def test_beam_bench_cli(tiny_model_dir, tmp_path, capsys):
    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers(dest="command", required=True))
    out = tmp_path / "beam.json"
    args = parser.parse_args(
        ["bench", "beam", "--workload", "random", "--num-prompts", "3", "--prompt-len", "40", "--output-len", "5",
         "--beam-widths", "2", "4", "--hf-batch-size", "2", "--model", str(tiny_model_dir), "--dtype", "float32",
         "--num-kv-blocks", "64", "--output-json", str(out)]
    )  # fmt: skip
    args.func(args)
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert printed == json.loads(out.read_text())
    assert (printed["num_prompts"], printed["prompt_len"], printed["output_len"]) == (3, 40, 5)
    for width, r in zip([2, 4], printed["widths"], strict=True):
        assert r["beam_width"] == width and r["output_tokens"] == 3 * width * 5
        # 3 prompts of 2 full blocks and a partial one, shared by the beams of each
        assert r["peak_kv_blocks"] < r["peak_kv_blocks_separate"] <= 3 * width * 3
        assert r["kv_blocks_saved"] == 1 - r["peak_kv_blocks"] / r["peak_kv_blocks_separate"]
        assert r["hf_output_tok_per_s"] > 0 and 0.0 <= r["same_beams_as_hf"] <= 1.0


def test_vllm_results_join_their_widths():
    """The vLLM worker's answer, per width: tok/s, speedup and same beams, or the error it raised."""
    bench = beam.BeamBenchResult("m", "float32", "cpu", "random", 2, 4, 3, 16, None)
    for width, tok_s in ((2, 30.0), (16, 50.0)):
        bench.widths.append(beam.BeamWidthResult(width, 2 * width * 3, 2 * width * 3 / tok_s, tok_s, 1, 0, 1, 2, 0.5))
    ours = {2: [[[1, 2, 3], [1, 2, 4]], [[5, 6, 7], [5, 6, 8]]], 16: []}
    found = {
        "vllm": "0.32.0",
        "results": [
            {
                "width": 2,
                "wall_time_s": 1.2,
                "output_tokens": 12,
                "beams": [[[1, 2, 3], [1, 2, 4]], [[5, 6, 7], [9, 9, 9]]],
            },
            {"width": 16, "error": "ValueError: requested 32 logprobs"},
        ],
    }
    beam.add_vllm_results(bench, found, ours)
    two, sixteen = bench.widths
    assert bench.vllm_version == "0.32.0"
    assert two.vllm_output_tok_per_s == 10.0 and two.speedup_vs_vllm == 3.0 and two.same_beams_as_vllm == 0.5
    assert sixteen.vllm_error.startswith("ValueError") and sixteen.speedup_vs_vllm is None
