"""Cold start of `kvflow serve`: process spawn -> /health answers -> first streamed token.

    .venv/bin/python benchmarks/serve_cold_start.py [--runs 3] [--model PATH] [-- serve flags]

Each run spawns a fresh server on a free port, polls /health every 10 ms, then streams one
completion of one token; it prints both times and the median over runs. The default model is the
embedded SmolLM2-135M GGUF. KVFLOW_ENABLE_MULTIPROCESSING=0 measures the in-thread engine core.
"""
import argparse
import socket
import statistics
import subprocess
import sys
import time

import httpx


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_run(model: str | None, extra: list[str]) -> tuple[float, float]:
    port = _free_port()
    cmd = [sys.executable, "-m", "kvflow.cli", "serve", "--port", str(port),
           "--log-level", "warning", *(["--model", model] if model else []), *extra]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"kvflow serve exited with {proc.returncode}")
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.01)
        t_up = time.perf_counter() - t0
        body = {"prompt": "The capital of France is", "max_tokens": 1, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    break
        return t_up, time.perf_counter() - t0
    finally:
        proc.terminate()
        proc.wait(30)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--model", default=None)
    a, extra = p.parse_known_args()
    firsts = []
    for i in range(a.runs):
        up, first = one_run(a.model, [x for x in extra if x != "--"])
        firsts.append(first)
        print(f"run {i + 1}: /health after {up:.2f} s, first token after {first:.2f} s")
    print(f"median first token: {statistics.median(firsts):.2f} s")


if __name__ == "__main__":
    main()
