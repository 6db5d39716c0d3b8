"""Hostile requests against a live server: no body, header or connection pattern gets a 5xx or
takes the server down. Lone surrogates, 5,000-digit and out-of-range numbers, JSON nested 100,000
deep, wrong content types, wrong JSON types in every field, trickling and vanishing clients, a
900 KB prompt. Afterwards the engine still serves and ends idle with every KV block free."""
import asyncio
import json
import logging
import socket
import threading

import httpx
import pytest

from kvflow.server.protocol import ChatCompletionRequest, CompletionRequest
from server_helpers import running_server, slow_steps, wait_idle

OK = {"model": "tiny", "prompt": "The cat", "max_tokens": 2}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
POST_ROUTES = ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize")
HEADER_TIMEOUT, BODY_TIMEOUT = 1.0, 1.5
GUARD_S = 60        # bounds against hangs, not timing assertions


@pytest.fixture(scope="module")
def server(tiny_llama):
    kw = {"header_timeout": HEADER_TIMEOUT, "body_timeout": BODY_TIMEOUT}
    with running_server(tiny_llama, server_kw=kw) as s:
        yield s


def _post(url: str, raw: bytes, content_type: str | None = "application/json"):
    headers = {"Content-Type": content_type} if content_type else {}
    return httpx.post(url, content=raw, headers=headers, timeout=GUARD_S)


def _check_4xx(r, status=None, param=None):
    assert r.status_code < 500, r.text
    assert r.status_code == status if status else 400 <= r.status_code < 500, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    if param is not None:
        assert err["param"] == param, err
    return err


# ---- Part 3: bodies ---------------------------------------------------------------------------
def _raw(obj_text: str) -> bytes:
    return obj_text.encode()


BIG = "9" * 5000        # over Python's 4,300-digit int-from-str limit
SURROGATES = [
    ("prompt high", "/v1/completions", r'{"prompt": "a\ud800b", "max_tokens": 2}', "prompt"),
    ("prompt low", "/v1/completions", r'{"prompt": "\udfff"}', "prompt"),
    ("prompt unpaired high", "/v1/completions", r'{"prompt": "\ud83dx"}', "prompt"),
    ("prompt in a list", "/v1/completions", r'{"prompt": ["ok", "\ud800"]}', "prompt"),
    ("role", "/v1/chat/completions", r'{"messages": [{"role": "\ud800", "content": "hi"}]}',
     "messages"),
    ("content", "/v1/chat/completions", r'{"messages": [{"role": "user", "content": "\ud800"}]}',
     "messages"),
    ("content part", "/v1/chat/completions",
     r'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]}',
     "messages"),
    ("tokenize prompt", "/tokenize", r'{"prompt": "\ud800"}', "prompt"),
    ("tokenize messages", "/tokenize", r'{"messages": [{"role": "user", "content": "\udc00"}]}',
     "messages"),
    ("model", "/v1/completions", r'{"model": "\ud800", "prompt": "x"}', "model"),
    ("model chat", "/v1/chat/completions",
     r'{"model": "\ud800", "messages": [{"role": "user", "content": "hi"}]}', "model"),
    ("model tokenize", "/tokenize", r'{"model": "\ud800", "prompt": "x"}', "model"),
    ("model detokenize", "/detokenize", r'{"model": "\ud800", "tokens": [1]}', "model"),
    ("stop", "/v1/completions", r'{"prompt": "x", "stop": ["\ud800"]}', "stop"),
    ("user", "/v1/completions", r'{"prompt": "x", "user": "\ud800"}', "user"),
    ("an ignored key", "/v1/completions", r'{"prompt": "x", "\ud800": 1}', None),
]


@pytest.mark.parametrize("path,raw,param", [c[1:] for c in SURROGATES],
                         ids=[c[0] for c in SURROGATES])
def test_lone_surrogate_is_a_400(server, path, raw, param):
    err = _check_4xx(_post(server.url + path, _raw(raw)), 400, param)
    assert "surrogate" in err["message"]


def test_surrogate_pair_is_fine(server):
    r = _post(server.url + "/v1/completions", _raw(r'{"prompt": "\ud83d\ude00 cat", '
                                                   r'"max_tokens": 2}'))
    assert r.status_code == 200, r.text


HUGE_INTS = [(path, field, f'{{"prompt": "x", "{field}": {BIG}}}')
             for path in ("/v1/completions",)
             for field in ("max_tokens", "temperature", "top_p", "top_k", "seed", "n",
                           "priority", "min_tokens", "presence_penalty")] + [
    ("/v1/completions", "prompt", f'{{"prompt": [1, {BIG}]}}'),
    ("/v1/completions", "stop_token_ids", f'{{"prompt": "x", "stop_token_ids": [{BIG}]}}'),
    ("/v1/chat/completions", "max_completion_tokens",
     f'{{"messages": [{{"role": "user", "content": "hi"}}], "max_completion_tokens": {BIG}}}'),
    ("/detokenize", "tokens", f'{{"tokens": [{BIG}]}}'),
    ("/tokenize", "prompt", f'{{"prompt": {BIG}}}'),
]


