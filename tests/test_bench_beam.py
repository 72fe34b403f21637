"""`kvserve bench beam` on the tiny model: the counts and the KV figures hang together (no timings)."""

from __future__ import annotations

import argparse
import json

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
