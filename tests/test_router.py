"""The router (kvflow/server/router.py) in front of fake backends (router_helpers.py): where
requests go, what passes through, and what clients get when a replica fails."""
from __future__ import annotations

import json
import socket
import threading

import httpx
import pytest

from router_helpers import fake_backends, post, running_router, sse_texts, wait_until

SYSTEM_A = "You are a terse assistant for the shipping desk. " * 10
SYSTEM_B = "Tu es un assistant qui répond en vers alexandrins. " * 10
CHAT = "/v1/chat/completions"


def _chat(system: str, user: str, **extra) -> dict:
    return {"model": "fake", "messages": [{"role": "system", "content": system},
                                          {"role": "user", "content": user}], **extra}


def test_prefix_policy_keeps_a_shared_prefix_on_one_replica_and_spreads_different_ones():
    with fake_backends() as bs, running_router([b.url for b in bs], "prefix") as rt:
        for i in range(6):
            for system in (SYSTEM_A, SYSTEM_B):
                r = post(rt.url, CHAT, _chat(system, f"question {i}"))
                assert r.status_code == 200, r.text
        a = {b.name for b in bs for g in b.got if g["body"]["messages"][0]["content"] == SYSTEM_A}
        b_ = {b.name for b in bs for g in b.got if g["body"]["messages"][0]["content"] == SYSTEM_B}
        assert len(a) == 1 and len(b_) == 1 and a != b_


def test_round_robin_alternates_whatever_the_prefix():
    with fake_backends() as bs, running_router([b.url for b in bs], "round_robin") as rt:
        names = [post(rt.url, CHAT, _chat(SYSTEM_A, f"q{i}")).json()["backend"] for i in range(4)]
        assert names == ["b0", "b1", "b0", "b1"]


def test_completions_route_by_prompt_and_pass_status_and_body_through():
    with fake_backends() as bs, running_router([b.url for b in bs], "prefix") as rt:
        long = "the same long document " * 20
        names = {post(rt.url, "/v1/completions", {"prompt": long + str(i)}).json()["backend"]
                 for i in range(4)}
        assert len(names) == 1
        r = post(rt.url, "/v1/completions", {"prompt": [1, 2, 3], "bad": True})
        assert r.status_code == 400 and r.json()["error"]["message"] == "bad"
        assert bs[0].got[-1]["body"]["prompt"] == [1, 2, 3] or bs[1].got[-1]["body"]["prompt"] \
            == [1, 2, 3]


def test_a_stream_passes_through_chunk_by_chunk():
    """The backend sends its second chunk only after the client has read the first."""
    with fake_backends(1) as (b,), running_router([b.url]) as rt:
        body = _chat(SYSTEM_A, "hi", stream=True, stream_gate=True)
        with httpx.stream("POST", rt.url + CHAT, json=body, timeout=60) as r:
            assert r.headers["content-type"].startswith("text/event-stream")
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            b.release.set()
            rest = sse_texts(lines)
        texts = [sse_texts([first])[0]["choices"][0]["text"]] + [
            e["choices"][0]["text"] for e in rest if e != "[DONE]"]
        assert texts == ["b0-0", "b0-1"] and rest[-1] == "[DONE]"


def _in_thread(fn):
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("r", fn()), daemon=True)
    t.start()
    return t, out


def test_a_replica_failing_health_checks_is_taken_out_its_requests_end_and_it_comes_back():
    with fake_backends() as bs, running_router([b.url for b in bs], "round_robin") as rt:
        t, out = _in_thread(lambda: post(rt.url, CHAT, _chat(SYSTEM_A, "held", hold=True)))
        assert bs[0].holding.wait(30)
        bs[0].healthy = False
        t.join(60)
        r = out["r"]
        assert r.status_code == 502 and r.json()["error"]["type"] == "server_error"
        names = [post(rt.url, CHAT, _chat(SYSTEM_A, f"q{i}")).json()["backend"] for i in range(3)]
        assert names == ["b1"] * 3
        bs[0].healthy = True
        assert wait_until(lambda: 'replica_healthy{replica="%s"} 1.0' % bs[0].url
                          in httpx.get(rt.url + "/metrics").text)


def test_a_started_stream_of_a_replica_taken_out_ends_with_an_error_event():
    with fake_backends(2) as bs, running_router([b.url for b in bs], "round_robin") as rt:
        body = _chat(SYSTEM_A, "hi", stream=True, stream_gate=True)
        with httpx.stream("POST", rt.url + CHAT, json=body, timeout=60) as r:
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            bs[0].healthy = False
            rest = sse_texts(lines)
        assert "error" in rest[0] and rest[0]["error"]["code"] == 502 and rest[-1] == "[DONE]"


def test_a_replica_that_refuses_connections_gets_a_502_and_is_taken_out():
    with fake_backends() as bs, running_router([b.url for b in bs], "round_robin",
                                               health_check_interval=3600) as rt:
        assert [post(rt.url, CHAT, _chat(SYSTEM_A, f"q{i}")).status_code
                for i in range(2)] == [200, 200]
        bs[0].srv.stop()                    # gone between two health checks
        r = post(rt.url, CHAT, _chat(SYSTEM_A, "x"))
        assert r.status_code == 502 and "replica" in r.json()["error"]["message"]
        names = [post(rt.url, CHAT, _chat(SYSTEM_A, f"y{i}")).json()["backend"] for i in range(2)]
        assert names == ["b1", "b1"]


