"""Prefix-aware vs round-robin routing: 2 replicas behind `kvflow serve --data-parallel-size 2`,
a shared-prefix chat workload, one run per policy per round (the order alternates by round).

    .venv/bin/python benchmarks/router_prefix.py [--rounds 2] [--model PATH] [--users 32] ...

The workload: --systems long system prompts; --users conversations, each on one of them, of
--turns turns, each turn's prompt holding the earlier turns and their answers (so a replica that
saw a conversation's last turn holds most of its next one); --concurrency conversations at once.
Per policy it reports the replicas' prefix-cache hit rate (vllm:prefix_cache_hits /
vllm:prefix_cache_queries, from their /metrics before and after), TTFT P50/P99 (streamed, to the
first content chunk), and output tokens per second; and writes them as JSON to --out.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

WORDS = ("order parcel invoice route depot customs pallet carrier weight label refund address "
         "tracking delay courier freight manifest warehouse claim receipt").split()


def _free_port_run(n: int) -> int:
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            p = s.getsockname()[1]
        if p + n < 65535 and all(_free(p + i) for i in range(1, n + 1)):
            return p
    raise RuntimeError("no run of free ports")


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def make_conversations(a, rng: random.Random) -> list[dict]:
    systems = [f"System prompt {i}. You are the assistant of desk {i}. Rules: " +
               " ".join(rng.choice(WORDS) for _ in range(a.system_words)) for i in range(a.systems)]
    convs = [{"system": systems[u % a.systems],
              "users": [f"User {u}, turn {t}: " + " ".join(rng.choice(WORDS) for _ in range(
                  a.user_words)) for t in range(a.turns)]} for u in range(a.users)]
    rng.shuffle(convs)
    return convs


async def one_turn(client: httpx.AsyncClient, url: str, model: str, messages: list,
                   max_tokens: int) -> dict:
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    t0, ttft, text, toks = time.perf_counter(), None, [], 0
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{r.status_code}: {(await r.aread()).decode()[:300]}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            d = json.loads(line[6:])
            if "error" in d:
                raise RuntimeError(d["error"]["message"])
            if d.get("choices") and (c := d["choices"][0]["delta"].get("content")):
                ttft = ttft if ttft is not None else time.perf_counter() - t0
                text.append(c)
            if d.get("usage"):
                toks = d["usage"]["completion_tokens"]
    return {"ttft": ttft if ttft is not None else time.perf_counter() - t0,
            "text": "".join(text), "tokens": toks}


async def run_workload(url: str, model: str, convs: list[dict], a) -> dict:
    sem, results = asyncio.Semaphore(a.concurrency), []

    async def conversation(c: dict) -> None:
        async with sem:
            msgs = [{"role": "system", "content": c["system"]}]
            for u in c["users"]:
                msgs.append({"role": "user", "content": u})
                r = await one_turn(client, url, model, msgs, a.max_tokens)
                msgs.append({"role": "assistant", "content": r["text"]})
                results.append(r)

    async with httpx.AsyncClient(timeout=600) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(conversation(c) for c in convs))
        wall = time.perf_counter() - t0
    ttft = np.array([r["ttft"] for r in results]) * 1000
    return {"requests": len(results), "wall_s": round(wall, 2),
            "ttft_p50_ms": round(float(np.percentile(ttft, 50)), 1),
            "ttft_p99_ms": round(float(np.percentile(ttft, 99)), 1),
            "output_tok_s": round(sum(r["tokens"] for r in results) / wall, 1)}


def prefix_counts(urls: list[str]) -> tuple[float, float]:
    q = h = 0.0
    for u in urls:
        for fam in text_string_to_metric_families(httpx.get(u + "/metrics", timeout=10).text):
            for s in fam.samples:
                q += s.value if s.name == "vllm:prefix_cache_queries_total" else 0.0
                h += s.value if s.name == "vllm:prefix_cache_hits_total" else 0.0
    return q, h


def routed(url: str) -> dict:
    out = {}
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        for s in fam.samples:
            if s.name == "kvflow_router_requests_total":
                out[s.labels["replica"]] = int(s.value)
    return out


def start(a, policy: str, port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "kvflow.cli", "serve", *(["--model", a.model] if a.model else []),
           "--data-parallel-size", "2", "--router-policy", policy, "--port", str(port),
           "--num-threads", str(a.num_threads), "--log-level", "warning", "--metrics-no-auth",
           *(["--served-model-name", "bench"]), *a.serve_args]
    proc = subprocess.Popen(cmd, env={k: v for k, v in os.environ.items()
                                      if k != "KVFLOW_API_KEY"})
    deadline = time.monotonic() + 600
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"kvflow serve exited with {proc.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError("kvflow serve did not come up")
        time.sleep(0.5)


def one_run(a, policy: str) -> dict:
    port = _free_port_run(2)
    url, replicas = f"http://127.0.0.1:{port}", [f"http://127.0.0.1:{port + i}" for i in (1, 2)]
    convs = make_conversations(a, random.Random(a.seed))
    proc = start(a, policy, port)
    try:
        q0, h0 = prefix_counts(replicas)
        res = asyncio.run(run_workload(url, "bench", convs, a))
        q1, h1 = prefix_counts(replicas)
        res["prefix_hit_rate"] = round((h1 - h0) / max(q1 - q0, 1.0), 4)
        res["routed"] = list(routed(url).values())
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(120)
    return {"policy": policy, **res}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--policies", default="prefix,round_robin")
    p.add_argument("--systems", type=int, default=4)
    p.add_argument("--system-words", type=int, default=200)
    p.add_argument("--users", type=int, default=24)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--user-words", type=int, default=150)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=6)
    p.add_argument("--num-threads", type=int, default=1, help="per replica")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="docs/router/router_prefix.json")
    p.add_argument("serve_args", nargs="*", help="after --: more `kvflow serve` flags")
    a = p.parse_args()
    policies, runs = a.policies.split(","), []
    for r in range(a.rounds):
        for policy in (policies if r % 2 == 0 else policies[::-1]):
            runs.append({"round": r, **one_run(a, policy)})
            print(json.dumps(runs[-1]), flush=True)
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w") as f:
        json.dump({"args": vars(a), "runs": runs}, f, indent=1)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
