"""AsyncLLM: concurrent streams share the engine, an early close or an explicit abort frees the
request's blocks before the next step, a failing engine fails its requests instead of hanging."""
import asyncio

import pytest
import torch

from kvflow import LLM, SamplingParams
from kvflow.engine.async_llm import AsyncLLM, EngineDeadError
from kvflow.engine.llm_engine import EngineArgs

ENGINE = dict(dtype="float32", num_threads=1, max_model_len=256)
PROMPTS = ["The cat sees", "A dog likes the river", "Hello, world!", "Number 3 plus 4 is"]


@pytest.fixture(scope="module")
def llm(tiny_llama):
    n = torch.get_num_threads()
    a = AsyncLLM.from_engine_args(EngineArgs(model=tiny_llama, **ENGINE), multiprocess=False)
    yield a
    a.shutdown()
    torch.set_num_threads(n)


def _blocks(engine):
    s = engine.scheduler
    return (len(s.requests), s.kv_cache_manager.block_pool.num_free_blocks,
            engine.scheduler_config.num_blocks)


def test_concurrent_streams_equal_offline_greedy(llm, tiny_llama):
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)

    async def one(p):
        outs = [o async for o in llm.generate(p, sp)]
        lens = [len(o.outputs[0].token_ids) for o in outs]
        assert lens == sorted(lens) and outs[-1].finished and not any(o.finished for o in outs[:-1])
        return outs[-1].outputs[0]

    async def main():
        return await asyncio.gather(*[one(p) for p in PROMPTS])
    got = asyncio.run(main())
    exp = LLM(tiny_llama, **ENGINE).generate(PROMPTS, sp, use_tqdm=False)
    assert [g.text for g in got] == [e.outputs[0].text for e in exp]
    assert [g.token_ids for g in got] == [e.outputs[0].token_ids for e in exp]


def test_closing_a_stream_frees_its_blocks_before_the_next_step(llm):
    sp = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)

    async def main():
        stream = await llm.add_request("early-close", "The cat sees", sp)
        first = await stream.__anext__()
        assert not first.finished
        busy = await llm.call_in_engine(_blocks)
        stream.close()
        # Commands run in order, before any further step: the abort is already applied.
        return busy, await llm.call_in_engine(_blocks)
    (n0, free0, total), (n1, free1, _) = asyncio.run(main())
    assert n0 == 1 and free0 < total
    assert n1 == 0 and free1 == total


def test_breaking_out_of_generate_aborts(llm):
    sp = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)

    async def main():
        agen = llm.generate("A dog likes", sp, request_id="gen-break")
        async for _ in agen:
            break
        await agen.aclose()
        return await llm.call_in_engine(_blocks)
    n, free, total = asyncio.run(main())
    assert n == 0 and free == total


def test_explicit_abort_ends_the_stream(llm):
    sp = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)

    async def main():
        stream = await llm.add_request("to-abort", "Hello, world!", sp)
        await stream.__anext__()
        await llm.abort("to-abort")
        outs = [o async for o in stream]
        return outs, await llm.call_in_engine(_blocks)
    outs, (n, free, total) = asyncio.run(main())
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
    assert len(outs[-1].outputs[0].token_ids) < 200
    assert n == 0 and free == total


def test_cancelled_task_aborts(llm):
    sp = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)

    async def consume():    # suspended inside the generator (awaiting output) when cancelled
        async for _ in llm.generate("The cat sees", sp, request_id="cancelled"):
            pass

    async def main():
        t = asyncio.create_task(consume())
        await asyncio.sleep(0.01)
        t.cancel()
        with pytest.raises(asyncio.CancelledError):
            await t
        return await llm.call_in_engine(_blocks)
    n, free, total = asyncio.run(main())
    assert n == 0 and free == total


def test_bad_request_raises_and_engine_keeps_going(llm):
    async def main():
        with pytest.raises(ValueError, match="max_model_len"):
            await llm.add_request("too-long", list(range(3, 300)), SamplingParams())
        with pytest.raises(ValueError, match="prompt"):
            await llm.add_request("bad-type", 3.5, SamplingParams())
        return [o async for o in llm.generate("ok", SamplingParams(max_tokens=3))][-1]
    assert asyncio.run(main()).finished
    assert llm.is_running


