"""The engine core in its own process: typed messages over ZMQ, the same outputs as in-process,
and failure semantics (a dead core fails every request at once; nothing is left behind)."""
import asyncio
import os
import signal
import subprocess
import sys
import time

import msgspec
import pytest
import torch

from kvflow.engine.arg_utils import EngineArgs
from kvflow.engine.async_llm import AsyncLLM, EngineDeadError
from kvflow.engine.core_client import EngineCoreDied
from kvflow.engine.llm import LLM
from kvflow.engine.messages import (AbortRequests, AddRequests, CoreInput, CoreOutput,
                                    EngineCoreOutputs, EngineCoreRequest, UtilityCall)
from kvflow.core.outputs import EngineCoreOutput, SchedulerStats
from kvflow.sampling_params import SamplingParams

ENGINE = dict(dtype="float32", num_threads=1, max_model_len=256)
PROMPTS = ["The cat sat on", "Once upon a time", "1 2 3 4", "Hello"]


@pytest.fixture(scope="module")
def mp_llm(tiny_llama):
    n = torch.get_num_threads()
    a = AsyncLLM.from_engine_args(EngineArgs(model=tiny_llama, **ENGINE), multiprocess=True)
    yield a
    a.shutdown()
    torch.set_num_threads(n)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:        # a zombie is gone for our purposes
        return f.read().split(")")[-1].split()[0] != "Z"


def _wait_gone(pid: int, timeout: float = 30) -> bool:
    deadline = time.monotonic() + timeout       # a bound against hangs, not a timing assertion
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not _alive(pid)


def test_every_message_round_trips_through_msgpack_with_its_type():
    sp = SamplingParams(temperature=0.7, seed=2**64 - 1, stop=["\n"], stop_token_ids=[3])
    msgs = [AddRequests([EngineCoreRequest("r", [1, 2], sp, 2, 12.5, -3)]),
            AbortRequests(["a", "b"]), UtilityCall(7, "kv_state", [])]
    enc = msgspec.msgpack.Encoder()
    dec_in, dec_out = msgspec.msgpack.Decoder(CoreInput), msgspec.msgpack.Decoder(CoreOutput)
    for m in msgs:
        assert dec_in.decode(enc.encode(m)) == m
    out = EngineCoreOutputs([EngineCoreOutput("r", [5, 6], "stop", 6, 16)], SchedulerStats(3),
                            1.0, 2.0, ["r"], 2)
    back = dec_out.decode(enc.encode(out))
    assert back == out and back.outputs[0].finished
    assert isinstance(back.scheduler_stats, SchedulerStats)
    with pytest.raises(msgspec.ValidationError):     # a wrong field type is refused, not guessed
        dec_in.decode(enc.encode({"type": "AbortRequests"}) + b"")


def test_greedy_streams_from_the_core_process_equal_the_in_process_engine(mp_llm, tiny_llama):
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    ref = LLM(tiny_llama, **ENGINE).generate(PROMPTS, sp, use_tqdm=False)

    async def main():
        async def one(p):
            return [o async for o in mp_llm.generate(p, sp)][-1]
        return await asyncio.gather(*(one(p) for p in PROMPTS))
    got = asyncio.run(main())
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in ref]
    assert [o.outputs[0].text for o in got] == [o.outputs[0].text for o in ref]
    st = asyncio.run(mp_llm.call_utility("kv_state"))
    assert st["unfinished"] == 0 and st["runner_requests"] == 0
    assert st["free_blocks"] == st["num_blocks"]


def test_a_stop_string_found_by_the_frontend_ends_the_request_in_the_core(mp_llm):
    async def main():
        greedy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
        full = [o async for o in mp_llm.generate("Once upon a time", greedy)][-1]
        stop = full.outputs[0].text[4:7]
        sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop])
        cut = [o async for o in mp_llm.generate("Once upon a time", sp)][-1]
        return full, stop, cut
    full, stop, cut = asyncio.run(main())
    c = cut.outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == stop
    assert full.outputs[0].text.startswith(c.text) and stop not in c.text
    st = asyncio.run(mp_llm.call_utility("kv_state"))
    assert st["unfinished"] == 0 and st["free_blocks"] == st["num_blocks"]


