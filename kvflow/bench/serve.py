"""`kvflow bench serve`: a client-side load generator for any OpenAI-compatible server.

It measures what `vllm bench serve` measures, the same way (vllm/benchmarks/serve.py and
lib/endpoint_request_func.py):

- a request's clock starts when its HTTP request is sent (after waiting for a --max-concurrency
  slot, so client-side queueing is not counted);
- TTFT: start -> the first SSE chunk that carries `choices` (chat: vLLM sends the role chunk
  with the first token, and so does kvflow);
- ITL: the gaps between successive `choices` chunks (a chunk may hold several tokens);
- E2EL: start -> the last `choices` chunk (the trailing usage chunk and [DONE] are not counted);
- output tokens: `usage.completion_tokens` from the stream (stream_options.include_usage), or
  the generated text re-tokenized when the server sends no usage;
- TPOT: (E2EL - TTFT) / (output tokens - 1), only for requests with more than one token;
- throughput: completed requests, output tokens and prompt + output tokens over the wall time of
  the whole run; mean / median / std / chosen percentiles with numpy (linear interpolation).
"""
from __future__ import annotations

import asyncio
import json
import math
import time
from dataclasses import dataclass, field

import numpy as np

from kvflow.bench.datasets import SampleRequest

METRICS = ("ttft", "tpot", "itl", "e2el")


@dataclass(slots=True)
class RequestResult:
    success: bool = False
    prompt_len: int = 0
    output_tokens: int | None = None    # from the server's usage, when it sends one
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    generated_text: str = ""
    error: str = ""
    start_time: float = 0.0


def result_from_events(start: float, events: list[tuple[float, dict]], prompt_len: int,
                       chat: bool) -> RequestResult:
    """Turn a stream's (timestamp, parsed data) events into a RequestResult. The network code
    and the tests both go through here."""
    r = RequestResult(prompt_len=prompt_len, start_time=start)
    last = start
    first = True
    for t, data in events:
        if choices := data.get("choices"):
            c = choices[0]
            piece = (c.get("delta") or {}).get("content") if chat else c.get("text")
            if first:
                r.ttft = t - start
                first = False
            else:
                r.itl.append(t - last)
            last = t
            r.generated_text += piece or ""
        elif usage := data.get("usage"):
            r.output_tokens = usage.get("completion_tokens")
            if usage.get("prompt_tokens") is not None:
                r.prompt_len = usage["prompt_tokens"]
        if "error" in data:
            r.error = json.dumps(data["error"])[:500]
    r.latency = last - start
    r.success = not first and not r.error
    if first and not r.error:
        r.error = "no chunk with choices was received"
    return r


def build_payload(req: SampleRequest, model: str, chat: bool, ignore_eos: bool,
                  temperature: float, extra_body: dict | None) -> dict:
    p: dict = {"model": model, "stream": True, "stream_options": {"include_usage": True},
               "temperature": temperature}
    if chat:
        p["messages"] = [{"role": "user", "content": req.prompt}]
        p["max_completion_tokens"] = req.expected_output_len
    else:
        p["prompt"] = req.prompt
        p["max_tokens"] = req.expected_output_len
    if ignore_eos:
        p["ignore_eos"] = True
    if extra_body:
        p.update(extra_body)
    return p


async def send_request(client, url: str, payload: dict, headers: dict, prompt_len: int,
                       chat: bool) -> RequestResult:
    events: list[tuple[float, dict]] = []
    start = time.perf_counter()
    try:
        async with client.stream("POST", url, json=payload, headers=headers) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode(errors="replace")
                return RequestResult(prompt_len=prompt_len, start_time=start,
                                     error=f"HTTP {resp.status_code}: {body[:500]}")
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                events.append((time.perf_counter(), json.loads(data)))
    except Exception as e:      # connection errors, timeouts, bad JSON: a failed request
        return RequestResult(prompt_len=prompt_len, start_time=start, error=repr(e)[:500])
    return result_from_events(start, events, prompt_len, chat)


def _stats(xs: list[float], percentiles: list[float]) -> dict:
    a = np.asarray(xs if xs else [0.0], dtype=float) * 1000.0
    d = {"mean": float(a.mean()), "median": float(np.median(a)), "std": float(a.std())}
    for p in percentiles:
        d[f"p{p:g}"] = float(np.percentile(a, p))
    return d


