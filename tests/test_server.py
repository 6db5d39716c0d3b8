"""The official `openai` client against `kvflow serve`'s app on 127.0.0.1 with a tiny model:
completions, chat, streaming, stop strings, usage, the API key, and client disconnects."""
import asyncio
import json
import re

import httpx
import openai
import pytest

from kvflow import LLM, SamplingParams
from server_helpers import metric, metrics, running_server, slow_steps, wait_idle

KEY = "sk-test-key"
PROMPT = "The cat sees the red house"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server(tiny_llama):
    with running_server(tiny_llama, api_key=KEY) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(api_key=KEY, base_url=server.url + "/v1", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def offline(tiny_llama):
    return LLM(tiny_llama, dtype="float32", num_threads=1, max_model_len=256)


def greedy(max_tokens, **kw):
    return SamplingParams(temperature=0, max_tokens=max_tokens, **kw)


def test_models_health_version(server, client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    r = httpx.get(server.url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"})
    assert r.json()["data"][0]["max_model_len"] == 256
    assert httpx.get(server.url + "/health").status_code == 200      # no key needed
    assert httpx.get(server.url + "/version", headers=AUTH).json()["version"]


def test_completion_equals_offline_greedy(client, offline, server):
    exp = offline.generate(PROMPT, greedy(12), use_tqdm=False)[0]
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0)
    c = r.choices[0]
    assert c.text == exp.outputs[0].text
    assert c.finish_reason == exp.outputs[0].finish_reason
    assert r.id.startswith("cmpl-") and r.object == "text_completion" and r.created > 0
    assert r.model == "tiny"
    tok = server.llm.tokenizer
    assert r.usage.prompt_tokens == len(tok.encode(PROMPT))
    assert r.usage.completion_tokens == len(exp.outputs[0].token_ids)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_chat_equals_offline_greedy(client, offline):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello!"}]
    exp = offline.chat(msgs, greedy(10), use_tqdm=False)[0]
    r = client.chat.completions.create(model="tiny", messages=msgs, max_completion_tokens=10,
                                       temperature=0)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == exp.outputs[0].text
    assert r.choices[0].finish_reason == exp.outputs[0].finish_reason
    assert r.usage.prompt_tokens == len(exp.prompt_token_ids)
    assert r.usage.completion_tokens == len(exp.outputs[0].token_ids)
    # max_tokens (the older field) means the same
    r2 = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=10, temperature=0)
    assert r2.choices[0].message.content == r.choices[0].message.content


def test_streamed_completion_text_equals_non_streamed(client):
    kw = dict(model="tiny", prompt=PROMPT, max_tokens=60, temperature=0,
              extra_body={"ignore_eos": True})
    full = client.completions.create(**kw)
    chunks = list(client.completions.create(**kw, stream=True,
                                            stream_options={"include_usage": True}))
    text_chunks = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in text_chunks) == full.choices[0].text
    assert text_chunks[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    assert all(c.usage is None for c in text_chunks)
    assert not chunks[-1].choices and chunks[-1].usage == full.usage     # the usage chunk
    assert full.usage.completion_tokens == 60
    assert len({c.id for c in chunks}) == 1


def test_streamed_chat_equals_non_streamed(client):
    kw = dict(model="tiny", messages=[{"role": "user", "content": "Tell me a story."}],
              max_tokens=40, temperature=0, extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[0].object == "chat.completion.chunk"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason == "length"
    assert all(c.usage is None for c in chunks)         # no include_usage: no usage chunk


def test_sse_wire_format_ends_with_done(server):
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 5, "stream": True,
            "stream_options": {"include_usage": True}}
    r = httpx.post(server.url + "/v1/completions", json=body,
                   headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = [e for e in r.text.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2][6:])["usage"]["completion_tokens"] == 5


def _stop_string(text: str) -> str:
    """3 printable ASCII characters starting after the first few characters of text."""
    for i in range(4, len(text) - 3):
        s = text[i:i + 3]
        if s.isascii() and s.isprintable() and s.strip() == s:
            return s
    pytest.skip("the greedy text has no usable stop string")


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string(client, stream):
    kw = dict(model="tiny", prompt=PROMPT, temperature=0, extra_body={"ignore_eos": True})
    text = client.completions.create(**kw, max_tokens=60).choices[0].text
    stop = _stop_string(text)
    expected = text[:text.index(stop)]
    if stream:
        chunks = list(client.completions.create(**kw, max_tokens=60, stop=[stop, "\x00zz"],
                                                stream=True))
        got = "".join(c.choices[0].text for c in chunks)
        finish = chunks[-1].choices[0].finish_reason
    else:
        r = client.completions.create(**kw, max_tokens=60, stop=stop)
        got, finish = r.choices[0].text, r.choices[0].finish_reason
        assert r.choices[0].model_extra["stop_reason"] == stop
        assert r.usage.completion_tokens < 60
    assert got == expected
    assert finish == "stop"


def test_batch_of_prompts_and_token_ids(client, server):
    ids = server.llm.tokenizer.encode("A dog likes")
    single = [client.completions.create(model="tiny", prompt=p, max_tokens=6, temperature=0)
              for p in (PROMPT, "A dog likes")]
    r = client.completions.create(model="tiny", prompt=[PROMPT, "A dog likes"], max_tokens=6,
                                  temperature=0)
    assert [c.index for c in r.choices] == [0, 1]
    assert [c.text for c in r.choices] == [s.choices[0].text for s in single]
    assert r.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in single)
    r_ids = client.completions.create(model="tiny", prompt=ids, max_tokens=6, temperature=0)
    assert r_ids.choices[0].text == single[1].choices[0].text
    both_ids = [server.llm.tokenizer.encode(PROMPT), ids]
    streamed = list(client.completions.create(model="tiny", prompt=both_ids, max_tokens=6,
                                              temperature=0, stream=True))
    for i in (0, 1):
        assert "".join(c.choices[0].text for c in streamed if c.choices[0].index == i) == \
            single[i].choices[0].text


