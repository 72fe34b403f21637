"""A step that raises fails the requests it computed, frees their blocks and leaves the engine
serving everyone else: in LLMEngine, in AsyncLLMEngine and over HTTP.

The fault is injected into the model runner (or the output stage) for steps that hold one chosen
request, as a bug or a bad kernel input would raise there."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from test_server_common import TINY_ARGS, ServerThread

from kvserve.config import EngineConfig
from kvserve.engine.async_engine import AsyncLLMEngine
from kvserve.engine.llm_engine import LLMEngine, StepFailedError
from kvserve.entrypoints.llm import LLM
from kvserve.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPT = list(range(100, 140))  # 40 tokens: two full blocks of 16 and a tail
OTHER = list(range(300, 333))


def make_engine(model_dir, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model_dir), dtype="float32", num_kv_blocks=32, max_model_len=256, **kw))


class FailWhen:
    """Wraps an engine method so that it raises while request `group_id` is in the step, `times` times."""

    def __init__(self, engine: LLMEngine, obj: object, name: str, group_id: str, times: int = 1):
        self.engine, self.real, self.group_id, self.left = engine, getattr(obj, name), group_id, times
        setattr(obj, name, self)

    def __call__(self, *args, **kwargs):
        out = self.engine._step_out
        if self.left and out is not None and any(s.request.group_id == self.group_id for s in out.scheduled):
            self.left -= 1
            raise RuntimeError(f"injected fault for {self.group_id}")
        return self.real(*args, **kwargs)


def run(engine: LLMEngine) -> dict[str, list[int]]:
    done = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o.outputs[0].token_ids
    return done


def check_clean(engine: LLMEngine) -> None:
    engine.kv.check_integrity()
    assert engine.kv.pool.num_used_blocks == 0 and not engine.output_processor.groups


@pytest.fixture(scope="module")
def reference(tiny_model_dir) -> dict[str, list[int]]:
    engine = make_engine(tiny_model_dir)
    engine.add_request(PROMPT, GREEDY, "a")
    engine.add_request(OTHER, GREEDY, "b")
    return run(engine)


def test_a_failed_forward_fails_its_request_only_and_caches_nothing_it_computed(tiny_model_dir, reference):
    engine = make_engine(tiny_model_dir, max_num_seqs=1)  # "b" waits while "a" runs
    FailWhen(engine, engine.runner, "execute", "a")
    engine.add_request(PROMPT, GREEDY, "a")
    engine.add_request(OTHER, GREEDY, "b")
    with pytest.raises(StepFailedError) as failed:
        engine.step()
    assert failed.value.request_ids == ["a"] and "injected fault" in str(failed.value)
    assert list(engine.output_processor.groups) == ["b"]
    assert engine.stats.finished_requests["error"] == 1
    assert run(engine) == {"b": reference["b"]}
    check_clean(engine)
    # the failed prefill's blocks never entered the prefix cache: the prompt is computed again, the same
    engine.add_request(PROMPT, GREEDY, "a2")
    first = engine.step()[0]
    assert first.num_cached_tokens == 0
    assert run(engine) == {"a2": reference["a"]}


def test_a_failure_after_the_forward_keeps_the_computed_blocks_correct(tiny_model_dir, reference):
    engine = make_engine(tiny_model_dir)
    engine.add_request(PROMPT, GREEDY, "a")
    engine.add_request(OTHER, GREEDY, "b")
    engine.step()  # both prefilled
    FailWhen(engine, engine.output_processor, "update_text", "a", times=2)
    with pytest.raises(StepFailedError) as failed:  # a decode of both: both fail
        engine.step()
    assert sorted(failed.value.request_ids) == ["a", "b"]
    check_clean(engine)
    engine.add_request(PROMPT, GREEDY, "a2")
    assert engine.step()[0].num_cached_tokens == 32  # two full blocks, computed before the fault
    assert run(engine) == {"a2": reference["a"]}
    check_clean(engine)


def test_llm_generate_raises_and_leaves_the_engine_empty(tiny_model_dir, reference):
    llm = LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=32, max_model_len=256, max_num_seqs=1)
    engine = llm.llm_engine
    FailWhen(engine, engine.runner, "execute", "0")
    with pytest.raises(StepFailedError):
        llm.generate([PROMPT, OTHER], GREEDY, use_tqdm=False)
    check_clean(engine)  # the call's other prompt went with it
    assert [o.outputs[0].token_ids for o in llm.generate([PROMPT], GREEDY, use_tqdm=False)] == [reference["a"]]


def test_async_engine_fails_one_stream_and_serves_the_next(tiny_model_dir, reference):
    engine = AsyncLLMEngine.from_config(
        EngineConfig(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=32, max_model_len=256)
    )
    FailWhen(engine.engine, engine.engine.runner, "execute", "a")

    async def go() -> list[int]:
        engine.start()
        try:
            with pytest.raises(StepFailedError):
                async for _ in engine.generate(PROMPT, GREEDY, "a"):
                    pass
            engine.check_health()
            outs = [o async for o in engine.generate(OTHER, GREEDY, "b")]
            return outs[-1].outputs[0].token_ids
        finally:
            await engine.stop()

    assert asyncio.run(go()) == reference["b"]
    check_clean(engine.engine)


@pytest.mark.parametrize("stream", [False, True])
def test_http_a_failed_request_is_a_500_and_the_server_serves_on(tiny_model_dir, stream):
    with ServerThread(tiny_model_dir, *TINY_ARGS) as server:
        core = server.engine.engine
        real = core.runner.execute

        def execute(out):  # a decode of PROMPT's request, after its first token went out
            if any(s.request.prompt_token_ids == PROMPT and s.request.num_computed_tokens > 40 for s in out.scheduled):
                raise RuntimeError("injected fault")
            return real(out)

        core.runner.execute = execute
        body = {"model": str(tiny_model_dir), "max_tokens": 4, "temperature": 0, "stream": stream}
        r = httpx.post(f"{server.url}/v1/completions", json={**body, "prompt": PROMPT}, timeout=60)
        if stream:  # the first token went out before the engine failed: the error comes as an event
            assert r.status_code == 200 and '"type":"server_error"' in r.text
        else:
            assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
        assert httpx.get(f"{server.url}/health").status_code == 200
        r = httpx.post(f"{server.url}/v1/completions", json={**body, "prompt": OTHER}, timeout=60)
        assert r.status_code == 200 and "error" not in r.text
        assert 'kvserve:request_success_total{finished_reason="error"' in httpx.get(f"{server.url}/metrics").text
