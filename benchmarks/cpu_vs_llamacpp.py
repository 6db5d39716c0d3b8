"""kvflow vs llama.cpp (llama-cpp-python) on the same GGUF file, one stream, alternating rounds.

Each engine runs in its own long-lived worker process (llama-cpp-python usually lives in another
venv: --llama-python), loads the model once, then answers "run" with one timed greedy
generation. Rounds alternate kvflow / llama.cpp so both see the same machine noise; the table
reports medians. Then kvflow alone: N concurrent streams against its own single stream.

    python benchmarks/cpu_vs_llamacpp.py --llama-python /work/peers/llama/bin/python

Building llama-cpp-python 0.3.36 from source takes ~15 minutes on 2 cores (outside make test):
    python -m venv /work/peers/llama
    CMAKE_ARGS="-DGGML_NATIVE=ON" /work/peers/llama/bin/pip install llama-cpp-python==0.3.36
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
PROMPT = "The capital of France is"


def worker_kvflow(path: str, threads: int, tokens: int) -> None:
    from kvflow import LLM, SamplingParams
    t0 = time.perf_counter()
    llm = LLM(path, max_model_len=1024, num_threads=threads)
    _say({"load_s": time.perf_counter() - t0})
    sp = SamplingParams(temperature=0, max_tokens=tokens)
    for line in sys.stdin:
        n = int(line)
        t = time.perf_counter()
        outs = llm.generate([PROMPT] * n, sp, use_tqdm=False)
        dt = time.perf_counter() - t
        _say({"s": dt, "tokens": sum(len(o.outputs[0].token_ids) for o in outs),
              "text": outs[0].outputs[0].text})


def worker_llama(path: str, threads: int, tokens: int) -> None:
    from llama_cpp import Llama
    t0 = time.perf_counter()
    llm = Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=1024,
                verbose=False)
    _say({"load_s": time.perf_counter() - t0})
    for _ in sys.stdin:
        t = time.perf_counter()
        r = llm.create_completion(PROMPT, max_tokens=tokens, temperature=0.0, top_k=1)
        dt = time.perf_counter() - t
        _say({"s": dt, "tokens": r["usage"]["completion_tokens"],
              "text": r["choices"][0]["text"]})


def _say(obj: dict) -> None:
    print(json.dumps(obj), flush=True)


class Worker:
    def __init__(self, python: str, kind: str, args) -> None:
        env = dict(os.environ, PYTHONPATH=os.path.dirname(HERE))
        self.p = subprocess.Popen(
            [python, __file__, "--worker", kind, "--model", args.model, "--threads",
             str(args.threads), "--tokens", str(args.tokens)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self.load_s = self._read()["load_s"]

    def _read(self) -> dict:
        while True:
            line = self.p.stdout.readline()
            if not line:
                raise RuntimeError("worker died")
            if line.startswith("{"):
                return json.loads(line)

    def run(self, n: int = 1) -> dict:
        self.p.stdin.write(f"{n}\n")
        self.p.stdin.flush()
        return self._read()

    def close(self) -> None:
        self.p.stdin.close()
        self.p.wait()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="GGUF file (default: the embedded SmolLM2)")
    ap.add_argument("--llama-python", default=None, help="python with llama_cpp installed")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--worker", choices=("kvflow", "llama"))
    args = ap.parse_args()
    if args.model is None:
        sys.path.insert(0, os.path.dirname(HERE))
        from kvflow.model.gguf_loader import default_model_path
        args.model = default_model_path()
    if args.worker:
        (worker_kvflow if args.worker == "kvflow" else worker_llama)(
            args.model, args.threads, args.tokens)
        return
    sys.path.insert(0, HERE)
    from cpu_info import cpu_line
    print(cpu_line())
    kv = Worker(sys.executable, "kvflow", args)
    ll = Worker(args.llama_python, "llama", args) if args.llama_python else None
    print(f"load: kvflow {kv.load_s:.2f} s" + (f", llama.cpp {ll.load_s:.2f} s" if ll else ""))
    kv.run(), ll and ll.run()      # warm-up
    rates = {"kvflow": [], "llama.cpp": []}
    texts = {}
    for _ in range(args.rounds):
        for name, w in (("kvflow", kv), ("llama.cpp", ll)):
            if w is None:
                continue
            r = w.run()
            rates[name].append(r["tokens"] / r["s"])
            texts[name] = r["text"]
    print(f"\none stream, {args.tokens} greedy tokens, {args.threads} threads, "
          f"medians of {args.rounds} alternating rounds (tok/s):")
    for name, v in rates.items():
        if v:
            print(f"  {name:10s} {statistics.median(v):7.1f}   ({', '.join(f'{x:.1f}' for x in v)})")
    if ll:
        print(f"  kvflow / llama.cpp: {statistics.median(rates['kvflow']) / statistics.median(rates['llama.cpp']):.2f}x"
              f"; same text: {texts['kvflow'] == texts['llama.cpp']}")
        print(f"  kvflow:    {texts['kvflow'][:80]!r}\n  llama.cpp: {texts['llama.cpp'][:80]!r}")
        ll.close()
    one, many = [], []
    for _ in range(3):
        r = kv.run(1)
        one.append(r["tokens"] / r["s"])
        r = kv.run(args.streams)
        many.append(r["tokens"] / r["s"])
    print(f"\nkvflow, {args.streams} concurrent streams: {statistics.median(many):.1f} tok/s "
          f"aggregate vs {statistics.median(one):.1f} one stream = "
          f"{statistics.median(many) / statistics.median(one):.1f}x")
    kv.close()


if __name__ == "__main__":
    main()
