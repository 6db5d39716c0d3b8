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
    from kvflow import envs
    envs.set_process_defaults()     # first: GOMP_SPINCOUNT must be set before torch loads
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
    batched = None
    for line in sys.stdin:
        n = int(line)
        if n > 1:       # n sequences decoded together through llama.cpp's own batch API
            batched = batched or _LlamaBatched(llm, threads, 64)
            _say(batched.run(n, tokens))
            continue
        t = time.perf_counter()
        r = llm.create_completion(PROMPT, max_tokens=tokens, temperature=0.0, top_k=1)
        dt = time.perf_counter() - t
        _say({"s": dt, "tokens": r["usage"]["completion_tokens"],
              "text": r["choices"][0]["text"]})


class _LlamaBatched:
    """Greedy decoding of up to max_seqs copies of PROMPT as one llama_batch per step, on a
    second context of the same model (llama-cpp-python's Llama runs one sequence)."""

    def __init__(self, llm, threads: int, max_seqs: int) -> None:
        import llama_cpp as L
        self.L, self.llm, self.max_seqs = L, llm, max_seqs
        self.prompt = llm.tokenize(PROMPT.encode(), add_bos=True)
        p = L.llama_context_default_params()
        p.n_ctx, p.n_batch, p.n_ubatch = 8192, 2048, 512     # 64 x (prompt + 128) fits
        p.n_seq_max, p.n_threads, p.n_threads_batch = max_seqs, threads, threads
        p.kv_unified = True
        self.ctx = L.llama_init_from_model(llm._model.model, p)
        self.n_vocab = llm.n_vocab()
        self.batch = L.llama_batch_init(2048, 0, max_seqs)

    def _decode(self, rows: list[tuple[int, int, int]]) -> list:
        """rows: (token, pos, seq); every row's logits are wanted only where it is its
        sequence's last. Returns the argmax per sequence, in seq order."""
        import numpy as np
        b, last = self.batch, {s: i for i, (_, _, s) in enumerate(rows)}
        b.n_tokens = len(rows)
        for i, (tok, pos, seq) in enumerate(rows):
            b.token[i], b.pos[i], b.n_seq_id[i] = tok, pos, 1
            b.seq_id[i][0] = seq
            b.logits[i] = last[seq] == i
        if self.L.llama_decode(self.ctx, b) != 0:
            raise RuntimeError("llama_decode failed")
        return [int(np.argmax(np.ctypeslib.as_array(self.L.llama_get_logits_ith(self.ctx, i),
                                                    shape=(self.n_vocab,))))
                for i in sorted(last.values())]

    def run(self, n: int, tokens: int) -> dict:
        if n > self.max_seqs:
            raise ValueError(f"at most {self.max_seqs} sequences")
        self.L.llama_memory_clear(self.L.llama_get_memory(self.ctx), True)
        t = time.perf_counter()
        p = len(self.prompt)
        nxt = self._decode([(tok, i, s) for s in range(n) for i, tok in enumerate(self.prompt)])
        out = [[x] for x in nxt]
        for step in range(1, tokens):
            nxt = self._decode([(out[s][-1], p + step - 1, s) for s in range(n)])
            for s in range(n):
                out[s].append(nxt[s])
        dt = time.perf_counter() - t
        return {"s": dt, "tokens": n * tokens,
                "text": self.llm.detokenize(out[0]).decode(errors="replace")}


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
    ap.add_argument("--llama-streams", action="store_true",
                    help="also llama.cpp's N streams (one llama_batch per step) vs its one")
    ap.add_argument("--worker", choices=("kvflow", "llama"))
    args = ap.parse_args()
    if args.model is None:
        sys.path.insert(0, os.path.dirname(HERE))
        from kvflow.model.loader.gguf_loader import default_model_path
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
    for name, w in (("kvflow", kv), ("llama.cpp", ll if args.llama_streams else None)):
        if w is not None:
            _streams(name, w, args.streams)
    kv.close()
    ll and ll.close()


def _streams(name: str, w: Worker, n: int) -> None:
    """N concurrent streams against the same engine's single stream, medians of 3 pairs."""
    one, many = [], []
    for _ in range(3):
        r = w.run(1)
        one.append(r["tokens"] / r["s"])
        r = w.run(n)
        many.append(r["tokens"] / r["s"])
    print(f"\n{name}, {n} concurrent streams: {statistics.median(many):.1f} tok/s "
          f"aggregate vs {statistics.median(one):.1f} one stream = "
          f"{statistics.median(many) / statistics.median(one):.1f}x")


if __name__ == "__main__":
    main()