@pytest.mark.parametrize("path,field,raw", HUGE_INTS, ids=[c[1] for c in HUGE_INTS])
def test_5000_digit_integer_is_a_400(server, path, field, raw):
    _check_4xx(_post(server.url + path, _raw(raw)), 400)


OUT_OF_RANGE = [
    ("/v1/completions", {**OK, "max_tokens": 10**30}, "max_tokens"),
    ("/v1/completions", {**OK, "top_k": 2**63}, "top_k"),
    ("/v1/completions", {**OK, "priority": 2**63}, "priority"),
    ("/v1/completions", {**OK, "priority": -2**63 - 1}, "priority"),
    ("/v1/completions", {**OK, "min_tokens": 2**70}, "min_tokens"),
    ("/v1/completions", {**OK, "n": 2**64}, "n"),
    ("/v1/completions", {**OK, "prompt": [2**64]}, "prompt"),
    ("/v1/completions", {**OK, "stop_token_ids": [2**64]}, "stop_token_ids"),
    ("/v1/completions", {**OK, "top_p": float("-inf")}, "top_p"),
    ("/v1/completions", {**OK, "presence_penalty": float("inf")}, "presence_penalty"),
    ("/v1/chat/completions", {**CHAT, "max_completion_tokens": -2**63 - 1},
     "max_completion_tokens"),
    ("/v1/chat/completions", {**CHAT, "top_logprobs": 2**64}, "top_logprobs"),
    ("/detokenize", {"tokens": [2**64]}, "tokens"),
]


@pytest.mark.parametrize("path,body,param", OUT_OF_RANGE, ids=[c[2] for c in OUT_OF_RANGE])
def test_out_of_range_number_is_a_400(server, path, body, param):
    _check_4xx(_post(server.url + path, json.dumps(body).encode()), 400, param)


def test_float_overflowing_to_infinity_is_a_400(server):
    raw = b'{"prompt": "x", "temperature": 1e400}'
    _check_4xx(_post(server.url + "/v1/completions", raw), 400, "temperature")


def test_seed_out_of_range_is_a_400(server):
    for seed in (2**64, -2**64):
        _check_4xx(_post(server.url + "/v1/completions",
                         json.dumps({**OK, "seed": seed}).encode()), 400, "seed")


def test_temperature_infinity_literal_is_a_400(server):
    for lit in (b"Infinity", b"-Infinity", b"NaN"):
        raw = b'{"prompt": "x", "max_tokens": 2, "temperature": ' + lit + b"}"
        _check_4xx(_post(server.url + "/v1/completions", raw), 400, "temperature")


N_DEEP = 100_000
DEEP_BODIES = {
    "array": b"[" * N_DEEP + b"]" * N_DEEP,
    "object": b'{"a":' * N_DEEP + b"1" + b"}" * N_DEEP,
    "in prompt": b'{"prompt": ' + b"[" * N_DEEP + b"]" * N_DEEP + b"}",
    "in messages": b'{"messages": [{"role": "user", "content": ' + b"[" * N_DEEP
                   + b"]" * N_DEEP + b"}]}",
}


@pytest.mark.parametrize("path", POST_ROUTES)
@pytest.mark.parametrize("kind", list(DEEP_BODIES))
def test_json_nested_100000_deep_is_a_400(server, path, kind):
    err = _check_4xx(_post(server.url + path, DEEP_BODIES[kind]), 400)
    assert "deep" in err["message"]


DEEP = "[" * 900 + "]" * 900
NEAR_LIMIT = {
    "prompt": ("/v1/completions", f'{{"prompt": {DEEP}}}'),
    "logprobs": ("/v1/completions", f'{{"prompt": "x", "logprobs": {DEEP}}}'),
    "tools": ("/v1/chat/completions",
              f'{{"messages": [{{"role": "user", "content": "hi"}}], "tools": {DEEP}}}'),
    "content": ("/v1/chat/completions", f'{{"messages": [{{"role": "user", "content": {DEEP}}}]}}'),
}


@pytest.mark.parametrize("field", list(NEAR_LIMIT))
def test_json_nested_just_under_the_parser_limit_is_a_400(server, field):
    """Deep enough to parse, too deep for a careless repr() in the error message."""
    path, raw = NEAR_LIMIT[field]
    _check_4xx(_post(server.url + path, raw.encode()), 400)


