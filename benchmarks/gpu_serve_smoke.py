"""`kvflow serve --device cuda` with the engine core in its own process: start it on the default
model, wait for /health, ask one completion, send SIGINT, and check the server exits 0.
   python benchmarks/gpu_serve_smoke.py [--port 8011] [extra serve args...]"""
import json
import signal
import subprocess
import sys
import time
import urllib.request


def wait_healthy(url: str, proc: subprocess.Popen, limit: float) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit:
        if proc.poll() is not None:
            raise SystemExit(f"server exited early with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2):
                return time.monotonic() - t0
        except OSError:
            time.sleep(0.2)
    raise SystemExit("server not healthy in time")


def main() -> int:
    port = "8011"
    args = sys.argv[1:]
    if args[:1] == ["--port"]:
        port, args = args[1], args[2:]
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "kvflow.cli", "serve", "--device", "cuda",
                             "--port", port, *args])
    try:
        print(f"healthy after {wait_healthy(url, proc, 300):.1f} s")
        body = json.dumps({"prompt": "The capital of France is", "max_tokens": 16,
                           "temperature": 0}).encode()
        req = urllib.request.Request(url + "/v1/completions", body,
                                     {"Content-Type": "application/json"})
        t0 = time.monotonic()
        with urllib.request.urlopen(req, timeout=60) as r:
            out = json.loads(r.read())
        print(f"completion in {time.monotonic() - t0:.2f} s: {out['choices'][0]['text']!r}")
    finally:
        proc.send_signal(signal.SIGINT)
        rc = proc.wait(60)
    print("server exit status", rc)
    return rc


if __name__ == "__main__":
    sys.exit(main())
