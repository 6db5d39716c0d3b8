"""Load test on loopback: 200 concurrent streaming requests, 20% of the clients hang up after
their first chunk. Every other request completes, none hangs, the engine ends idle with every KV
block free, and /metrics agrees with what the clients saw."""
import asyncio
import json

import httpx
import pytest

from server_helpers import SLOW_CORE_STEPS, metric, metrics, running_server, wait_idle

N, DISCONNECT_EVERY = 200, 5        # clients 0, 5, 10, ... hang up: 40 of 200
MAX_TOKENS, LONG_MAX_TOKENS = 24, 200
HANG_GUARD_S = 240                  # a bound against hangs, not a timing assertion


@pytest.fixture(scope="module", params=[False, True], ids=["core-thread", "core-process"])
def server(tiny_llama, request):
    # In its own process the tiny model's core could finish a hung-up client's 200 tokens
    # before the abort arrives; slower steps keep "the client left first" true.
    patch = SLOW_CORE_STEPS if request.param else None
    with running_server(tiny_llama, max_num_seqs=256, multiprocess=request.param,
                        core_patch=patch) as s:
        yield s


def prompt(i: int) -> str:
    return f"Number {i} plus {i + 1} is"


async def one_client(http: httpx.AsyncClient, url: str, i: int) -> dict:
    hang_up = i % DISCONNECT_EVERY == 0
    body = {"model": "tiny", "prompt": prompt(i), "temperature": 0, "ignore_eos": True,
            "max_tokens": LONG_MAX_TOKENS if hang_up else MAX_TOKENS, "stream": True,
            "stream_options": {"include_usage": True}}
    res = {"i": i, "hang_up": hang_up, "text": "", "chunks": 0, "usage": None, "done": False,
           "finish": None}
    async with http.stream("POST", url + "/v1/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                res["done"] = True
                break
            data = json.loads(line[6:])
            if data["choices"]:
                c = data["choices"][0]
                res["text"] += c["text"]
                res["chunks"] += 1
                res["finish"] = c["finish_reason"] or res["finish"]
                if hang_up:
                    return res          # leaving the block closes the connection mid-stream
            else:
                res["usage"] = data["usage"]
    return res


async def run_clients(url: str) -> list[dict]:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(HANG_GUARD_S), limits=limits) as http:
        tasks = [one_client(http, url, i) for i in range(N)]
        return await asyncio.wait_for(asyncio.gather(*tasks), HANG_GUARD_S)


def test_200_streams_with_disconnects(server):
    results = asyncio.run(run_clients(server.url))
    stayed = [r for r in results if not r["hang_up"]]
    left = [r for r in results if r["hang_up"]]
    assert len(stayed) == 160 and len(left) == 40

    # every client that stayed got the whole answer
    for r in stayed:
        assert r["done"] and r["finish"] == "length", r
        assert r["usage"]["completion_tokens"] == MAX_TOKENS
    for r in left:
        assert r["chunks"] == 1 and not r["done"]

    # the engine is idle and every block is free (hung-up requests asked for 200 tokens each)
    st = wait_idle(server.llm)
    assert st["running"] == 0 and st["waiting"] == 0 and st["unfinished"] == 0
    assert st["states"] == 0
    assert st["free_blocks"] == st["num_blocks"]

    # /metrics agrees with the clients
    m = metrics(server.url)
    tok = server.llm.tokenizer
    ok = "vllm:request_success_total"
    assert metric(m, ok, finished_reason="length") == 160
    assert metric(m, ok, finished_reason="abort") == 40
    assert metric(m, ok, finished_reason="stop") == 0
    assert metric(m, "vllm:num_requests_running") == 0
    assert metric(m, "vllm:num_requests_waiting") == 0
    assert metric(m, "vllm:kv_cache_usage_perc") == 0
    assert metric(m, "vllm:prompt_tokens_total") == sum(
        len(tok.encode(prompt(i))) for i in range(N))
    assert sum(r["usage"]["prompt_tokens"] for r in stayed) == sum(
        len(tok.encode(prompt(r["i"]))) for r in stayed)
    received = sum(r["usage"]["completion_tokens"] for r in stayed)
    gen = metric(m, "vllm:generation_tokens_total")
    assert received + len(left) <= gen < received + len(left) * LONG_MAX_TOKENS
    assert metric(m, "vllm:time_to_first_token_seconds_count") == N       # all got a token
    assert metric(m, "vllm:e2e_request_latency_seconds_count") == 160     # aborts left out
    assert metric(m, "vllm:request_queue_time_seconds_count") == 160
    assert metric(m, "vllm:request_generation_tokens_sum") == received
    # one inter-token gap per token after the first, when each step yields one token
    assert metric(m, "vllm:inter_token_latency_seconds_count") >= 160 * (MAX_TOKENS - 1)
    assert metric(m, "vllm:e2e_request_latency_seconds_sum") > 0


def test_greedy_streams_under_load_match_a_lone_request(server):
    """Batching does not change greedy output: a few prompts again, alone, non-streamed."""
    for i in (1, 2, 77):
        body = {"model": "tiny", "prompt": prompt(i), "temperature": 0, "ignore_eos": True,
                "max_tokens": MAX_TOKENS}
        alone = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()
        body["stream"] = True
        streamed = asyncio.run(_stream_text(server.url, body))
        assert streamed == alone["choices"][0]["text"]


async def _stream_text(url: str, body: dict) -> str:
    async with httpx.AsyncClient(timeout=60) as http:
        async with http.stream("POST", url + "/v1/completions", json=body) as r:
            text = ""
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    text += json.loads(line[6:])["choices"][0]["text"]
            return text
