"""`kvflow serve` as a user runs it: a subprocess on 127.0.0.1, talked to with the openai client,
stopped with Ctrl-C; and stopped with SIGTERM while streams are in flight."""
import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import httpx
import openai

from kvflow.cli import build_parser
from kvflow.server.cli import DEFAULT_SERVED_NAME, served_name
from server_helpers import free_port, slow_core_steps, stop


def test_serve_parser_defaults():
    a = build_parser().parse_args(["serve"])
    assert (a.host, a.port, a.model, a.model_tag) == ("127.0.0.1", 8000, None, None)
    assert served_name(None) == DEFAULT_SERVED_NAME == "SmolLM2-135M-Instruct"
    assert served_name("/models/tiny_llama/") == "tiny_llama"
    b = build_parser().parse_args(["bench", "serve", "--request-rate", "4", "--burstiness",
                                   "0.5", "--max-concurrency", "8"])
    assert (b.request_rate, b.burstiness, b.max_concurrency) == ("4", 0.5, 8)


def _wait_up(proc, url: str) -> None:
    deadline = time.monotonic() + 120
    while True:
        assert proc.poll() is None, proc.stdout.read()
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "kvflow serve did not come up"
        time.sleep(0.2)


def test_kvflow_serve_subprocess(tiny_llama):
    port = free_port()
    cmd = [sys.executable, "-m", "kvflow.cli", "serve", "--model", tiny_llama, "--port", str(port),
           "--api-key", "cli-key", "--metrics-no-auth", "--served-model-name", "tiny",
           "tiny-alias", "--dtype", "float32", "--num-threads", "1", "--max-model-len", "128",
           "--log-level", "warning"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ))
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_up(proc, url)
        c = openai.OpenAI(api_key="cli-key", base_url=url + "/v1", max_retries=0, timeout=60)
        assert [m.id for m in c.models.list().data] == ["tiny", "tiny-alias"]
        r = c.completions.create(model="tiny-alias", prompt="The cat", max_tokens=3,
                                 extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 3
        assert httpx.get(url + "/v1/models").status_code == 401
        assert "vllm:generation_tokens_total" in httpx.get(url + "/metrics").text
    finally:
        out = stop(proc, signal.SIGINT, 30)
    assert proc.returncode == 0, out
    assert f"tiny on http://127.0.0.1:{port}" in out


# `kvflow serve` as shipped, with EngineCore.step patched in every Python process it starts (a
# sitecustomize on PYTHONPATH): the engine core runs in a process of its own.
SLOW_STEP = slow_core_steps(0.05)
FAILING_STEP = """from kvflow.engine.core import EngineCore
def step(self):
    raise RuntimeError("step boom")
EngineCore.step = step
"""


def _patched_serve(tmp_path, patch: str, args: list[str]) -> subprocess.Popen:
    (tmp_path / "sitecustomize.py").write_text(patch)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path)] + sys.path)
    return subprocess.Popen([sys.executable, "-m", "kvflow.cli", "serve", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


async def _read_stream(http: httpx.AsyncClient, url: str, max_tokens: int, first: asyncio.Event):
    body = {"prompt": "The cat", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    events = []
    async with http.stream("POST", url + "/v1/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                first.set()
    return events


async def _refused(url: str, tries: int = 100) -> bool:
    for _ in range(tries):
        try:
            async with httpx.AsyncClient(timeout=2) as fresh:
                await fresh.get(url + "/health")
        except httpx.ConnectError:
            return True
        except httpx.TransportError:
            pass
        await asyncio.sleep(0.1)
    return False


async def _running(http: httpx.AsyncClient, url: str, n: int) -> None:
    while True:
        text = (await http.get(url + "/metrics")).text
        if f"vllm:num_requests_running{{model_name=\"tiny\"}} {float(n)}" in text:
            return
        await asyncio.sleep(0.05)


async def _sigterm_during_streams(proc, url: str):
    async with httpx.AsyncClient(timeout=120) as http:
        started = [asyncio.Event(), asyncio.Event()]
        short = asyncio.create_task(_read_stream(http, url, 8, started[0]))
        long = asyncio.create_task(_read_stream(http, url, 400, started[1]))
        plain = asyncio.create_task(http.post(url + "/v1/completions", json={
            "prompt": "A dog", "max_tokens": 400, "ignore_eos": True}))
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
        await asyncio.wait_for(_running(http, url, 3), 60)
        proc.send_signal(signal.SIGTERM)
        refused = await _refused(url)
        return refused, *await asyncio.wait_for(asyncio.gather(short, long, plain), 120)


def test_sigterm_lets_streams_finish_then_ends_the_rest_with_an_error_event(tiny_llama, tmp_path):
    """SIGTERM: no new connections; a stream that ends within --shutdown-timeout ends normally,
    one still running then gets an error event and [DONE] instead of a silent cut, and a
    non-streamed request still running a 503."""
    port = free_port()
    proc = _patched_serve(tmp_path, SLOW_STEP, [
        "--model", tiny_llama, "--port", str(port), "--dtype", "float32", "--num-threads", "1",
        "--max-model-len", "512", "--shutdown-timeout", "4", "--served-model-name", "tiny",
        "--log-level", "info"])
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_up(proc, url)
        refused, short, long, plain = asyncio.run(_sigterm_during_streams(proc, url))
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert refused, "still accepting connections after SIGTERM"
    assert short[-1] == "[DONE]" and json.loads(short[-2])["choices"][0]["finish_reason"] == \
        "length"
    assert long[-1] == "[DONE]"
    err = json.loads(long[-2])["error"]
    assert err["code"] == 503 and "shutting down" in err["message"], long[-3:]
    assert all("error" not in json.loads(e) for e in long[:-2])
    assert plain.status_code == 503 and "shutting down" in plain.json()["error"]["message"]
    assert proc.returncode in (0, -signal.SIGTERM), out
    assert "Traceback" not in out, out


# The engine's step fails on the first request; everything else is `kvflow serve` as shipped.
def test_kvflow_serve_exits_non_zero_when_the_engine_step_fails(tiny_llama, tmp_path):
    port = free_port()
    proc = _patched_serve(tmp_path, FAILING_STEP, [
        "--model", tiny_llama, "--port", str(port), "--dtype", "float32", "--num-threads", "1",
        "--max-model-len", "128", "--log-level", "warning"])
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_up(proc, url)
        r = httpx.post(url + "/v1/completions", json={"prompt": "The cat", "max_tokens": 2},
                       timeout=60)
        assert r.status_code == 503 and r.json()["error"]["type"] == "server_error"
        out, _ = proc.communicate(timeout=60)       # it exits by itself
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 1, out
    assert "step boom" in out and "exiting" in out


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(c) for c in f.read().split()]


def test_kvflow_serve_exits_non_zero_when_its_engine_core_process_is_killed(tiny_llama):
    """The engine core runs in a child process: a SIGKILL there (the OOM killer, say) fails the
    in-flight request, and the server exits 1 rather than answer 503 forever."""
    port = free_port()
    cmd = [sys.executable, "-m", "kvflow.cli", "serve", "--model", tiny_llama, "--port",
           str(port), "--dtype", "float32", "--num-threads", "1", "--max-model-len", "256",
           "--log-level", "warning"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_up(proc, url)
        (core,) = _children(proc.pid)

        async def stream_then_kill():
            body = {"prompt": "The cat", "max_tokens": 250, "ignore_eos": True, "stream": True}
            async with httpx.AsyncClient(timeout=60) as http:
                async with http.stream("POST", url + "/v1/completions", json=body) as r:
                    lines = []
                    async for line in r.aiter_lines():
                        if line.startswith("data: "):
                            if not lines:
                                os.kill(core, signal.SIGKILL)
                            lines.append(line[6:])
                    return lines
        events = asyncio.run(stream_then_kill())
        out, _ = proc.communicate(timeout=60)       # it exits by itself
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["type"] == "server_error"
    assert proc.returncode == 1, out
    assert "exited with code -9" in out