def test_an_unknown_utility_is_refused_and_the_core_goes_on(mp_llm):
    with pytest.raises(RuntimeError, match="no engine-core utility"):
        asyncio.run(mp_llm.call_utility("step"))
    assert mp_llm.is_running


def test_a_killed_core_fails_every_stream_at_once_and_health_fails(tiny_llama):
    a = AsyncLLM.from_engine_args(EngineArgs(model=tiny_llama, **ENGINE), multiprocess=True)
    seen = []
    a.on_engine_dead(seen.append)
    pid = a.client.proc.pid
    sp = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)

    async def main():
        streams = [await a.add_request(f"r{i}", p, sp) for i, p in enumerate(PROMPTS)]
        await streams[0].__anext__()                # running
        os.kill(pid, signal.SIGKILL)
        results = []
        for s in streams:
            try:
                async for _ in s:
                    pass
                results.append("finished")
            except EngineDeadError:
                results.append("dead")
        return results
    try:
        results = asyncio.run(asyncio.wait_for(main(), 60))
        assert results == ["dead"] * len(PROMPTS)
        a.client._thread.join(30)                   # the callbacks run after the streams end
        assert not a.is_running and len(seen) == 1 and "exited" in str(seen[0])
        with pytest.raises(EngineDeadError):
            asyncio.run(a.add_request("late", "x", sp))
        with pytest.raises(EngineDeadError):
            asyncio.run(a.check_health())
    finally:
        a.shutdown()
    assert not os.path.exists(a.client._dir)


def test_shutdown_leaves_no_process_and_no_socket_file(tiny_llama):
    a = AsyncLLM.from_engine_args(EngineArgs(model=tiny_llama, **ENGINE), multiprocess=True)
    pid, sock_dir = a.client.proc.pid, a.client._dir
    assert _alive(pid) and os.listdir(sock_dir)
    a.shutdown()
    assert _wait_gone(pid, 5) and not os.path.exists(sock_dir)
    assert a.client.proc.returncode == 0          # it was told to stop, it did not crash


def test_a_load_error_in_the_core_is_raised_by_the_frontend(tiny_llama):
    """Bad arguments only the loaded model can judge stay a ValueError naming them; the core
    process is gone and its socket directory with it."""
    args = EngineArgs(model=tiny_llama, **{**ENGINE, "max_model_len": 1 << 20})
    before = {p for p in os.listdir("/tmp") if p.startswith("kvflow-core-")}
    with pytest.raises(ValueError, match="max_model_len=1048576 exceeds"):
        AsyncLLM.from_engine_args(args, multiprocess=True)
    assert {p for p in os.listdir("/tmp") if p.startswith("kvflow-core-")} == before


def test_a_core_that_dies_while_loading_is_an_error_not_a_hang(tiny_llama, tmp_path):
    (tmp_path / "sitecustomize.py").write_text(
        "import os\nif os.environ.get('KVFLOW_TEST_DIE'):\n    os._exit(3)\n")
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([str(tmp_path)] + sys.path)
    os.environ["KVFLOW_TEST_DIE"] = "1"
    try:
        with pytest.raises(EngineCoreDied, match="exited with code 3 while loading"):
            AsyncLLM.from_engine_args(EngineArgs(model=tiny_llama, **ENGINE), multiprocess=True)
    finally:
        del os.environ["KVFLOW_TEST_DIE"]
        if old is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = old


_ORPHAN = """
import sys, time
from kvflow.engine.arg_utils import EngineArgs
from kvflow.engine.async_llm import AsyncLLM
a = AsyncLLM.from_engine_args(EngineArgs(model=sys.argv[1], dtype="float32", num_threads=1,
                                         max_model_len=256), multiprocess=True)
print(a.client.proc.pid, flush=True)
time.sleep(600)
"""


def test_the_core_process_exits_when_its_frontend_is_killed(tiny_llama):
    """SIGKILL gives the frontend no chance to clean up: the core must notice on its own."""
    proc = subprocess.Popen([sys.executable, "-c", _ORPHAN, tiny_llama], stdout=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        core_pid = int(proc.stdout.readline())
        assert _alive(core_pid)
        proc.kill()
        proc.wait(30)
        assert _wait_gone(core_pid, 30), "the engine core outlived its frontend"
    finally:
        if proc.poll() is None:
            proc.kill()
