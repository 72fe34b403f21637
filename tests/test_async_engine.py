"""AsyncLLMEngine.from_config keeps torch's OpenMP work off the main thread (see _build_off_main_thread)."""

from __future__ import annotations

import threading

import pytest

from kvserve.config import EngineConfig
from kvserve.engine.async_engine import AsyncLLMEngine
from kvserve.engine.llm_engine import LLMEngine


def test_from_config_loads_the_model_off_the_main_thread(tiny_model_dir, monkeypatch):
    loaded_on: list[str] = []
    real_init = LLMEngine.__init__

    def spy(self, config):
        loaded_on.append(threading.current_thread().name)
        real_init(self, config)

    monkeypatch.setattr(LLMEngine, "__init__", spy)
    engine = AsyncLLMEngine.from_config(EngineConfig(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=16))
    assert threading.current_thread() is threading.main_thread()
    assert loaded_on == ["kvserve-load"]
    assert isinstance(engine.engine, LLMEngine)


def test_from_config_raises_a_load_error_on_the_callers_thread(tmp_path):
    with pytest.raises((FileNotFoundError, ValueError)):
        AsyncLLMEngine.from_config(EngineConfig(model=str(tmp_path / "no-such-model")))