def test_a_failing_step_fails_requests_instead_of_hanging(tiny_llama):
    a = AsyncLLM.from_engine_args(EngineArgs(model=tiny_llama, **ENGINE), multiprocess=False)

    def boom():
        raise RuntimeError("boom")

    async def main():
        await a.call_in_engine(lambda e: setattr(e, "step", boom))
        with pytest.raises(EngineDeadError):
            async for _ in a.generate("The cat", SamplingParams(max_tokens=5)):
                pass
        with pytest.raises(EngineDeadError):
            await a.add_request("after", "The cat", SamplingParams())
    try:
        asyncio.run(asyncio.wait_for(main(), 60))
        assert not a.is_running
    finally:
        a.shutdown()


@pytest.mark.parametrize("stream", [False, True])
def test_server_answers_503_when_the_engine_dies(tiny_llama, stream):
    from fastapi.testclient import TestClient

    from kvflow.server.api_server import build_app
    a = AsyncLLM.from_engine_args(EngineArgs(model=tiny_llama, **ENGINE), multiprocess=False)

    def boom():
        raise RuntimeError("boom")
    asyncio.run(a.call_in_engine(lambda e: setattr(e, "step", boom)))
    body = {"prompt": "The cat", "max_tokens": 2, "stream": stream}
    try:
        with TestClient(build_app(a, "tiny")) as http:
            r = http.post("/v1/completions", json=body)     # accepted, then the step fails
            if stream:
                assert r.status_code == 200
                events = [e for e in r.text.split("\n\n") if e]
                assert '"server_error"' in events[-2] and events[-1] == "data: [DONE]"
            else:
                assert r.status_code == 503 and r.json()["error"]["type"] == "server_error"
            assert http.get("/health").status_code == 503
            r = http.post("/v1/completions", json=body)     # refused at once
            assert r.status_code == 503 and "not running" in r.json()["error"]["message"]
    finally:
        a.shutdown()


# ---- one request's failure is that request's alone (issue 12) ----------------------------------
def _boom_on_marker(monkeypatch):
    """Requests with the stop string "<boom>" fail in their detokenizer; the others do not."""
    from kvflow.engine.detokenizer import IncrementalDetokenizer
    real = IncrementalDetokenizer.update

    def update(self, ids):
        if "<boom>" in self.stop:
            raise RuntimeError("detokenizer boom")
        return real(self, ids)
    monkeypatch.setattr(IncrementalDetokenizer, "update", update)


def test_a_request_failing_in_the_engine_ends_its_stream_with_error_and_others_go_on(
        llm, monkeypatch):
    _boom_on_marker(monkeypatch)
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    async def last(prompt, sp):
        return [o async for o in llm.generate(prompt, sp)][-1]

    async def main():
        alone = await last("The cat sees", sp)
        bad, good = await asyncio.gather(
            last("Hello", SamplingParams(max_tokens=12, stop=["<boom>"])),
            last("The cat sees", sp))
        return alone, bad, good, await llm.call_in_engine(_blocks)
    alone, bad, good, (n, free, total) = asyncio.run(asyncio.wait_for(main(), 120))
    assert bad.finished and bad.outputs[0].finish_reason == "error"
    assert str(bad.outputs[0].error) == "detokenizer boom"
    assert good.outputs[0].token_ids == alone.outputs[0].token_ids
    assert llm.is_running and llm.step_error is None and n == 0 and free == total


def test_a_failing_step_calls_the_engine_dead_callbacks_once(tiny_llama):
    a = AsyncLLM.from_engine_args(EngineArgs(model=tiny_llama, **ENGINE), multiprocess=False)
    seen = []
    a.on_engine_dead(seen.append)

    def boom():
        raise RuntimeError("boom")

    async def main():
        await a.call_in_engine(lambda e: setattr(e, "step", boom))
        with pytest.raises(EngineDeadError):
            async for _ in a.generate("The cat", SamplingParams(max_tokens=5)):
                pass
    try:
        asyncio.run(asyncio.wait_for(main(), 60))
        a.client._thread.join(30)
        assert [str(e) for e in seen] == ["boom"] and str(a.step_error) == "boom"
    finally:
        a.shutdown()
    b = AsyncLLM.from_engine_args(EngineArgs(model=tiny_llama, **ENGINE), multiprocess=False)
    b.on_engine_dead(seen.append)
    b.shutdown()                    # a shutdown is not a failure
    assert len(seen) == 1 and b.step_error is None