def test_sampling_fields(client):
    kw = dict(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0.9, top_p=0.9, seed=7,
              extra_body={"top_k": 20, "min_tokens": 8, "ignore_eos": True, "priority": 1})
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    assert a.choices[0].text == b.choices[0].text          # seeded: repeatable
    assert a.usage.completion_tokens == 8


ROUTES = [("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
          ("POST", "/tokenize"), ("POST", "/detokenize"), ("GET", "/metrics"),
          ("GET", "/openapi.json"), ("GET", "/docs"), ("GET", "/redoc"), ("GET", "/version"),
          ("GET", "/no-such-route")]
def test_api_key_required_on_every_route_but_health(server):
    bad = openai.OpenAI(api_key="wrong", base_url=server.url + "/v1", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as ei:
        bad.completions.create(model="tiny", prompt="hi", max_tokens=2)
    assert ei.value.status_code == 401
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        for method, path in ROUTES:
            r = httpx.request(method, server.url + path, headers=headers, json={})
            assert r.status_code == 401, (headers, path)
            assert r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(server.url + "/health").status_code == 200
    for method, path in ROUTES[5:9]:
        assert httpx.request(method, server.url + path, headers=AUTH).status_code == 200, path


def test_metrics_no_auth_leaves_only_metrics_open(tiny_llama):
    with running_server(tiny_llama, api_key=KEY, app_kw={"public_metrics": True},
                        max_model_len=64) as s:
        assert "vllm:num_requests_running" in httpx.get(s.url + "/metrics").text
        assert httpx.get(s.url + "/health").status_code == 200
        for method, path in ROUTES:
            if path != "/metrics":
                assert httpx.request(method, s.url + path, json={}).status_code == 401, path


def test_openapi_declares_bodies_and_response_types(server):
    doc = httpx.get(server.url + "/openapi.json", headers=AUTH).json()
    schemas, paths = doc["components"]["schemas"], doc["paths"]

    def body_schema(path):
        ref = paths[path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        return schemas[ref.rsplit("/", 1)[1]]
    assert {"prompt", "max_tokens", "stream"} <= set(body_schema("/v1/completions")["properties"])
    assert "prompt" in body_schema("/v1/completions")["required"]
    chat = body_schema("/v1/chat/completions")
    assert "messages" in chat["required"] and "ChatMessage" in schemas
    assert "prompt" in body_schema("/tokenize")["properties"]
    assert "tokens" in body_schema("/detokenize")["required"]
    for path in ("/v1/completions", "/v1/chat/completions"):
        ok = paths[path]["post"]["responses"]["200"]["content"]
        assert {"application/json", "text/event-stream"} <= set(ok)
        bad = paths[path]["post"]["responses"]["400"]["content"]["application/json"]["schema"]
        assert bad["$ref"].endswith("/ErrorResponse")
    assert set(paths["/metrics"]["get"]["responses"]["200"]["content"]) == {"text/plain"}
    refs = re.findall(r'"\$ref": "#/components/schemas/([^"]+)"', json.dumps(doc))
    assert refs and set(refs) <= set(schemas)        # every reference resolves


def test_tokenize_detokenize(server):
    tok = server.llm.tokenizer
    r = httpx.post(server.url + "/tokenize", json={"prompt": PROMPT}, headers=AUTH).json()
    assert r["tokens"] == tok.encode(PROMPT) and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == 256
    back = httpx.post(server.url + "/detokenize", json={"tokens": r["tokens"]},
                      headers=AUTH).json()
    assert back["prompt"] == PROMPT
    msgs = [{"role": "user", "content": "hi"}]
    r = httpx.post(server.url + "/tokenize", json={"messages": msgs}, headers=AUTH).json()
    assert r["tokens"] == tok.encode_chat(msgs)


def _unpatch(llm):
    asyncio.run(llm.call_in_engine(lambda e: e.__dict__.pop("step", None)))


@pytest.mark.parametrize("stream", [False, True])
def test_client_disconnect_aborts_the_request(server, stream):
    """A client that goes away, streamed or not, gets its request aborted: its blocks are freed
    and it counts as finished_reason="abort", not as completed."""
    llm = server.llm
    before = metrics(server.url, server.api_key)
    slow_steps(llm, 0.02)      # 200 tokens would now take >= 4 s
    try:
        body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 200, "ignore_eos": True,
                "stream": stream}
        headers = {"Authorization": f"Bearer {KEY}"}
        if stream:
            with httpx.stream("POST", server.url + "/v1/completions", json=body,
                              headers=headers, timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        break           # one chunk, then hang up
        else:
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(server.url + "/v1/completions", json=body, headers=headers,
                           timeout=httpx.Timeout(60, read=0.3))
        st = wait_idle(llm)
    finally:
        _unpatch(llm)
    assert st["unfinished"] == 0 and st["states"] == 0
    assert st["free_blocks"] == st["num_blocks"]
    after = metrics(server.url, server.api_key)
    name = "vllm:request_success_total"
    assert metric(after, name, finished_reason="abort") == \
        metric(before, name, finished_reason="abort") + 1
    assert metric(after, name, finished_reason="length") == \
        metric(before, name, finished_reason="length")


def test_a_batch_completion_reaches_the_scheduler_as_a_batch(server, client):
    """All prompts of one request are added before the engine's next step (not one per step)."""
    wait_idle(server.llm)
    engine, steps = server.llm.client.core, []
    inner = engine.step

    def counting_step():
        out = inner()
        steps.append(sum(len(o.new_token_ids) for o in out.outputs))
        return out

    engine.step = counting_step
    try:
        prompts = [[5 + i, 9, 13] for i in range(40)]
        r = client.completions.create(model="tiny", prompt=prompts, max_tokens=1,
                                      temperature=0)
    finally:
        engine.step = inner
    assert len(r.choices) == 40
    assert steps[0] == 40 and len(steps) == 1       # one step runs every prompt
    assert wait_idle(server.llm)["free_blocks"] == wait_idle(server.llm)["num_blocks"]
