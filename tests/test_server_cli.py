"""`kvflow serve` as a user runs it: a subprocess on 127.0.0.1, talked to with the openai client,
stopped with Ctrl-C."""
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import openai

from kvflow.cli import build_parser
from kvflow.server.cli import DEFAULT_SERVED_NAME, served_name


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_parser_defaults():
    a = build_parser().parse_args(["serve"])
    assert (a.host, a.port, a.model, a.model_tag) == ("127.0.0.1", 8000, None, None)
    assert served_name(None) == DEFAULT_SERVED_NAME == "SmolLM2-135M-Instruct"
    assert served_name("/models/tiny_llama/") == "tiny_llama"
    b = build_parser().parse_args(["bench", "serve", "--request-rate", "4", "--burstiness",
                                   "0.5", "--max-concurrency", "8"])
    assert (b.request_rate, b.burstiness, b.max_concurrency) == ("4", 0.5, 8)


def test_kvflow_serve_subprocess(tiny_llama):
    port = _free_port()
    cmd = [sys.executable, "-m", "kvflow.cli", "serve", "--model", tiny_llama, "--port", str(port),
           "--api-key", "cli-key", "--served-model-name", "tiny", "tiny-alias", "--dtype",
           "float32", "--num-threads", "1", "--max-model-len", "128", "--log-level", "warning"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ))
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "kvflow serve did not come up"
            time.sleep(0.2)
        c = openai.OpenAI(api_key="cli-key", base_url=url + "/v1", max_retries=0, timeout=60)
        assert [m.id for m in c.models.list().data] == ["tiny", "tiny-alias"]
        r = c.completions.create(model="tiny-alias", prompt="The cat", max_tokens=3,
                                 extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 3
        assert httpx.get(url + "/v1/models").status_code == 401
        assert "vllm:generation_tokens_total" in httpx.get(url + "/metrics").text
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            out, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
    assert proc.returncode == 0, out
    assert f"tiny on http://127.0.0.1:{port}" in out


# The engine's step fails on the first request; everything else is `kvflow serve` as shipped.
_FAILING_STEP = """
import sys
from kvflow.engine.llm_engine import LLMEngine
def step(self):
    raise RuntimeError("step boom")
LLMEngine.step = step
from kvflow.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_kvflow_serve_exits_non_zero_when_the_engine_step_fails(tiny_llama):
    port = _free_port()
    cmd = [sys.executable, "-c", _FAILING_STEP, "serve", "--model", tiny_llama, "--port",
           str(port), "--dtype", "float32", "--num-threads", "1", "--max-model-len", "128",
           "--log-level", "warning"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ))
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "kvflow serve did not come up"
            time.sleep(0.2)
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
