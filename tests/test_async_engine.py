"""AsyncLLMEngine: from_config keeps torch's OpenMP work off the main thread (see _build_off_main_thread),
and the EngineClient surface the server uses."""

from __future__ import annotations

import asyncio
import threading

import pytest

from kvserve.config import EngineConfig
from kvserve.engine.async_engine import AsyncLLMEngine
from kvserve.engine.client import EngineDeadError, ModelInfo
from kvserve.engine.llm_engine import LLMEngine
from kvserve.sampling_params import SamplingParams


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


def test_engine_client_surface(tiny_model_dir):
    """What the server uses: model info, load, generate, abort, reset of the prefix cache, health."""
    engine = AsyncLLMEngine.from_config(
        EngineConfig(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=64, max_model_len=256)
    )
    assert engine.model_info == ModelInfo(str(tiny_model_dir), 256, 49152)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    prompt = list(range(100, 140))

    async def run() -> None:
        engine.start()
        try:
            outs = [o async for o in engine.generate(prompt, params, "a")]
            assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 4
            load = engine.load()
            assert (load.num_running, load.num_waiting, load.kv_cache_usage) == (0, 0, 0.0)
            assert load.totals.generation_tokens == 4 and not engine.unfinished_request_ids()
            stream = engine.generate(prompt, SamplingParams(max_tokens=200, ignore_eos=True), "b")
            await anext(stream)
            assert "b" in engine.unfinished_request_ids()
            assert await engine.reset_prefix_cache() is False  # refused while "b" runs
            await engine.abort("b")
            while engine.unfinished_request_ids():
                await asyncio.sleep(0.01)
            await stream.aclose()
            assert engine.engine.kv.prefix_cache.size_info().cached_blocks > 0
            assert await engine.reset_prefix_cache() is True
            assert engine.engine.kv.prefix_cache.size_info().cached_blocks == 0
            engine.check_health()
            engine.errored = RuntimeError("boom")
            with pytest.raises(EngineDeadError, match="stopped after an error"):
                engine.check_health()
        finally:
            engine.errored = None
            await engine.stop()

    asyncio.run(run())