def calculate_metrics(results: list[RequestResult], duration: float,
                      percentiles: list[float] = (50.0, 99.0), tokenizer=None) -> dict:
    """vLLM's calculate_metrics (see the module docstring); times in ms in the result."""
    if not duration > 0:
        raise ValueError("duration must be > 0")
    ttfts, tpots, itls, e2els, out_lens = [], [], [], [], []
    total_input = completed = 0
    for r in results:
        if not r.success:
            continue
        n = r.output_tokens
        if not n:
            n = (len(tokenizer.encode(r.generated_text, add_special_tokens=False))
                 if tokenizer is not None else len(r.itl) + 1)
        out_lens.append(n)
        total_input += r.prompt_len
        if n > 1:
            tpots.append((r.latency - r.ttft) / (n - 1))
        itls += r.itl
        ttfts.append(r.ttft)
        e2els.append(r.latency)
        completed += 1
    total_output = int(sum(out_lens))
    m = {"duration": duration, "completed": completed, "failed": len(results) - completed,
         "total_input_tokens": int(total_input), "total_output_tokens": total_output,
         "request_throughput": completed / duration,
         "output_throughput": total_output / duration,
         "total_token_throughput": (total_input + total_output) / duration}
    for name, xs in zip(METRICS, (ttfts, tpots, itls, e2els)):
        for k, v in _stats(xs, list(percentiles)).items():
            m[f"{k}_{name}_ms"] = v
    return m


async def run_benchmark(base_url: str, endpoint: str, model: str, requests: list[SampleRequest],
                        *, max_concurrency: int | None = None, api_key: str | None = None,
                        ignore_eos: bool = False, temperature: float = 0.0,
                        extra_body: dict | None = None, timeout: float = 600.0,
                        warmup: bool = True, progress=None) -> tuple[list[RequestResult], float]:
    """Send `requests` at their arrival offsets; returns (results in input order, duration)."""
    import httpx
    chat = "chat" in endpoint
    url = base_url.rstrip("/") + endpoint
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=max_concurrency, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout), limits=limits) as client:
        if warmup:      # one request first: fail fast on a wrong URL, model or key
            r0 = requests[0]
            res = await send_request(client, url, build_payload(
                SampleRequest(r0.prompt, r0.prompt_len, min(r0.expected_output_len, 4)), model,
                chat, ignore_eos, temperature, extra_body), headers, r0.prompt_len, chat)
            if not res.success:
                raise RuntimeError(f"the initial test request failed: {res.error}")
        sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None

        async def one(req: SampleRequest) -> RequestResult:
            payload = build_payload(req, model, chat, ignore_eos, temperature, extra_body)
            if sem is None:
                res = await send_request(client, url, payload, headers, req.prompt_len, chat)
            else:
                async with sem:
                    res = await send_request(client, url, payload, headers, req.prompt_len, chat)
            if progress is not None:
                progress(res)
            return res

        t0 = time.perf_counter()
        tasks = []
        for req in requests:
            delay = req.arrival - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(req)))
        results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter() - t0


def format_report(m: dict, percentiles: list[float]) -> str:
    lines = ["{s:{c}^60}".format(s=" Serving Benchmark Result ", c="=")]

    def row(label, value, fmt="{:<40} {:<10.2f}"):
        lines.append(fmt.format(label, value))

    row("Successful requests:", m["completed"], "{:<40} {:<10}")
    row("Failed requests:", m["failed"], "{:<40} {:<10}")
    if m.get("max_concurrency"):
        row("Maximum request concurrency:", m["max_concurrency"], "{:<40} {:<10}")
    rate = m.get("request_rate")
    if rate is not None:
        row("Request rate (req/s):", rate, "{:<40} {:<10}")
    row("Benchmark duration (s):", m["duration"])
    row("Total input tokens:", m["total_input_tokens"], "{:<40} {:<10}")
    row("Total generated tokens:", m["total_output_tokens"], "{:<40} {:<10}")
    row("Request throughput (req/s):", m["request_throughput"])
    row("Output token throughput (tok/s):", m["output_throughput"])
    row("Total token throughput (tok/s):", m["total_token_throughput"])
    titles = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
              "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}
    for name in METRICS:
        lines.append("{s:{c}^60}".format(s=f" {titles[name]} ", c="-"))
        row(f"Mean {name.upper()} (ms):", m[f"mean_{name}_ms"])
        row(f"Median {name.upper()} (ms):", m[f"median_{name}_ms"])
        for p in percentiles:
            row(f"P{p:g} {name.upper()} (ms):", m[f"p{p:g}_{name}_ms"])
    lines.append("=" * 60)
    return "\n".join(lines)


def parse_rate(s: str) -> float | str:
    if s == "trace":
        return s
    v = float(s)
    if not v > 0:
        raise ValueError(f"request rate must be > 0, 'inf' or 'trace', got {s!r}")
    return math.inf if math.isinf(v) else v
