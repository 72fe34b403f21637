"""Convert a GGUF file into a Hugging Face-style checkpoint directory.

Weights are dequantized with the `gguf` package (Q4_0, Q4_1, Q8_0, Q4_K, Q6_K, F16,
F32 and the rest it knows) to float32, renamed to Hugging Face names, and for the
Llama architecture the Q/K rows are un-permuted: llama.cpp's converter interleaves
the rotary halves, our model (like transformers) keeps them split. Config and
tokenizer (with the chat template) are read by transformers' GGUF support.

Gemma 3: llama.cpp names its norms differently (`ffn_norm` is the pre-feedforward norm,
there are post-attention and post-feedforward ones) and stores them as (1 + w), so 1 is
taken off to give the Hugging Face checkpoint (as transformers does); the file has no
chat template, so Gemma 3's is written into the tokenizer, and `<end_of_turn>` joins EOS
among the tokens generation stops on.
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors.torch import save_file

from kvserve.logger import logger

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GEMMA3_LAYER_NAMES = _LAYER_NAMES | {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_PERMUTED_ARCHS = ("llama", "mistral")
_ONE_PLUS_NORM_ARCHS = ("gemma3",)  # GGUF norms hold (1 + w)

# Gemma 3's chat template (text only): system folded into the first user turn, BOS once.
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{{ message['content'] | trim }}{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)


def hf_name(gguf_name: str, arch: str = "llama") -> str:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    names = _GEMMA3_LAYER_NAMES if arch == "gemma3" else _LAYER_NAMES
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", gguf_name)
    if not m or m.group(2) not in names:
        raise ValueError(f"unknown GGUF tensor {gguf_name!r}")
    return f"model.layers.{m.group(1)}.{names[m.group(2)]}.{m.group(3)}"


def unpermute_rotary(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's interleaving of the two rotary halves in each head's rows."""
    rows = w.shape[0]
    return w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def read_weights(reader: gguf.GGUFReader, arch: str, heads: int, kv_heads: int) -> dict[str, torch.Tensor]:
    weights = {}
    for t in reader.tensors:
        x = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        x = x.reshape([int(d) for d in reversed(t.shape)])  # GGUF lists the fastest dim first
        name = hf_name(t.name, arch)
        if arch in _PERMUTED_ARCHS and name.endswith(("q_proj.weight", "k_proj.weight")):
            x = unpermute_rotary(x, heads if "q_proj" in name else kv_heads)
        if arch in _ONE_PLUS_NORM_ARCHS and name.endswith("norm.weight"):
            x = x - 1.0
        weights[name] = torch.from_numpy(np.ascontiguousarray(x))
    return weights


def convert_gguf(path: Path, target: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer

    logger.info("converting %s once into %s (dequantized float32)", path.name, target)
    reader = gguf.GGUFReader(path)
    arch = str(reader.fields["general.architecture"].contents())
    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    weights = read_weights(reader, arch, config.num_attention_heads, config.num_key_value_heads)
    config.tie_word_embeddings = "lm_head.weight" not in weights
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    if arch == "gemma3" and not tokenizer.chat_template:
        tokenizer.chat_template = GEMMA3_CHAT_TEMPLATE
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".converting-"))
    try:
        config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        _save_generation_config(tmp, config, tokenizer, arch)
        save_file(weights, tmp / "model.safetensors")
        tmp.rename(target)  # atomic: a crash never leaves a half-written cache entry
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _save_generation_config(target: Path, config, tokenizer, arch: str) -> None:
    """Gemma 3's turns end with `<end_of_turn>`: generation stops there as well as at EOS."""
    if arch != "gemma3":
        return
    eos = [config.eos_token_id, tokenizer.convert_tokens_to_ids("<end_of_turn>")]
    generation = {"bos_token_id": config.bos_token_id, "eos_token_id": eos, "pad_token_id": config.pad_token_id}
    (target / "generation_config.json").write_text(json.dumps(generation, indent=2))
