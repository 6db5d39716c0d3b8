"""The router in front of real kvflow servers on the tiny model: what a client gets through it
is what it gets from a replica directly; and `kvflow serve --data-parallel-size 2` as a user
runs it, replicas gone with it."""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys

import httpx
import openai

from router_helpers import running_router, wait_until
from server_helpers import free_port_run, running_server, stop

MESSAGES = [{"role": "system", "content": "You answer briefly."},
            {"role": "user", "content": "Name a colour."}]


def _client(url: str, key: str | None = None) -> openai.OpenAI:
    return openai.OpenAI(api_key=key or "none", base_url=url + "/v1", max_retries=0, timeout=60)


def _answers(c: openai.OpenAI, model: str) -> list[str]:
    kw = dict(model=model, max_tokens=8, temperature=0.0, extra_body={"ignore_eos": True})
    chat = c.chat.completions.create(messages=MESSAGES, **kw).choices[0].message.content
    chat_s = "".join(ch.choices[0].delta.content or "" for ch in
                     c.chat.completions.create(messages=MESSAGES, stream=True, **kw)
                     if ch.choices)
    comp = c.completions.create(prompt="The cat sat", **kw).choices[0].text
    comp_s = "".join(ch.choices[0].text for ch in
                     c.completions.create(prompt="The cat sat", stream=True, **kw))
    return [chat, chat_s, comp, comp_s]


def test_two_real_replicas_behind_the_router_answer_as_one_does(tiny_llama):
    with running_server(tiny_llama, api_key="k") as s0, \
            running_server(tiny_llama, api_key="k") as s1, \
            running_router([s0.url, s1.url], "round_robin", api_key="k") as rt:
        direct = _answers(_client(s0.url, "k"), "tiny")
        routed = _answers(_client(rt.url, "k"), "tiny")
        assert routed == direct and direct[0] == direct[1] and direct[2] == direct[3]
        assert [m.id for m in _client(rt.url, "k").models.list().data] == ["tiny"]
        text = httpx.get(rt.url + "/metrics", headers={"Authorization": "Bearer k"}).text
        for u in (s0.url, s1.url):      # round-robin: both replicas served
            assert f'kvflow_router_requests_total{{policy="round_robin",replica="{u}"}} 2.0' \
                in text


def _up(url: str) -> bool:
    with contextlib.suppress(httpx.HTTPError):
        return httpx.get(url + "/health", timeout=2).status_code == 200
    return False


def test_serve_data_parallel_runs_replicas_behind_a_router_and_takes_them_down(tiny_llama):
    port = free_port_run(2)
    url, replicas = f"http://127.0.0.1:{port}", [f"http://127.0.0.1:{port + i}" for i in (1, 2)]
    cmd = [sys.executable, "-m", "kvflow.cli", "serve", tiny_llama, "--data-parallel-size", "2",
           "--port", str(port), "--api-key", "dp-key", "--served-model-name", "tiny",
           "--dtype", "float32", "--num-threads", "1", "--max-model-len", "128",
           "--log-level", "warning"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ))
    try:
        assert wait_until(lambda: _up(url) or proc.poll() is not None, 180), "not up"
        assert proc.poll() is None, proc.stdout.read()
        c = _client(url, "dp-key")
        r = c.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=3,
                                      extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 3
        assert all(_up(u) for u in replicas)
        assert httpx.get(replicas[0] + "/v1/models").status_code == 401   # the key is theirs too
    finally:
        out = stop(proc, signal.SIGTERM, 60)
    assert proc.returncode in (0, 128 + signal.SIGTERM), out
    assert not any(_up(u) for u in replicas)
