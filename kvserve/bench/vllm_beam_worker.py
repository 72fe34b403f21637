"""vLLM's `LLM.beam_search` on `kvserve bench beam`'s prompts, for its `--vllm-python` baseline.

Run by a Python that has vLLM (its own virtual environment, e.g. the peers' $ANCHORS/vllm-venv),
not by kvserve's: it imports nothing from kvserve. Reads one JSON object on stdin (model,
dtype, prompts as token ids, output_len, widths, max_model_len, out) and writes one JSON
object to the file `out` (vLLM logs to stdout):
per width the output tokens (the returned beams' generated tokens, as kvserve counts them),
the wall time and the beams, or the error vLLM raised. Prefix caching is on, as vLLM's own
beam search relies on it to share the prompt's blocks between beams.
"""

from __future__ import annotations

import json
import sys
import time


def run_width(llm, prompts: list[dict], width: int, output_len: int) -> dict:
    from vllm.sampling_params import BeamSearchParams

    llm.beam_search(prompts, BeamSearchParams(beam_width=width, max_tokens=3, ignore_eos=True))  # warm up
    start = time.perf_counter()
    outs = llm.beam_search(prompts, BeamSearchParams(beam_width=width, max_tokens=output_len, ignore_eos=True))
    wall = time.perf_counter() - start
    beams = [
        [seq.tokens[len(p["prompt_token_ids"]) :] for seq in out.sequences]
        for p, out in zip(prompts, outs, strict=True)
    ]
    return {
        "width": width,
        "wall_time_s": wall,
        "output_tokens": sum(len(b) for bs in beams for b in bs),
        "beams": beams,
    }


def main() -> None:
    spec = json.load(sys.stdin)
    from vllm import LLM

    llm = LLM(
        model=spec["model"],
        dtype=spec["dtype"],
        max_model_len=spec["max_model_len"],
        enable_prefix_caching=True,
        max_logprobs=2 * max(spec["widths"]),  # its beam search asks for 2 x width logprobs a step
        seed=0,
    )
    prompts = [{"prompt_token_ids": ids} for ids in spec["prompts"]]
    results = []
    for width in spec["widths"]:
        try:
            results.append(run_width(llm, prompts, width, spec["output_len"]))
        except Exception as e:  # a width vLLM refuses is a finding of the run, not its end
            results.append({"width": width, "error": f"{type(e).__name__}: {e}"})
    with open(spec["out"], "w") as f:
        json.dump({"vllm": __import__("vllm").__version__, "results": results}, f)


if __name__ == "__main__":
    main()
