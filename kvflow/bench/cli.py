"""`kvflow bench serve`: argument parsing and the run (see kvflow/bench/serve.py)."""
from __future__ import annotations

import asyncio
import json
import math
import os
import sys
import time


def add_bench_parser(sub) -> None:
    b = sub.add_parser("bench", help="benchmarks (serve: load-test an OpenAI-compatible server)")
    bsub = b.add_subparsers(dest="bench_command", required=True)
    p = bsub.add_parser("serve", help="load-test an OpenAI-compatible server, like `vllm bench "
                                      "serve`")
    p.add_argument("--base-url", default=None, help="default: http://HOST:PORT")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--backend", default="openai", choices=["openai", "openai-chat"],
                   help="openai: /v1/completions; openai-chat: /v1/chat/completions")
    p.add_argument("--endpoint", default=None, help="overrides the backend's endpoint path")
    p.add_argument("--model", default=None, help="model name to send (default: the server's "
                                                  "first in /v1/models)")
    p.add_argument("--tokenizer", default=None, help="HF dir or .gguf used to build prompts "
                                                     "(default: the embedded SmolLM2)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    p.add_argument("--dataset-name", default="random",
                   choices=["random", "azure-conv", "azure-code"])
    p.add_argument("--num-prompts", type=int, default=200)
    p.add_argument("--random-input-len", type=int, default=1024)
    p.add_argument("--random-output-len", type=int, default=128)
    p.add_argument("--random-range-ratio", type=float, default=0.0)
    p.add_argument("--max-model-len", type=int, default=None,
                   help="for scaling trace lengths (default: the server's, from /v1/models)")
    p.add_argument("--length-scale", default="auto",
                   help="multiply trace lengths by this ('auto': fit the longest in "
                        "max_model_len)")
    p.add_argument("--request-rate", default=None,
                   help="req/s, 'inf' (all at once) or 'trace' (the trace's own arrival times); "
                        "default: trace for azure-*, inf for random")
    p.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of the gaps between arrivals (1: Poisson)")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--percentiles", default="50,99", help="comma-separated, e.g. 50,90,99")
    p.add_argument("--timeout", type=float, default=600.0, help="per request, seconds")
    p.add_argument("--no-warmup", dest="warmup", action="store_false")
    p.add_argument("--result-file", default=None, help="write the metrics as JSON here")
    p.add_argument("--save-detailed", action="store_true",
                   help="also write per-request lengths, TTFTs, ITLs and errors")
    p.set_defaults(func=cmd_bench_serve)


def _server_models(base_url: str, api_key: str | None) -> list[dict]:
    import httpx
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = httpx.get(base_url.rstrip("/") + "/v1/models", headers=headers, timeout=30)
        r.raise_for_status()
        return r.json().get("data", [])
    except Exception as e:
        print(f"kvflow bench serve: cannot list models at {base_url}: {e!r}", file=sys.stderr)
        return []


def cmd_bench_serve(args) -> int:
    from kvflow.bench.datasets import load_tokenizer, sample_requests
    from kvflow.bench.serve import calculate_metrics, format_report, parse_rate, run_benchmark

    base = args.base_url or f"http://{args.host}:{args.port}"
    endpoint = args.endpoint or ("/v1/chat/completions" if args.backend == "openai-chat"
                                 else "/v1/completions")
    percentiles = [float(x) for x in args.percentiles.split(",") if x.strip()]
    rate = parse_rate(args.request_rate or ("trace" if args.dataset_name != "random" else "inf"))
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError("--max-concurrency must be >= 1")
    models = [] if args.model and args.max_model_len else _server_models(base, args.api_key)
    model = args.model or (models[0]["id"] if models else None)
    if model is None:
        raise ValueError("no --model given and the server lists none")
    max_len = args.max_model_len or next(
        (m.get("max_model_len") for m in models if m.get("id") == model and
         m.get("max_model_len")), 2048)
    scale = None if args.length_scale == "auto" else float(args.length_scale)
    tokenizer = load_tokenizer(args.tokenizer)
    requests, info = sample_requests(
        tokenizer, args.dataset_name, args.num_prompts, input_len=args.random_input_len,
        output_len=args.random_output_len, range_ratio=args.random_range_ratio,
        request_rate=rate, burstiness=args.burstiness, max_model_len=max_len,
        length_scale=scale, seed=args.seed)
    print(f"kvflow bench serve: {len(requests)} requests ({info['dataset']}, mean prompt "
          f"{info['mean_prompt_len']:.0f}, mean output {info['mean_output_len']:.0f} tokens) to "
          f"{base}{endpoint}, model {model}, rate {rate}, burstiness {args.burstiness}, "
          f"max concurrency {args.max_concurrency}", file=sys.stderr)
    done = [0]

    def progress(res) -> None:
        done[0] += 1
        if done[0] % max(1, len(requests) // 10) == 0:
            print(f"  {done[0]}/{len(requests)} done", file=sys.stderr)

    results, duration = asyncio.run(run_benchmark(
        base, endpoint, model, requests, max_concurrency=args.max_concurrency,
        api_key=args.api_key, ignore_eos=args.ignore_eos, temperature=args.temperature,
        timeout=args.timeout, warmup=args.warmup, progress=progress))
    m = calculate_metrics(results, duration, percentiles, tokenizer)
    m.update(date=time.strftime("%Y-%m-%d %H:%M:%S"), base_url=base, endpoint=endpoint,
             model=model, num_prompts=len(requests),
             request_rate=rate if rate != math.inf else "inf",
             burstiness=args.burstiness, max_concurrency=args.max_concurrency,
             ignore_eos=args.ignore_eos, percentiles=percentiles, **info)
    print(format_report(m, percentiles))
    errors = [r.error for r in results if not r.success]
    if errors:
        print(f"{len(errors)} requests failed; first error: {errors[0]}", file=sys.stderr)
    if args.result_file:
        out = dict(m)
        if args.save_detailed:
            out.update(input_lens=[r.prompt_len for r in results],
                       output_lens=[r.output_tokens for r in results],
                       ttfts=[r.ttft for r in results], itls=[r.itl for r in results],
                       e2els=[r.latency for r in results], errors=errors)
        d = os.path.dirname(os.path.abspath(args.result_file))
        os.makedirs(d, exist_ok=True)
        with open(args.result_file, "w") as f:
            json.dump(out, f, indent=2)
        print(f"results written to {args.result_file}", file=sys.stderr)
    return 0 if m["completed"] else 1