def test_no_healthy_replica_is_a_503_with_an_openai_error_and_health_says_so():
    with fake_backends() as bs, running_router([b.url for b in bs]) as rt:
        for b in bs:
            b.healthy = False
        assert wait_until(lambda: httpx.get(rt.url + "/health").status_code == 503)
        r = post(rt.url, CHAT, _chat(SYSTEM_A, "x"))
        assert r.status_code == 503
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}


@pytest.mark.parametrize("content,ctype,status,needle", [
    (b"{not json", "application/json", 400, "malformed JSON"),
    (b"", "application/json", 400, "malformed JSON"),
    (b"[1, 2]", "application/json", 400, "JSON object"),
    (b'{"model": "x"}', "application/json", 400, "messages"),
    (b'{"messages": ["hi"]}', "application/json", 400, "messages.0"),
    (b'{"messages": []}', "text/plain", 415, "Content-Type"),
])
def test_bad_bodies_get_a_4xx_naming_the_problem_before_any_routing(content, ctype, status,
                                                                    needle):
    with fake_backends(1) as (b,), running_router([b.url]) as rt:
        r = httpx.post(rt.url + CHAT, content=content, headers={"content-type": ctype})
        assert r.status_code == status and needle in r.json()["error"]["message"]
        assert b.got == []


def test_completions_without_a_prompt_is_a_400_naming_it():
    with fake_backends(1) as (b,), running_router([b.url]) as rt:
        r = post(rt.url, "/v1/completions", {"model": "x"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt" and b.got == []


def test_every_route_but_health_needs_the_key_and_backends_get_theirs():
    with fake_backends(1) as (b,), running_router([b.url], api_key="front",
                                                  backend_api_key="back") as rt:
        assert httpx.get(rt.url + "/health").status_code == 200
        for method, path in (("GET", "/metrics"), ("GET", "/v1/models"), ("POST", CHAT),
                             ("POST", "/v1/completions")):
            r = httpx.request(method, rt.url + path, json=_chat(SYSTEM_A, "x"))
            assert r.status_code == 401, path
        auth = {"Authorization": "Bearer front"}
        assert post(rt.url, CHAT, _chat(SYSTEM_A, "x"), headers=auth).status_code == 200
        assert b.got[-1]["auth"] == "Bearer back"
        assert httpx.get(rt.url + "/v1/models", headers=auth).json()["data"][0]["id"] == "fake"


def test_a_body_over_the_limit_is_a_413():
    with fake_backends(1) as (b,), running_router([b.url], max_body_bytes=1000) as rt:
        r = post(rt.url, CHAT, _chat("x" * 2000, "y"))
        assert r.status_code == 413 and b.got == []


def test_metrics_count_routed_requests_per_replica_and_policy():
    with fake_backends() as bs, running_router([b.url for b in bs], "round_robin") as rt:
        for i in range(3):
            post(rt.url, CHAT, _chat(SYSTEM_A, str(i)))
        text = httpx.get(rt.url + "/metrics").text
        assert f'kvflow_router_requests_total{{policy="round_robin",replica="{bs[0].url}"}} 2.0' \
            in text
        assert f'kvflow_router_requests_in_flight{{replica="{bs[1].url}"}} 0.0' in text


def _in_flight(backend) -> str:
    return f'kvflow_router_requests_in_flight{{replica="{backend.url}"}}'


def _metric_text(rt) -> str:
    return httpx.get(rt.url + "/metrics").text


def test_a_client_that_goes_away_mid_request_frees_its_replica_slot():
    with fake_backends(1) as (b,), running_router([b.url], "least_load") as rt:
        raw = json.dumps(_chat(SYSTEM_A, "x", hold=True)).encode()
        with socket.create_connection((rt.host, rt.port)) as s:
            s.sendall(b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: %d\r\n\r\n%s" % (CHAT.encode(), len(raw), raw))
            assert b.holding.wait(30)
            assert f"{_in_flight(b)} 1.0" in _metric_text(rt)
        assert wait_until(lambda: f"{_in_flight(b)} 0.0" in _metric_text(rt))


def test_a_client_that_goes_away_mid_stream_frees_its_replica_slot():
    with fake_backends(1) as (b,), running_router([b.url], "least_load") as rt:
        body = _chat(SYSTEM_A, "x", stream=True, stream_gate=True)
        with httpx.stream("POST", rt.url + CHAT, json=body, timeout=60):
            assert b.holding.wait(30)
            assert f"{_in_flight(b)} 1.0" in _metric_text(rt)
        assert wait_until(lambda: f"{_in_flight(b)} 0.0" in _metric_text(rt))


@pytest.mark.parametrize("argv,needle", [
    (["router", "--backends", "localhost:8001"], "not an http(s) URL: 'localhost:8001'"),
    (["router", "--backends", " , "], "at least one URL"),
    (["router", "--backends", "http://a:1,http://a:1/"], "given twice"),
    (["serve", "--data-parallel-size", "0"], "--data-parallel-size must be >= 1"),
    (["serve", "--data-parallel-size", "2", "--port", "65535"], "--port must leave room"),
])
def test_bad_router_command_lines_are_clean_errors(argv, needle, capsys):
    from kvflow.cli import main
    assert main(argv) == 2
    assert needle in capsys.readouterr().err