# ---- content type, methods --------------------------------------------------------------------
@pytest.mark.parametrize("path", POST_ROUTES)
@pytest.mark.parametrize("content_type", ["application/x-www-form-urlencoded", "text/plain",
                                          "multipart/form-data; boundary=x", None])
def test_post_that_is_not_json_is_a_415(server, path, content_type):
    """What a web page can send to a keyless local server without a CORS preflight."""
    raw = b"prompt=hi&max_tokens=2" if content_type and "form" in content_type \
        else json.dumps(OK).encode()
    err = _check_4xx(_post(server.url + path, raw, content_type), 415)
    assert "application/json" in err["message"]


def test_json_content_type_with_charset_is_accepted(server):
    r = _post(server.url + "/v1/completions", json.dumps(OK).encode(),
              "Application/JSON; charset=utf-8")
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("method,path,allowed", [("GET", "/v1/completions", "POST"),
                                                 ("PUT", "/tokenize", "POST"),
                                                 ("POST", "/v1/models", "GET"),
                                                 ("DELETE", "/health", "GET")])
def test_405_carries_an_allow_header(server, method, path, allowed):
    r = httpx.request(method, server.url + path, timeout=GUARD_S)
    _check_4xx(r, 405)
    assert allowed in [m.strip() for m in r.headers["allow"].split(",")]


# ---- wrong JSON types in every field -----------------------------------------------------------
WRONG = ["text", "", 7, -1, 0, 2.5, -3.5, 2**63, -2**63 - 1, 10**30, True, False, None, [],
         ["a", 1], [[1, 2]], [None], {}, {"k": "v"}, float("inf"), float("-inf"),
         float("nan"), 1e-300, 5e-324, 1e300, "Infinity", "\u00e9\u4e2d\U0001f600"]
FIELDS = [("/v1/completions", OK, f) for f in CompletionRequest.model_fields] + [
    ("/v1/chat/completions", CHAT, f) for f in ChatCompletionRequest.model_fields] + [
    ("/v1/chat/completions", CHAT, f) for f in ("messages.0.role", "messages.0.content",
                                                "messages.0", "stream_options.include_usage")]


def _with(base: dict, field: str, value) -> dict:
    body = json.loads(json.dumps(base))
    if field == "stream_options.include_usage":
        body.update(stream=True, stream_options={"include_usage": value})
    elif field.startswith("messages.0"):
        if field == "messages.0":
            body["messages"][0] = value
        else:
            body["messages"][0][field.rsplit(".", 1)[1]] = value
    else:
        body[field] = value
    return body


@pytest.mark.parametrize("path,base,field", FIELDS,
                         ids=[f"{'chat' if 'chat' in p else 'cmpl'}-{f}" for p, _, f in FIELDS])
def test_wrong_json_type_in_any_field_is_never_a_5xx(server, path, base, field):
    bad = []
    with httpx.Client(timeout=GUARD_S) as http:
        for value in WRONG:
            raw = json.dumps(_with(base, field, value)).encode()     # inf/nan as JSON literals
            r = http.post(server.url + path, content=raw,
                          headers={"Content-Type": "application/json"})
            if r.status_code >= 500 or (r.status_code >= 400 and "error" not in r.json()):
                bad.append((value, r.status_code, r.text[:300]))
    assert not bad


# ---- Part 4: slow, vanishing and heavy clients -------------------------------------------------
HEAD = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Content-Length: 100000\r\n\r\n")


async def _trickler(port: int, mode: str, head: bytes = b"") -> bytes:
    """Send `head`, then a byte every 0.2 s of the headers ('headers') or body ('body'), or
    nothing ('silent'), until the server closes the connection; returns what the server sent."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    got = b""
    try:
        writer.write(head)
        if mode == "body" and not head:
            writer.write(HEAD + b'{"prompt": "')
        elif mode == "headers":
            writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
        while True:
            if mode != "silent":
                writer.write(b"a")
                await writer.drain()
            try:
                data = await asyncio.wait_for(reader.read(4096), 0.2)
            except asyncio.TimeoutError:
                continue
            if not data:
                return got
            got += data
    except (ConnectionError, OSError):
        return got
    finally:
        writer.close()


async def _hostile_crowd_and_one_real_request(url: str, port: int, n: int):
    modes = ["headers", "body", "silent"]
    crowd = [asyncio.create_task(_trickler(port, modes[i % 3])) for i in range(n)]
    await asyncio.sleep(0.3)        # let the crowd connect first
    async with httpx.AsyncClient(timeout=GUARD_S) as http:
        real = await http.post(url + "/v1/completions", json=OK)
    closed = await asyncio.wait_for(asyncio.gather(*crowd), GUARD_S)
    return real, list(zip((modes[i % 3] for i in range(n)), closed))


def test_trickling_clients_are_disconnected_and_do_not_starve_others(server):
    port = int(server.url.rsplit(":", 1)[1])
    real, crowd = asyncio.run(_hostile_crowd_and_one_real_request(server.url, port, 240))
    assert real.status_code == 200 and real.json()["usage"]["completion_tokens"] >= 1
    assert len(crowd) == 240        # every trickler saw its connection closed by the server
    for mode, got in crowd:
        assert got.startswith(b"HTTP/1.1 408 "), (mode, got[:200])
        assert b'"code": 408' in got
    assert httpx.get(server.url + "/health", timeout=GUARD_S).status_code == 200


def test_body_trickled_after_an_early_answer_is_cut_off(server):
    """A 415 answered before the body arrived; trickling the body afterwards does not keep the
    connection open (uvicorn would: each byte resets its keep-alive timer)."""
    port = int(server.url.rsplit(":", 1)[1])
    head = HEAD.replace(b"application/json", b"text/plain")
    got = asyncio.run(asyncio.wait_for(_trickler(port, "body", head), GUARD_S))
    assert got.startswith(b"HTTP/1.1 415 ")


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)


def test_client_vanishing_mid_body_logs_one_line(server):
    log = logging.getLogger("uvicorn.error")
    handler, level = _Records(), log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        with socket.create_connection(("127.0.0.1", int(server.url.rsplit(":", 1)[1]))) as s:
            s.sendall(HEAD + b'{"prompt": "hal')
        logged = asyncio.run(_wait_for(lambda: handler.records, GUARD_S))
        assert httpx.post(server.url + "/v1/completions", json=OK, timeout=GUARD_S).is_success
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
    assert logged, "nothing was logged"
    assert not [r for r in handler.records if r.exc_info or r.levelno >= logging.ERROR]
    gone = [r.getMessage() for r in handler.records if "went away" in r.getMessage()]
    assert len(gone) == 1 and "\n" not in gone[0], gone


async def _wait_for(cond, timeout: float) -> bool:
    for _ in range(int(timeout / 0.05)):
        if cond():
            return True
        await asyncio.sleep(0.05)
    return False


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize"])
def test_tokenizing_a_900kb_prompt_does_not_stall_other_streams(server, path):
    """The tokenizer is made to wait (bounded) until another stream receives 3 more chunks: on
    the event loop it would block those chunks, so they never come."""
    tok, llm = server.llm.tokenizer, server.llm
    big = "The cat sees a dog. " * 45_000     # 900 KB
    chunks_after, released = [0], threading.Event()
    tokenizing = threading.Event()
    real_encode = tok.encode

    def encode(text, *a, **kw):
        if len(text) > 500_000:
            tokenizing.set()
            released.wait(GUARD_S / 3)
        return real_encode(text, *a, **kw)

    async def streamer(http):
        body = {**OK, "max_tokens": 200, "ignore_eos": True, "stream": True}
        async with http.stream("POST", server.url + "/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if tokenizing.is_set() and line.startswith("data: {"):
                    chunks_after[0] += 1
                    if chunks_after[0] >= 3:
                        released.set()
                        return          # hanging up aborts the rest

    async def heavy(http):
        await asyncio.sleep(0.2)
        if path == "/v1/completions":
            body = {**OK, "prompt": big}
        else:
            body = {"messages": [{"role": "user", "content": big}]}
            if path == "/tokenize":
                body = {"prompt": big}
        return await http.post(server.url + path, json=body)

    async def run():
        async with httpx.AsyncClient(timeout=GUARD_S) as http:
            return await asyncio.gather(streamer(http), heavy(http))

    tok.encode = encode
    slow_steps(llm, 0.02)
    try:
        _, r = asyncio.run(asyncio.wait_for(run(), GUARD_S))
    finally:
        del tok.encode
        asyncio.run(llm.call_in_engine(lambda e: e.__dict__.pop("step", None)))
    assert released.is_set(), "no chunk reached the other stream while tokenizing"
    assert r.status_code == (200 if path == "/tokenize" else 400), r.text[:300]


# ---- afterwards --------------------------------------------------------------------------------
def test_engine_serves_and_ends_idle_after_hostile_requests(server):
    assert httpx.get(server.url + "/health", timeout=GUARD_S).status_code == 200
    r = httpx.post(server.url + "/v1/completions", json={**OK, "max_tokens": 4}, timeout=GUARD_S)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    st = wait_idle(server.llm)
    assert st["unfinished"] == 0 and st["states"] == 0
    assert st["free_blocks"] == st["num_blocks"]
